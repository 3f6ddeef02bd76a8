"""`twin simulate` and `twin search` end to end, on the real system specs and collective model."""

import json

import pytest
from typer.testing import CliRunner

from twin.cli.main import app
from twin.predict.simulate import SimulationConfig, simulate
from twin.program.grid import Grid
from twin.program.trace import read_trace

runner = CliRunner()
SMALL = ["--system", "perlmutter", "--model", "gpt-1b", "--gpus", "16", "--batch", "16"]
KEYS = {"system", "model", "gpus", "grid", "global_batch", "seq_len", "iteration_time_s", "flops_per_iteration",
        "flops_per_s", "flops_per_s_per_gpu", "percent_of_peak", "breakdown_s", "memory_per_gpu_bytes",
        "simulated_ops", "wall_time_s"}


def sim_json(*args) -> dict:
    r = runner.invoke(app, ["simulate", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_json_keys_and_breakdown():
    d = sim_json(*SMALL, "--grid", "2x2x2x2")
    assert KEYS <= set(d)
    assert d["grid"] == {"x": 2, "y": 2, "z": 2, "data": 2} and d["gpus"] == 16
    b = d["breakdown_s"]
    assert set(b) == {"compute", "exposed_comm", "idle"} and set(b["exposed_comm"]) == {"x", "y", "z", "data"}
    parts = b["compute"] + sum(b["exposed_comm"].values()) + b["idle"]
    assert parts == pytest.approx(d["iteration_time_s"], rel=1e-9)
    assert d["flops_per_s"] == pytest.approx(d["flops_per_iteration"] / d["iteration_time_s"])
    assert d["percent_of_peak"] == pytest.approx(100 * d["flops_per_s"] / (16 * 312e12))
    assert list(d)[-1] == "wall_time_s"


def test_deterministic_byte_for_byte():
    def out():
        r = runner.invoke(app, ["simulate", *SMALL, "--json"])
        assert r.exit_code == 0
        return [line for line in r.stdout.splitlines() if "wall_time_s" not in line]
    assert out() == out()


def test_grid_auto_says_what_it_chose():
    d = sim_json(*SMALL)
    assert d["grid_choice"].startswith("auto")
    g = d["grid"]
    assert g["x"] * g["y"] * g["z"] * g["data"] == 16


def test_human_output_and_trace_and_html(tmp_path):
    trace, html = tmp_path / "t", tmp_path / "t.html"
    r = runner.invoke(app, ["simulate", *SMALL, "--grid", "2x2x2x2", "--trace", str(trace), "--html", str(html)])
    assert r.exit_code == 0, r.output
    assert "iteration time" in r.stdout and "exposed comm" in r.stdout
    spans = read_trace(trace)
    assert {s.stream for s in spans} == {"compute", "x", "y", "z", "data"}
    assert {s.rank for s in spans} == {0}
    assert "plotly" in html.read_text()[:5000].lower()


def test_overlap_switches_through_the_api():
    base = dict(system="perlmutter", model="gpt-1b", gpus=16, grid="2x4x2x1", batch=16)
    from twin.program.program import Options
    on = simulate(SimulationConfig(**base))
    off = simulate(SimulationConfig(**base, options=Options(oar=False, ors=False, oag=False)))
    assert off.iteration_time_s >= on.iteration_time_s
    assert sum(off.breakdown_s["exposed_comm"].values()) >= sum(on.breakdown_s["exposed_comm"].values())


def test_full_mode_agrees_with_symmetric():
    base = dict(system="perlmutter", model="gpt-1b", gpus=16, grid="2x2x2x2", batch=16)
    s, f = simulate(SimulationConfig(**base)), simulate(SimulationConfig(**base, full=True))
    assert f.simulated_ranks == 16 and f.simulated_ops == 16 * s.simulated_ops
    assert f.iteration_time_s == pytest.approx(s.iteration_time_s, rel=1e-6)  # ns rounding of re-rates


@pytest.mark.parametrize("args,words", [
    (["--system", "nowhere"], "unknown system"),
    (["--system", "perlmutter", "--model", "gpt-nope"], "unknown model"),
    ([*SMALL, "--grid", "2x2x2"], "XxYxZxD"),
    ([*SMALL, "--grid", "4x4x2x2"], "64 GPUs"),
    (["--system", "perlmutter", "--model", "gpt-80b", "--gpus", "16", "--grid", "1x1x1x16"], "does not fit"),
    ([*SMALL, "--placement", "random"], "placement"),
    ([*SMALL, "--slowdown", "x:y"], "slowdown"),
    (["--system", "perlmutter", "--gpus", "10000000"], "GPUs"),
    (["--system", "perlmutter", "--model", "gpt-1b", "--gpus", "7"], "no grid of 7 GPUs"),
    ([*SMALL, "--micro-batches", "0"], "micro-batches"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    r = runner.invoke(app, ["simulate", *args])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_search_prints_top_grids():
    r = runner.invoke(app, ["search", *SMALL, "--top", "3", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    # the top 3, and any grid further down that the search simulated because it might be faster
    assert len(rows) >= 3 and all(row["simulated_s"] > 0 for row in rows)
    assert [row["analytical_s"] for row in rows] == sorted(row["analytical_s"] for row in rows)
    r = runner.invoke(app, ["search", "--system", "nowhere"])
    assert r.exit_code == 2


@pytest.mark.slow
def test_frontier_default_study():
    d = sim_json("--system", "frontier")
    assert d["model"] == "gpt-320b" and d["gpus"] == 32768
    assert 0 < d["percent_of_peak"] < 100


def test_timeline_figure_bars_and_segments():
    from twin.present.plots import MAX_BARS, timeline_figure
    from twin.program.trace import Span
    spans = [Span(0, "a", "gemm", "compute", 0.0, 1.0), Span(0, "b", "all_reduce", "x", 0.5, 0.25)]
    fig = timeline_figure(spans)
    assert {t.type for t in fig.data} == {"bar"}
    bar = next(t for t in fig.data if t.name == "all_reduce")
    assert tuple(bar.base) == (0.5,) and tuple(bar.x) == (0.25,) and bar.orientation == "h"
    many = [Span(r % 4, f"op{r}", "gemm", "compute", float(r), 0.5) for r in range(MAX_BARS + 1)]
    assert {t.type for t in timeline_figure(many).data} == {"scattergl"}


def test_an_impossible_full_trace_is_refused_before_the_grid_search(tmp_path, monkeypatch):
    import twin.predict.simulate as sim

    def no_search(*a, **k):
        raise AssertionError("the grid search ran before the trace was refused")

    monkeypatch.setattr(sim, "choose_grid", no_search)
    r = runner.invoke(app, ["simulate", "--system", "frontier", "--full", "--trace", str(tmp_path / "t")])
    assert r.exit_code == 2
    assert "a trace of this run would hold" in r.output and "Traceback" not in r.output
    from twin.predict.run import min_ops_per_rank
    from twin.predict.study_cache import program_for
    study = sim.prepare("perlmutter", "gpt-1b", 16, 16)
    assert min_ops_per_rank(study) <= min(len(program_for(study, g).ops) for g in (
        Grid(2, 2, 2, 2), Grid(1, 4, 4, 1), Grid(16, 1, 1, 1), Grid(1, 1, 1, 16)))


def test_report_full_on_a_default_study_draws_what_fits_and_says_what_it_left_out(tmp_path):
    """On perlmutter's default study every rank is simulated, but the timelines of all of them would be
    more events than the twin records, so the page draws one representative rank and says so."""
    out = tmp_path / "r.html"
    r = runner.invoke(app, ["report", "--system", "perlmutter", "--full", "--quiet", "--out", str(out)])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "one representative rank" in said and "more than the 4,000,000 the twin records" in said
    assert "one representative rank" in out.read_text()
