"""twin scaling and twin sensitivity: the series, the efficiency, the sorted sensitivity table, and
their commands (small models on a few Perlmutter GPUs, so that the whole file runs in seconds)."""

import json

import pytest

from typer.testing import CliRunner

from topologies.system import load_system
from twin.cli.main import app
from twin.predict.scaling import WEAK_SERIES, scaling, scaling_html, series_points
from twin.predict.sensitivity import sensitivity

runner = CliRunner()


def test_series_points_follow_the_model_table_and_the_machine():
    frontier, perlmutter = load_system("frontier"), load_system("perlmutter")
    assert series_points(frontier, "weak")[:2] == [("gpt-5b", 512), ("gpt-10b", 1024)]
    assert max(g for _, g in series_points(perlmutter, "weak")) <= perlmutter.total_gpus
    assert len(series_points(frontier, "weak")) == len(WEAK_SERIES)
    strong = series_points(frontier, "strong")
    assert {m for m, _ in strong} == {frontier.default_model} and strong[-1][1] == frontier.default_gpus


def test_scaling_efficiency_against_the_first_point_and_skips():
    r = scaling("perlmutter", "weak", points=[("gpt-small", 8), ("gpt-small", 16), ("gpt-small", 99999)],
                simulate_top=1)
    assert [p.gpus for p in r.points] == [8, 16]
    first, second = r.points
    assert first.efficiency == 100.0
    per_gpu = [p.flops_per_s / p.gpus for p in r.points]
    assert abs(second.efficiency - 100 * per_gpu[1] / per_gpu[0]) < 1e-9
    assert 0 < second.percent_of_peak < 100
    assert len(r.skipped) == 1 and "99999" in r.skipped[0]
    d = json.loads(r.to_json())
    assert d["series"] == "weak" and d["points"][1]["grid"] == second.grid
    assert "plotly" in scaling_html(r).lower()


def test_sensitivity_rows_sorted_and_signs_physical():
    r = sensitivity("perlmutter", "gpt-small", 16, grid="2x2x2x2")
    assert r.grid == "2x2x2x2" and r.base_s > 0
    swings = [row.swing for row in r.rows]
    assert swings == sorted(swings, reverse=True)
    rows = {row.parameter: row for row in r.rows}
    gemm = rows["profile.gemm_flops"]
    assert gemm.low_pct > 0 > gemm.high_pct            # slower GEMMs, longer iteration
    lat = rows["collectives.step_latency"]
    assert lat.low_pct < 0 < lat.high_pct              # more latency, longer iteration
    assert rows["collectives.intra_node_efficiency"].low_pct >= 0
    assert {"routing", "placement", "all-reduce algorithm"} <= set(rows)


def test_commands_print_and_refuse_bad_input():
    res = runner.invoke(app, ["sensitivity", "--system", "perlmutter", "--model", "gpt-small", "--gpus", "16",
                              "--grid", "2x2x2x2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["rows"][0]["swing_pct"] >= 0
    res = runner.invoke(app, ["scaling", "--system", "perlmutter", "--series", "sideways"])
    assert res.exit_code == 2 and "unknown series" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["scaling", "--system", "perlmutter", "--gpus", "a,b"])
    assert res.exit_code == 2 and "--gpus" in res.output
    res = runner.invoke(app, ["sensitivity", "--system", "perlmutter", "--model", "gpt-small", "--gpus", "16",
                              "--grid", "2x2x2x2", "--step", "1.5"])
    assert res.exit_code == 2 and "--step" in res.output


def test_default_study_batch_from_the_system_file():
    """Every system whose default study is one of the large GPT models (documented batch 2,048) follows
    the one rule its file states: 2,048 sequences, or the smallest multiple of the node count above it (so that x*y can stay in a node)."""
    from topologies.system import list_systems, load_system
    from twin.program.model import load_model
    from twin.predict.study import prepare
    for name in list_systems():
        s = load_system(name)
        if load_model(s.default_model).global_batch != 2048:   # cpu, h200: small models, their own batch
            continue
        nodes = -(-s.default_gpus // s.gpus_per_node)
        expect = 2048 if 2048 % nodes == 0 or nodes == 1 else -(-2048 // nodes) * nodes
        assert prepare(name).batch == expect, name
    assert prepare("alps").batch == 3072            # 1,536 nodes: 2,048 is not a multiple
    assert prepare("alps", "gpt-60b").batch == 2048  # an explicit model keeps its own batch
    assert prepare("perlmutter").batch == 2048       # no batch in the file: the model's


def test_analytical_estimate_counts_only_what_overlap_cannot_hide():
    """With OAR, ORS and OAG off every collective is exposed: the estimate is compute plus all the
    communication. With them on, it is smaller but never below compute plus the exposed part."""
    from twin.program.grid import Grid
    from twin.program.program import Options
    from twin.predict.search import Bandwidth, analytical
    from twin.predict.study import prepare
    grid = Grid(2, 2, 2, 2)
    on = prepare("perlmutter", "gpt-small", 16)
    off = prepare("perlmutter", "gpt-small", 16, options=Options(oar=False, ors=False, oag=False))
    c_on, c_off = analytical(on, grid, Bandwidth(on)), analytical(off, grid, Bandwidth(off))
    assert c_off.analytical_s == pytest.approx(c_off.compute_s + sum(c_off.comm_s.values()))
    assert c_on.comm_s == pytest.approx(c_off.comm_s)      # the same traffic, differently hidden
    assert c_on.compute_s <= c_on.analytical_s < c_off.analytical_s


def test_axonn_comm_model_bounds():
    """benchmarks/axonn_comm_model.py: the table lookup is the reference's, and its lower bound keeps
    the conclusion docs/fidelity.md draws (Perlmutter consistent, Frontier 16,384 impossible at 2,048)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "axonn_comm_model.py"
    spec = importlib.util.spec_from_file_location("axonn_comm_model", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    assert m.bandwidth("frontier", 2, 8) == m.bandwidth("frontier", 16, 4096) == 5e9
    assert m.bandwidth("frontier", 16, 1) == 40e9 and m.bandwidth("perlmutter", 4, 2) == 40e9
    assert m.bandwidth("perlmutter", 8, 16) == 20e9
    published = {run[:3]: m.flops(run[1], 2048) / (run[2] * m.PEAK[run[0]] * run[3]) for run in m.RUNS}
    assert m.lower_bound("perlmutter", "gpt-40b", 4096, 2048)[0] < published[("perlmutter", "gpt-40b", 4096)]
    assert m.lower_bound("frontier", "gpt-160b", 16384, 2048)[0] > published[("frontier", "gpt-160b", 16384)]
