"""Every chart agrees with its table: each page is opened in headless Chromium, the numbers its plots
hold are read back from the page (tests/browser.py, page_data) and compared with the numbers the
same page (or the same command) prints: the report's breakdown, timeline and grid search, the
scaling page, the topology page."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from typer.testing import CliRunner

from browser import close_browser, page_data
from twin.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def one_browser():
    yield
    close_browser()


@pytest.fixture(scope="module")
def report_page(tmp_path_factory):
    """A report with a grid search (grid auto) and a few ranks of a full run with a straggler."""
    from twin.present.report import build_report
    rep = build_report("perlmutter", "gpt-1b", 16, batch=16, top=6, simulate_top=2)
    path = tmp_path_factory.mktemp("pages") / "report.html"
    path.write_text(rep.html)
    return rep, page_data(path)


def _table(data: dict, first_header: str) -> list[list[str]]:
    return next(t for t in data["tables"] if t and t[0] and t[0][0] == first_header)


def _seconds(trace: dict) -> float:
    if trace["type"] == "bar":
        return sum(trace["x"])
    xs = trace["x"]
    return sum(xs[i + 1] - xs[i] for i in range(0, len(xs), 3))


def test_the_breakdown_chart_draws_the_breakdown_table(report_page):
    _, data = report_page
    printed = {row[0]: float(row[1]) for row in _table(data, "where the time goes")[1:]}
    drawn = {t["name"].rsplit(" ", 2)[0]: t["x"][0] for t in data["plots"]["plot-breakdown"]["traces"]}
    assert set(drawn) == set(printed) - {"iteration"}
    for part, seconds in drawn.items():
        assert seconds == pytest.approx(printed[part], abs=1e-4)
    assert sum(drawn.values()) == pytest.approx(printed["iteration"], abs=1e-3)


def test_the_timelines_waits_are_the_breakdowns_exposed_communication(report_page):
    _, data = report_page
    printed = {row[0]: float(row[1]) for row in _table(data, "where the time goes")[1:]}
    drawn: dict[str, float] = defaultdict(float)
    for t in data["plots"]["plot-timeline"]["traces"]:
        if t["name"].startswith("exposed comm "):
            drawn["exposed " + t["name"].removeprefix("exposed comm ")] += _seconds(t)
    assert drawn, "the timeline draws no exposed communication"
    for part, seconds in printed.items():
        if part.startswith("exposed "):
            assert drawn[part] == pytest.approx(seconds, abs=1e-3), (part, drawn, printed)
    network = _table(data, "axis")
    for row in network[1:]:
        assert drawn.get(f"exposed {row[0]}", 0.0) == pytest.approx(float(row[-1].split()[0]), abs=1e-3)


def test_the_search_chart_adds_up_to_the_estimate_and_marks_the_chosen_grid(report_page):
    rep, data = report_page
    rows = _table(data, "rank")
    header = rows[0]
    printed = {r[1]: r for r in rows[1:]}
    traces = data["plots"]["plot-search"]["traces"]
    stacked: dict[str, float] = defaultdict(float)
    for t in traces:
        if t["name"] == "compute (analytical)" or t["name"].startswith("exposed comm "):
            for grid, y in zip(t["x"], t["y"]):
                stacked[grid] += y
    assert set(stacked) == set(printed)
    for grid, total in stacked.items():
        assert total == pytest.approx(float(printed[grid][header.index("analytical (s)")]), abs=2e-3)
    compute = dict(zip(*(next(t for t in traces if t["name"] == "compute (analytical)")[k] for k in ("x", "y"))))
    hidden = [t for t in traces if "hidden behind compute" in t["name"]]
    for t in hidden:  # overlapped: drawn from 0, inside the compute bar, adding nothing
        assert all(b == 0 for b in t["base"])
        assert all(y <= compute[g] + 1e-9 for g, y in zip(t["x"], t["y"]))
    star = next(t for t in traces if t["name"] == "chosen grid")
    chosen = [r[1] for r in rows[1:] if "(chosen)" in r[0]]
    assert star["x"] == chosen == [rep.result.grid_str]
    diamonds = next(t for t in traces if t["name"] == "simulated")
    for grid, y in zip(diamonds["x"], diamonds["y"]):
        assert y == pytest.approx(float(printed[grid][header.index("simulated (s)")]), abs=1e-3)
    assert any("hidden" in n and "overlapped" in n for n in data["notes"])
    assert not any("not overlapped" in n for n in data["notes"])


def test_the_scaling_page_draws_the_series_it_prints(tmp_path):
    path = tmp_path / "scaling.html"
    args = ["scaling", "--system", "perlmutter", "--series", "strong", "--quiet"]
    r = runner.invoke(app, [*args, "--json", "--html", str(path)])
    assert r.exit_code == 0, r.output
    points = json.loads(r.stdout)["points"]
    data = page_data(path)
    plot = next(iter(data["plots"].values()))
    peak = next(t for t in plot["traces"] if t["name"] == "% of peak")
    assert peak["x"] == [p["gpus"] for p in points]
    assert peak["y"] == pytest.approx([p["percent_of_peak"] for p in points])
    ticks = plot["ticks"]["x"]
    assert ticks == [f"{p['gpus']:,}" for p in points]  # plain GPU counts, not 1.024k


def test_the_report_scaling_axis_reads_plain_gpu_counts(tmp_path):
    from twin.present.page import Page
    from twin.present.plots import scaling_figure
    page = Page("scaling")
    page.figure("scaling", scaling_figure([{"gpus": n, "flops_per_s": n * 1e14} for n in (1024, 4096, 16384)]))
    path = tmp_path / "s.html"
    path.write_text(page.html())
    ticks = page_data(path)["plots"]["plot-scaling"]["ticks"]["x"]
    assert ticks == ["1,024", "4,096", "16,384"]


def test_the_simulate_timeline_page_draws_the_printed_breakdown(tmp_path):
    path = tmp_path / "t.html"
    args = ["simulate", "--system", "perlmutter", "--model", "gpt-1b", "--gpus", "16", "--batch", "16",
            "--grid", "2x4x2x1", "--html", str(path), "--json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    printed = json.loads(r.stdout)["breakdown_s"]
    drawn: dict[str, float] = defaultdict(float)
    for t in next(iter(page_data(path)["plots"].values()))["traces"]:
        if t["name"].startswith("exposed comm "):
            drawn[t["name"].removeprefix("exposed comm ")] += _seconds(t)
    assert drawn
    for axis, seconds in printed["exposed_comm"].items():
        assert drawn.get(axis, 0.0) == pytest.approx(seconds, abs=1e-3), (axis, drawn, printed)


def test_the_topology_page_draws_the_job_it_prints(tmp_path):
    import re
    path = tmp_path / "topo.html"
    r = runner.invoke(app, ["topology", "--system", "frontier", "--gpus", "2048", "--html", str(path)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    groups_used, groups = map(int, re.search(r"nodes in (\d+) of (\d+) groups", text).groups())
    data = page_data(path)
    traces = next(iter(data["plots"].values()))["traces"]
    marks = next(t for t in traces if t["name"].startswith("groups"))
    assert len(marks["x"]) == groups
    assert f"({groups_used} hold the job" in marks["name"]
    assert sum("the job uses" in s for s in marks["text"]) == groups_used
