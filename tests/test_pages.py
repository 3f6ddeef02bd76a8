"""Every page the tools write opens in headless Chromium without a JavaScript error, and each of its
plots drew its data; a screenshot of each is kept (under $SCREENSHOTS, default /tmp/twin-screenshots).
The pages: `twin report` (with and without the scaling and validation sections), the timeline of
`twin simulate --html` (one rank and a 64-rank --full run), `twin topology --html`, `twin scaling
--html` and `twin validate --html`.
Also the report's parts that need no browser: critical path, layer window, traffic between groups."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from browser import SHOTS, assert_drew, close_browser, render_page
from fake_run import fake_run
from twin.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def one_browser():
    """Every page of this module opens in one browser (starting Chromium costs seconds)."""
    yield
    close_browser()
SMALL = ["--system", "perlmutter", "--model", "gpt-1b", "--gpus", "16", "--batch", "16"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A report of a job that crosses dragonfly groups (32 nodes of 16-node groups, so the data axis'
    rings leave their group), built once."""
    from twin.present.report import build_report
    from topologies.system import load_system
    import dataclasses

    s = load_system("perlmutter")
    small = dataclasses.replace(s, dragonfly=dataclasses.replace(s.dragonfly, nodes_per_group=16))
    return build_report(small, "gpt-1b", 128, "2x4x2x8", batch=64, top=0)


def test_report_page_draws_every_plot(report, tmp_path):
    path = tmp_path / "report.html"
    path.write_text(report.html)
    result = render_page(path, SHOTS / "report.png")
    assert_drew(result, {"plot-breakdown", "plot-timeline", "plot-groups", "plot-node"})
    timeline = next(p for p in result["plots"] if p["id"] == "plot-timeline")
    assert timeline["height"] < 4000  # drawable: not one canvas taller than a browser can draw


def test_report_parts(report):
    r = report.result
    assert report.critical and all(rank == 0 for rank, _ in report.critical)
    names = {n for _, n in report.critical}
    assert "loss.fwd.loss" in names or any(n.startswith("head") for n in names)
    a, b = report.window
    assert 0 <= a < b < r.iteration_time_s  # opens on one layer, not the whole iteration
    assert report.groups == [0, 1]
    assert set(report.group_load) == {"data"}  # only the data axis leaves a group of 16 nodes
    m = report.group_load["data"]
    assert np.isnan(m[0, 0]) and m[0, 1] > 0 and m[1, 0] > 0
    assert report.crossing["x"] == 0 and report.crossing["data"] == pytest.approx(0.25)  # 2 of 8 hops
    assert report.hops["x"] == [(0, 1), (1, 0), (2, 3), (3, 2)]  # x rings of 2 inside the node
    assert any("hottest global links" in line for line in report.summary)


def test_report_command(tmp_path):
    out = tmp_path / "new" / "folder" / "r.html"  # folders are created
    r = runner.invoke(app, ["report", *SMALL, "--grid", "2x4x2x1", "--top", "0", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert out.is_file() and "Plotly.newPlot" in out.read_text()
    assert "compute runs" in r.stdout.lower()


def test_simulate_timeline_and_topology_pages(tmp_path):
    html, topo = tmp_path / "t.html", tmp_path / "topo.html"
    r = runner.invoke(app, ["simulate", *SMALL, "--grid", "2x2x2x2", "--html", str(html)])
    assert r.exit_code == 0, r.output
    assert_drew(render_page(html, SHOTS / "timeline.png"))
    r = runner.invoke(app, ["topology", "--system", "frontier", "--gpus", "2048", "--html", str(topo)])
    assert r.exit_code == 0, r.output
    result = render_page(topo, SHOTS / "topology.png")
    assert_drew(result)


def test_full_run_timeline_stays_drawable(tmp_path):
    """64 ranks in full mode: the timeline draws a few ranks (the first, the straggler, the waiting)
    and the ranks chart every rank."""
    from twin.present.plots import MAX_RANKS, pick_ranks, ranks_figure, timeline_html
    from twin.predict.simulate import SimulationConfig, simulate
    r = simulate(SimulationConfig("perlmutter", "gpt-1b", 64, "2x2x4x4", batch=64, full=True, slowdown={5: 1.3},
                                  record=True))
    shown = pick_ranks(r.spans)
    assert len(shown) == MAX_RANKS and 0 in shown and 5 in shown
    path = tmp_path / "full.html"
    path.write_text(timeline_html(r.spans, "full", waits=r.waits))
    assert path.stat().st_size < 6e6
    result = render_page(path, SHOTS / "full.png")
    assert_drew(result)
    assert result["plots"][0]["height"] < 1500  # 64 ranks x 6 rows would be ~9,400 px
    fig = ranks_figure(r.spans, r.iteration_time_s, r.waits)
    assert len(fig.data[0].x) == 64


def test_output_paths_are_checked_before_the_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = runner.invoke(app, ["simulate", *SMALL, "--grid", "2x2x2x2", "--trace", str(blocker)])
    assert r.exit_code == 2 and "not a folder" in r.output and ".tmp" not in r.output
    r = runner.invoke(app, ["simulate", *SMALL, "--grid", "2x2x2x2", "--html", str(blocker / "t.html")])
    assert r.exit_code == 2 and "error:" in r.output
    r = runner.invoke(app, ["simulate", *SMALL, "--grid", "2x2x2x2", "--html", str(tmp_path / "a" / "b" / "t.html")])
    assert r.exit_code == 0 and (tmp_path / "a" / "b" / "t.html").is_file()


def test_scaling_validate_and_the_report_with_both(tmp_path):
    """`twin scaling --html`, `twin validate --html`, and a report that draws the scaling curve (from
    `twin scaling --json`) and the twin-vs-backend scatter (from a run folder)."""
    scaling = ["scaling", "--system", "cpu", "--series", "strong"]
    r = runner.invoke(app, [*scaling, "--html", str(tmp_path / "scaling.html")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*scaling, "--json"])
    assert r.exit_code == 0, r.output
    (tmp_path / "scaling.json").write_text(r.stdout)
    run = fake_run(tmp_path / "run", "2x1x1x1")
    r = runner.invoke(app, ["validate", str(run), "--system", "cpu", "--html", str(tmp_path / "validate.html")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["report", "--system", "cpu", "--model", "gpt-tiny", "--gpus", "2", "--grid", "2x1x1x1",
                            "--top", "0", "--run", str(run), "--scaling", str(tmp_path / "scaling.json"),
                            "--out", str(tmp_path / "report.html"), "--quiet"])
    assert r.exit_code == 0, r.output
    page = render_page(tmp_path / "scaling.html", SHOTS / "scaling.png")
    assert_drew(page)
    assert sum(p["points"] for p in page["plots"]) >= 4  # the four GPU counts of the series
    assert_drew(render_page(tmp_path / "validate.html", SHOTS / "validate.png"), {"plot-iteration", "plot-ops"})
    page_text = (tmp_path / "validate.html").read_text()
    assert "Iteration time: median |error|" in page_text and "How to read it" in page_text
    assert "<h2>Per kind of op</h2>" in page_text and "<td>2x1x1x1</td>" in page_text
    assert_drew(render_page(tmp_path / "report.html", SHOTS / "report-cpu.png"),
                {"plot-breakdown", "plot-timeline", "plot-scaling", "plot-validation"})
    assert "Iteration time: median |error|" in (tmp_path / "report.html").read_text()  # the validation in words
