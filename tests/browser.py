"""Open a page the tools wrote in headless Chromium and say what it drew.

`render_page(path, screenshot)` loads the page (Debian's chromium through playwright; one browser
for the whole session, closed by tests/conftest.py), records
JavaScript errors and, for each plotly plot, how many traces and data points it holds and how many it
drew (SVG traces, heat map images, WebGL canvases), then saves a full-page screenshot. Tests skip,
saying why, where no browser can start. `page_data(path)` reads back what a page's plots hold and
what its tables print, so that tests compare the two.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
SHOTS = Path(os.environ.get("SCREENSHOTS", "/tmp/twin-screenshots"))

INSPECT = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => {
  const data = gd.data || [];
  const points = data.reduce((n, t) => n + ((t.x && t.x.length) || (t.z && t.z.length) || (t.y && t.y.length) || 0), 0);
  const drawn = gd.querySelectorAll('g.trace, g.hm, g.heatmaplayer image, .barlayer .point').length
              + (gd._fullLayout && gd._fullLayout._glcanvas ? gd._fullLayout._glcanvas.size() : 0);
  const rect = gd.getBoundingClientRect();
  return {id: gd.id, traces: data.length, points: points, drawn: drawn, width: rect.width, height: rect.height,
          title: (gd.layout && gd.layout.title && (gd.layout.title.text || gd.layout.title)) || ''};
})"""


DATA = """() => {
  const arr = v => (v == null ? null : v._inputArray ? Array.from(v._inputArray)  // typed arrays plotly decoded
                  : (typeof v === 'object' && v.length !== undefined ? Array.from(v) : v));
  const plots = {};
  document.querySelectorAll('.js-plotly-plot').forEach(gd => {
    plots[gd.id] = {
      traces: (gd.data || []).map(t => ({name: t.name || '', type: t.type || 'scatter', x: arr(t.x), y: arr(t.y),
                                        z: t.z ? Array.from(t.z, r => arr(r)) : null, base: arr(t.base),
                                        text: arr(t.text), visible: t.visible === undefined ? true : t.visible})),
      ticks: {x: Array.from(gd.querySelectorAll('.xtick text'), e => e.textContent),
              y: Array.from(gd.querySelectorAll('.ytick text'), e => e.textContent)},
      title: (gd.layout && gd.layout.title && (gd.layout.title.text || gd.layout.title)) || '',
      buttons: Array.from(gd.querySelectorAll('.updatemenu-button text'), e => e.textContent),
    };
  });
  const tables = Array.from(document.querySelectorAll('table'), t =>
    Array.from(t.querySelectorAll('tr'), r => Array.from(r.querySelectorAll('th, td'), c => c.textContent.trim())));
  const notes = Array.from(document.querySelectorAll('p'), p => p.textContent);
  return {plots, tables, notes};
}"""


def browser_or_skip():
    """playwright's sync API, or skip the test with the reason."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM=/path/to/chrome)")
    return sync_playwright


_SESSION: dict = {}  # one browser for the whole test session: starting Chromium costs seconds


def _browser():
    if "skip" in _SESSION:
        pytest.skip(_SESSION["skip"])
    if "browser" not in _SESSION:
        pw = browser_or_skip()().start()
        try:
            _SESSION["browser"] = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                                     args=["--no-sandbox", "--disable-gpu", "--use-gl=swiftshader"])
        except Exception as e:  # noqa: BLE001 - any launch failure means no browser here
            pw.stop()
            _SESSION["skip"] = f"Chromium at {CHROMIUM} does not start: {str(e).splitlines()[0]}"
            pytest.skip(_SESSION["skip"])
        _SESSION["playwright"] = pw
    return _SESSION["browser"]


def close_browser() -> None:
    """Close the session's browser (tests/conftest.py calls it when the session ends)."""
    if "browser" in _SESSION:
        _SESSION.pop("browser").close()
        _SESSION.pop("playwright").stop()


def render_page(path: Path, screenshot: Path | None = None, width: int = 1400, timeout_ms: int = 60_000) -> dict:
    """Load `path` in headless Chromium; returns {"errors": [...], "plots": [...]} (see INSPECT)."""
    page = _browser().new_page(viewport={"width": width, "height": 900})
    try:
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(Path(path).resolve().as_uri(), wait_until="load", timeout=timeout_ms)
        page.wait_for_function("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                               ".every(gd => gd._fullLayout)", timeout=timeout_ms)
        page.wait_for_timeout(200)
        plots = page.evaluate(INSPECT)
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
    finally:
        page.close()
    return {"errors": errors, "plots": plots}


def page_data(path: Path, timeout_ms: int = 60_000) -> dict:
    """What a page holds, read in the browser after plotly drew it: per plot id its traces (name, type,
    x, y, z, base, text, visible), its drawn tick labels, title and button labels; every HTML table as
    rows of cell texts; every paragraph's text. Tests compare what a page draws with what it prints."""
    page = _browser().new_page(viewport={"width": 1400, "height": 900})
    try:
        page.goto(Path(path).resolve().as_uri(), wait_until="load", timeout=timeout_ms)
        page.wait_for_function("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                               ".every(gd => gd._fullLayout)", timeout=timeout_ms)
        page.wait_for_timeout(200)
        return page.evaluate(DATA)
    finally:
        page.close()


def assert_drew(result: dict, expect: set[str] | None = None) -> None:
    """No JavaScript error; every plot holds data and drew it; `expect` plot ids are there."""
    assert result["errors"] == [], result["errors"]
    plots = result["plots"]
    assert plots, "no plotly plot on the page"
    for p in plots:
        assert p["traces"] > 0 and p["points"] > 0, f"plot {p['id']} has no data: {p}"
        assert p["drawn"] > 0, f"plot {p['id']} drew nothing: {p}"
        assert p["width"] > 100 and p["height"] > 100, f"plot {p['id']} has no room: {p}"
    if expect:
        assert expect <= {p["id"] for p in plots}, (expect, [p["id"] for p in plots])
