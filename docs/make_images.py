"""Make every image that README.md and docs/*.md show, from the current code, each with a sidecar JSON
of the figures it shows; tests/test_images.py recomputes those figures (cheaply) and fails when an
image is out of date, saying to run this script.

    python docs/make_images.py                      # every image
    python docs/make_images.py frontier-report      # one (names: IMAGES)

- `frontier-report.png` (README): the top of `twin report --system frontier`, the system's default
  study; sidecar `frontier-report.json` (study, grid, iteration, flop/s, breakdown).
- `sweep-nic.png` (README): days to train gpt-20b on Frontier against GCDs and NIC rate, made by
  benchmarks/sweep_chart.py from `twin sweep docs/sweep-nic.toml`; sidecar `sweep-nic.json`.
- `memorization.png` (docs/memorization.md): the chart of `backend memorization-study`, drawn from
  its record `memorization.json` (the sidecar: config and every measurement). Drawing takes seconds;
  `--train` runs the study again first (2-3 minutes, needs torch).

Screenshots need headless Chromium (`apt-get install chromium`, or CHROMIUM=/path) and playwright.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
REPORT_HEIGHT = 2330  # pixels of the report's top the README shows: summary, breakdown, timeline, network


def frontier_figures(result) -> dict:
    """The figures `frontier-report.png` shows, from a SimulationResult of Frontier's default study,
    rounded as the page prints them (tests/test_images.py recomputes them with `simulate`)."""
    b = result.breakdown_s
    return {"system": result.system, "model": result.model, "gpus": result.gpus, "global_batch": result.global_batch,
            "grid": result.grid_str, "iteration_s": round(result.iteration_time_s, 3),
            "pf_per_s": round(result.flops_per_s / 1e15, 1), "percent_of_peak": round(result.percent_of_peak, 1),
            "breakdown_s": {"compute": round(b["compute"], 4), "idle": round(b["idle"], 4),
                            **{f"exposed {a}": round(v, 4) for a, v in b["exposed_comm"].items()}}}


def screenshot(html_file: Path, png: Path, width: int = 1400, height: int | None = None) -> None:
    """A screenshot of a page (its top `height` pixels, else all of it) with headless Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM if Path(CHROMIUM).exists() else None,
                                    args=["--no-sandbox", "--disable-gpu", "--use-gl=swiftshader"])
        page = browser.new_page(viewport={"width": width, "height": height or 900})
        page.goto(html_file.resolve().as_uri(), wait_until="load")
        page.wait_for_function("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                               ".every(gd => gd._fullLayout)")
        page.wait_for_timeout(500)
        clip = {"x": 0, "y": 0, "width": width, "height": height} if height else None
        page.screenshot(path=str(png), full_page=clip is None, clip=clip)
        browser.close()


def frontier_report() -> list[Path]:
    from twin.present.report import build_report

    rep = build_report("frontier")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "report.html"
        page.write_text(rep.html)
        screenshot(page, DOCS / "frontier-report.png", height=REPORT_HEIGHT)
    side = DOCS / "frontier-report.json"
    side.write_text(json.dumps({"image": "frontier-report.png", "made_by": "python docs/make_images.py frontier-report",
                                "figures": frontier_figures(rep.result)}, indent=1) + "\n")
    return [DOCS / "frontier-report.png", side]


def memorization(train: bool = False) -> list[Path]:
    from backend.studies.study import chart

    record = DOCS / "memorization.json"
    if train:
        import subprocess
        out = Path(tempfile.mkdtemp())
        subprocess.run([sys.executable, "-m", "backend.cli", "memorization-study", "--out", str(out)], check=True)
        record.write_text((out / "study.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        chart(json.loads(record.read_text()), Path(tmp) / "memorization.html", DOCS / "memorization.png")
    return [DOCS / "memorization.png", record]


def sweep_nic() -> list[Path]:
    """The README's sweep chart (benchmarks/sweep_chart.py runs docs/sweep-nic.toml and draws it)."""
    import subprocess
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep_chart.py"), "--out-dir", str(DOCS)], check=True)
    return [DOCS / "sweep-nic.png", DOCS / "sweep-nic.json"]


IMAGES = {"frontier-report": frontier_report, "memorization": memorization, "sweep-nic": sweep_nic}
SIDECARS = {"frontier-report.png": "frontier-report.json", "memorization.png": "memorization.json",
            "sweep-nic.png": "sweep-nic.json"}


def main(argv: list[str]) -> int:
    names = [a for a in argv if not a.startswith("--")] or list(IMAGES)
    unknown = [n for n in names if n not in IMAGES]
    if unknown:
        print(f"unknown image {unknown[0]}: pick from {', '.join(IMAGES)}", file=sys.stderr)
        return 2
    for name in names:
        files = memorization("--train" in argv) if name == "memorization" else IMAGES[name]()
        print("wrote " + ", ".join(str(f.relative_to(ROOT)) for f in files))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
