"""Pipeline parallelism in the program and the twin: the fifth grid axis, the schedules as stage
programs with their sends and receives, program files, the bubble, memory in flight, bad input."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from topologies.common import InputError, TwinError
from twin.cli.main import app
from twin.engine.pipeline import simulate_pipeline
from twin.predict.memory import memory_per_gpu
from twin.predict.simulate import SimulationConfig, simulate
from twin.program.grid import Grid
from twin.program.model import load_model
from twin.program.pipeline import check_pipeline, in_flight, schedule, stage_layers, stage_programs
from twin.program.program import Options, build_program
from twin.program.programfile import load_program, save_program
from twin.program.stagefile import check_pairs

runner = CliRunner()


def test_a_five_field_grid_puts_the_stage_between_z_and_data():
    g = Grid.parse("2x1x2x3x2")
    assert (g.x, g.y, g.z, g.pipe, g.data, g.size) == (2, 1, 2, 3, 2, 24)
    assert str(g) == "2x1x2x3x2" and str(Grid.parse("2x1x2x2")) == "2x1x2x2" and Grid.parse("2x1x2x2").pipe == 1
    assert g.rank(1, 0, 1, 1, pipe=2) == 1 + 2 * (0 + 1 * (1 + 2 * (2 + 3 * 1)))
    for r in range(g.size):
        assert g.rank(*g.coords(r), pipe=g.stage(r)) == r
    assert g.group(5, "data") == [5, 17] and g.stride("data") == 12
    assert all(g.stage(m) == g.stage(r) for r in range(g.size) for a in ("x", "z", "data") for m in g.group(r, a))
    assert sorted(sum(g.groups("z"), [])) == list(range(g.size))


def test_stages_split_the_layers_with_the_ends_on_the_first_and_last():
    m = dataclasses.replace(load_model("gpt-small"), layers=8)
    g = Grid(1, 1, 1, 1, pipe=4)
    o = Options(schedule="interleaved", chunks=2, micro_batches=4)
    assert stage_layers(m, g, o, 0) == [0, 4] and stage_layers(m, g, o, 3) == [3, 7]
    progs = stage_programs(m, g, o, batch=4)
    names = [{op.name for op in p.ops} for p in progs]
    assert "mb0.emb.fwd" in names[0] and not any("emb.fwd" in n for n in names[1]) and "mb0.loss.fwd" in names[3]
    check_pairs(progs)  # every send has its receive and every receive its send


def test_a_send_without_its_receive_is_refused():
    progs = stage_programs(load_model("gpt-small"), Grid(1, 1, 1, 1, pipe=2), Options(micro_batches=2), batch=2)
    progs[1].ops = [op for op in progs[1].ops if op.name != "mb1.L2.fwd.recv"]
    with pytest.raises(InputError, match="mb1.L2.fwd.send of stage 0 has no receive"):
        check_pairs(progs)


@pytest.mark.parametrize("kind,P,M,V,first", [("gpipe", 4, 6, 1, 6), ("1f1b", 4, 6, 1, 4),
                                              ("interleaved", 4, 8, 2, 11)])
def test_micro_batches_in_flight_follow_the_schedule(kind, P, M, V, first):
    units = [schedule(kind, P, M, V, s) for s in range(P)]
    assert all(len(u) == 2 * M * V for u in units)
    assert in_flight(units[0]) == first  # interleaved: 2 (P - 1) + (V - 1) P + 1 chunks (Megatron-LM)
    assert in_flight(units[-1]) == {"gpipe": M, "1f1b": 1, "interleaved": (V - 1) * P + 1}[kind]


@pytest.mark.parametrize("kind,P,M,V", [("gpipe", 2, 4, 1), ("gpipe", 4, 3, 1), ("1f1b", 4, 8, 1),
                                        ("1f1b", 3, 5, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2)])
def test_compute_only_bubble_is_the_analytic_share(kind, P, M, V):
    """Blocks of equal cost, free ends and communication: bubble / iteration = (P-1)/(V M + P-1)."""
    m = dataclasses.replace(load_model("gpt-small"), layers=P * V * 2)
    progs = stage_programs(m, Grid(1, 1, 1, 1, pipe=P), Options(schedule=kind, chunks=V, micro_batches=M), batch=M)
    block = lambda op: op.name.split(".")[1 if M > 1 else 0].startswith("L")  # noqa: E731
    cs = [[1e-3 if block(op) and op.kind not in ("send", "recv") and not op.is_collective else 0.0 for op in p.ops]
          for p in progs]
    res = simulate_pipeline(progs, cs, lambda k, i, c: 0.0, lambda k, i: 0.0)
    assert res.bubble_s / res.iteration_s == pytest.approx((P - 1) / (V * M + P - 1), rel=0.01)
    assert res.compute_s + res.bubble_s + res.idle_s + sum(res.exposed_s.values()) == pytest.approx(res.iteration_s)


def test_a_pipelined_simulation_names_the_bubble_and_its_sends():
    opts = Options(micro_batches=8)
    r = simulate(SimulationConfig("frontier", "gpt-20b", 128, "4x2x2x2x4", batch=512, options=opts))
    b = r.breakdown_s
    assert r.grid_str == "4x2x2x2x4" and r.grid["pipe"] == 2
    assert b["compute"] + sum(b["exposed_comm"].values()) + b["bubble"] + b["idle"] == pytest.approx(r.iteration_time_s)
    assert b["exposed_comm"]["pipe"] > 0 and 0.5 / 9 < b["bubble"] / r.iteration_time_s < 2 / 9
    assert r.pipeline["schedule"] == "1f1b" and [s["micro_batches_in_flight"] for s in r.pipeline["stages_s"]] == [2, 1]
    fewer = simulate(SimulationConfig("frontier", "gpt-20b", 128, "4x2x2x2x4", batch=512,
                                      options=Options(micro_batches=2)))
    assert fewer.pipeline["bubble_share"] > r.pipeline["bubble_share"]


def test_memory_counts_the_micro_batches_in_flight():
    m, g = load_model("gpt-20b"), Grid(4, 2, 2, 4, pipe=2)
    gpipe = memory_per_gpu(m, g, Options(micro_batches=8, schedule="gpipe"), 4096)
    f1b = memory_per_gpu(m, g, Options(micro_batches=8), 4096)
    assert gpipe.activations > 3 * f1b.activations  # 8 micro-batches in flight against 2
    unpiped = memory_per_gpu(m, Grid(4, 2, 2, 8), Options(micro_batches=8), 4096)
    assert gpipe.parameters == f1b.parameters < unpiped.parameters * 0.6


@pytest.mark.parametrize("grid,opts,msg", [
    ("1x1x1x3x1", Options(micro_batches=3), "do not split evenly"),
    ("1x1x1x2x1", Options(micro_batches=1), "needs at least G_pipe = 2 micro-batches"),
    ("1x1x1x2x1", Options(micro_batches=3, schedule="interleaved", chunks=2), "multiple of G_pipe"),
    ("1x1x1x2x1", Options(micro_batches=2, chunks=2), "needs --schedule interleaved"),
])
def test_bad_pipelines_are_refused(grid, opts, msg):
    with pytest.raises(TwinError, match=msg):
        check_pipeline(load_model("gpt-small"), Grid.parse(grid), opts)


@pytest.mark.parametrize("gpus,args,msg", [
    (3, ["--grid", "1x1x1x3x1", "--micro-batches", "4"], "do not split evenly"),
    (4, ["--grid", "1x1x1x4x1", "--micro-batches", "2"], "needs at least G_pipe = 4 micro-batches"),
    (2, ["--grid", "1x1x2x2x1", "--micro-batches", "2"], "has 4 GPUs but --gpus is 2"),
])
def test_bad_pipelines_get_one_line_and_exit_2(gpus, args, msg):
    r = runner.invoke(app, ["simulate", "--system", "frontier", "--model", "gpt-small", "--gpus", str(gpus),
                            "--batch", "8", *args, "-q"])
    assert r.exit_code == 2 and msg in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_pipelined_program_file_holds_every_stage(tmp_path):
    m, g = load_model("gpt-small"), Grid(1, 1, 1, 1, pipe=2)
    o = Options(micro_batches=2)
    progs = stage_programs(m, g, o, batch=4)
    save_program(progs, tmp_path / "p.json")
    back = load_program(tmp_path / "p.json")
    assert [p.ops for p in back] == [p.ops for p in progs]
    d = json.loads((tmp_path / "p.json").read_text())
    d["stages"][1]["ops"][0]["bytes"] += 4
    (tmp_path / "q.json").write_text(json.dumps(d))
    with pytest.raises(InputError, match="stage 1: op .* differs"):
        load_program(tmp_path / "q.json")


def test_a_four_field_grid_builds_the_program_it_always_did():
    m = load_model("gpt-small")
    assert build_program(m, Grid(2, 1, 2, 1), Options()).ops == \
        build_program(m, Grid(2, 1, 2, 1, pipe=1), Options()).ops


def test_grid_auto_weighs_pipelines_and_says_why():
    r = simulate(SimulationConfig("perlmutter", "gpt-1b", 16, batch=16))
    assert "pipelines:" in r.grid_choice and "looked at" in r.grid_choice and r.grid_choice.endswith(")")


def test_a_pipeline_faster_than_the_best_grid_is_chosen():
    from twin.predict.auto import BOUND_SLACK, choose_grid
    from twin.predict.pipe_auto import consider_pipelines
    from twin.predict.study import prepare
    study = prepare("perlmutter", "gpt-1b", 16, batch=16)
    best, _ = choose_grid(study, pipelines=False)
    best.simulated_s *= 100  # as if every 4D grid were far slower than the model says
    best.analytical_s *= 100
    win, why = consider_pipelines(study, best, BOUND_SLACK)
    assert win.grid.pipe > 1 and "faster than" in why and win.study.options.micro_batches >= win.grid.pipe
    assert win.result.pipeline["schedule"] == win.study.options.schedule


def test_the_timeline_and_trace_show_every_stage(tmp_path):
    from twin.present.plots import timeline_figure
    from twin.program.trace import check_nesting, read_trace, write_trace
    r = simulate(SimulationConfig("frontier", "gpt-small", 4, "1x1x1x4x1", batch=8, options=Options(micro_batches=4),
                                  record=True))
    assert {s.rank for s in r.spans} == {0, 1, 2, 3} and any(s.kind == "send" for s in r.spans)
    write_trace(tmp_path / "t", r.spans, metadata=r.as_dict(wall_time=False), world_size=r.gpus)
    assert check_nesting(tmp_path / "t") == [] and len(read_trace(tmp_path / "t")) == len(r.spans)
    rows = {y for tr in timeline_figure(r.spans).data for y in (tr.y or ())}
    assert {"rank 3 pipe", "rank 0 waits"} <= rows


def test_the_report_of_a_pipelined_grid_names_the_bubble(tmp_path):
    r = runner.invoke(app, ["report", "--system", "frontier", "--model", "gpt-small", "--gpus", "4", "--batch", "8",
                            "--grid", "1x1x1x4x1", "--micro-batches", "4", "--top", "0", "--out",
                            str(tmp_path / "r.html"), "-q"])
    assert r.exit_code == 0, r.output
    assert "pipeline bubble is" in r.output and (tmp_path / "r.html").exists()


def test_the_stages_together_compute_the_model_once():
    m = dataclasses.replace(load_model("gpt-small"), layers=8)
    o = Options(micro_batches=4, schedule="interleaved", chunks=2)
    progs = stage_programs(m, Grid(2, 1, 1, 1, pipe=2), o, batch=8)
    one = build_program(m, Grid(2, 1, 1, 1), Options(micro_batches=4), batch=8)
    assert sum(p.matmul_flops() for p in progs) == pytest.approx(one.matmul_flops())
