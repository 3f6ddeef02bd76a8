"""Mixture of experts in the twin: the model's counts, the expert axis of a grid, the MoE block's
program (dataflow, flops, files), the all-to-all's cost on an idle network against a hand-computed
value, the routing imbalance, memory and the bad inputs (docs/moe.md)."""

import math

import pytest
from typer.testing import CliRunner

from topologies.common import TwinError
from topologies.system import load_system
from twin.cli.main import app
from twin.costs.alltoall import all_to_all_time
from twin.costs.collectives import CollectiveModel
from twin.predict.memory import memory_per_gpu
from twin.program.grid import Grid
from twin.program.model import ModelSpec, load_model
from twin.program.moe_spec import forward_flops_per_token, stretch
from twin.program.ops import check_dataflow
from twin.program.program import Options, build_program, regrid
from twin.program.programfile import load_program, save_program

runner = CliRunner()


def test_mixtral_8x7b_has_its_published_counts():
    m = load_model("mixtral-8x7b")
    # by hand: per layer attention 4096*(4096 + 2*1024) + 4096^2, router 4096*8, 8 experts of 3*4096*14336,
    # two RMSNorms; embedding and head 2*32000*4096, final norm 4096
    attn, expert, router, norms = 4096 * 6144 + 4096 ** 2, 3 * 4096 * 14336, 4096 * 8, 2 * 4096
    table = 2 * 32000 * 4096 + 4096
    assert m.total_params == 32 * (attn + 8 * expert + router + norms) + table == 46_702_792_704
    assert m.active_params == 32 * (attn + 2 * expert + router + norms) + table == 12_879_925_248
    assert round(m.total_params / 1e9, 1) == 46.7 and round(m.active_params / 1e9, 1) == 12.9
    assert m.is_moe and m.moe_layers == 32 and all(m.moe_layer(i) for i in range(32))
    dense = load_model("llama-8b")
    assert not dense.is_moe and dense.total_params == dense.active_params
    # forward flops per token: 2 x the linears a token runs through; every expert's with active=False
    s, h = m.seq_len, m.hidden
    extra = 2 * 32 * 6 * expert
    assert forward_flops_per_token(m, active=False) - forward_flops_per_token(m) == extra
    assert forward_flops_per_token(m) == 2 * (32 * (attn + 2 * expert + router)) + 32 * 4 * s * h + 2 * h * 32000


def test_moe_every_and_a_gpt_moe_count_their_blocks():
    base = dict(name="t", layers=4, hidden=64, heads=4, vocab=256, seq_len=32, global_batch=8)
    m = ModelSpec(**base, experts=4, top_k=1, moe_every=2)
    assert [m.moe_layer(i) for i in range(4)] == [False, True, False, True] and m.moe_layers == 2
    dense = ModelSpec(**base)
    mlp = 2 * 64 * 256  # a GELU MLP of width 4h
    assert m.total_params - dense.total_params == 2 * (64 * 4 + 3 * mlp)
    assert m.active_params - dense.active_params == 2 * 64 * 4


@pytest.mark.parametrize("fields, says", [
    ({"experts": 4, "top_k": 5}, "top_k 5 must be between 1 and the 4 experts"),
    ({"experts": 4, "top_k": 0}, "top_k 0 must be between 1"),
    ({"experts": 0, "top_k": 2}, "top_k 2 is set but experts is 0"),
    ({"experts": 4, "top_k": 2, "capacity_factor": -1.0}, "capacity_factor must be a finite number >= 0"),
    ({"experts": 4, "top_k": 2, "moe_every": 0}, "moe_every must be a positive integer"),
])
def test_bad_moe_fields_are_one_line(fields, says):
    with pytest.raises(TwinError, match=says):
        ModelSpec(name="t", layers=2, hidden=64, heads=4, vocab=256, seq_len=32, global_batch=8, **fields)


def test_grid_expert_suffix_and_groups():
    g = Grid.parse("2x1x1x8e4")
    assert (g.expert, g.data, g.edata, str(g)) == (4, 8, 2, "2x1x1x8e4")
    assert str(Grid.parse("2x1x1x8")) == "2x1x1x8" and Grid.parse("2x1x1x8e1") == Grid.parse("2x1x1x8")
    # rank = x + 2 d: the expert group of rank 5 (x=1, d=2) is d = 0..3 with x = 1; its edata group d = 2, 6
    assert g.group(5, "expert") == [1, 3, 5, 7] and g.group(5, "edata") == [5, 13]
    for axis in ("expert", "edata"):
        groups = g.groups(axis)
        assert sorted(r for grp in groups for r in grp) == list(range(16))
        assert all(g.group(r, axis) == grp for grp in groups for r in grp)
    p = Grid.parse("2x1x1x2x4e2")  # with a pipeline: groups stay inside a stage
    assert (p.pipe, p.expert, str(p)) == (2, 2, "2x1x1x2x4e2")
    assert all(len({p.stage(r) for r in grp}) == 1 for grp in p.groups("expert"))


@pytest.mark.parametrize("grid, says", [
    ("1x1x1x8e3", "E_p=3 does not divide G_data=8"),
    ("1x1x1x8e8", "the 4 experts of mixtral-tiny are not divisible by E_p=8"),
])
def test_a_grid_that_cannot_split_the_experts_is_one_line(grid, says):
    with pytest.raises(TwinError, match=says):
        build_program(load_model("mixtral-tiny"), Grid.parse(grid))
    with pytest.raises(TwinError, match="has no experts"):
        build_program(load_model("llama-tiny"), Grid.parse("1x1x1x8e2"))


@pytest.mark.parametrize("grid", ["1x1x1x1", "1x1x1x4e4", "1x1x1x8e2", "2x2x1x2e2", "2x1x2x2e2", "2x2x2x2e2"])
@pytest.mark.parametrize("options", [Options(), Options(micro_batches=2, recompute=False),
                                     Options(oar=False, ors=False, oag=False)])
def test_moe_program_dataflow_holds_and_flops_equal_the_formula(grid, options):
    m, g = load_model("mixtral-tiny"), Grid.parse(grid)
    p = build_program(m, g, options, batch=16)
    check_dataflow(p, grid)
    a2a = [op for op in p.ops if op.kind == "all_to_all"]
    assert len(a2a) == (0 if g.expert == 1 else 2 * m.layers * (2 + options.recompute) * options.micro_batches)
    assert all(op.stream == "data" and op.axis == "expert" for op in a2a)
    assert {op.axis for op in p.ops if ".grad.ar_edata" in op.name} <= {"edata"}
    s = p.summary()
    assert s["matmul_flops"] == s["reference_flops"]


def test_moe_block_ops_and_dependencies():
    p = build_program(load_model("mixtral-tiny"), Grid.parse("2x1x1x4e2"))
    ops = {op.name: op for op in p.ops}
    disp, up = ops["L0.moe.fwd.dispatch"], ops["L0.expert_up.fwd.gemm"]
    assert ops["L0.moe.fwd.permute"].index in disp.deps and disp.index in up.deps
    # m tokens per rank (8 sequences / 4 data ranks x 32), top-2: R = 128 rows of h/G_x = 32 features
    assert (up.m, up.n, up.k) == (128, 256, 32) and disp.bytes == 2 * 128 * 32
    comb = ops["L0.moe.fwd.combine"]
    assert comb.index in ops["L0.moe.fwd.unpermute"].deps
    bwd_disp = ops["L0.moe.bwd.dispatch"]
    assert bwd_disp.index in ops["L0.moe.bwd.permute"].deps  # the router's backward runs while it is in flight
    assert ops["L0.router.bwd.wgrad"].index < ops["L0.moe.bwd.permute"].index
    assert ops["L0.expert_up.grad.ar_edata"].axis == "edata" and "L0.mlp_up.grad.ar_data" not in ops
    assert ops["opt.clip.ar_expert"].axis == "expert"


def test_moe_program_files_round_trip(tmp_path):
    m = load_model("mixtral-tiny")
    p = build_program(m, Grid.parse("2x1x1x4e2"))
    save_program(p, tmp_path / "p.json")
    q = load_program(tmp_path / "p.json")
    assert q.ops == p.ops and q.grid == p.grid
    stages = build_program(m, Grid.parse("1x1x1x2x4e2"), Options(micro_batches=2), stage=1)
    assert any(op.kind == "all_to_all" for op in stages.ops)


def test_regrid_resizes_expert_gradients():
    m = load_model("mixtral-8x7b")
    a, b = Grid.parse("2x2x2x16e4"), Grid.parse("2x2x4x8e4")
    assert regrid(build_program(m, a), b).ops == build_program(m, b).ops


def test_all_to_all_on_an_idle_network_against_a_hand_computed_value():
    sysm = load_system("perlmutter")
    B = 64 * 2 ** 20
    # one node, a group of 4: every pair has its own NVLink of 100 GB/s at the library's 76 %, one hop of
    # 1 us, the step latency 4 us: each rank sends B/4 to each other member
    cm = CollectiveModel(sysm, Grid.parse("1x1x1x4e4"))
    assert all_to_all_time(cm, B) == pytest.approx(4e-6 + 1e-6 + B / 4 / (0.76 * 100e9), rel=1e-9)
    assert cm.time("all_to_all", "expert", B) == all_to_all_time(cm, B)
    # two nodes, groups {i, i + 4}: each pair crosses through the GPUs' own NICs, one flow per direction
    # per NIC, capped at one channel's share (65 % of 25 GB/s): the bandwidth term is B/2 at 16.25 GB/s
    cm = CollectiveModel(sysm, Grid.parse("4x1x1x2e2"))
    t1, t2 = all_to_all_time(cm, B), all_to_all_time(cm, 2 * B)
    assert t2 - t1 == pytest.approx(B / 2 / (0.65 * 25e9), rel=1e-9)
    assert 4e-6 < t1 - B / 2 / (0.65 * 25e9) < 10e-6  # step latency and the path's latency
    assert CollectiveModel(sysm, Grid.parse("4x1x1x2")).time("all_to_all", "expert", B) == 0.0  # E_p = 1
    # a group of 8 on two nodes: the 3 flows inside a node finish first; the 4 that leave each GPU share its
    # 25 GB/s NIC (below the channel cap), so the transfer ends at B/8 / 6.25 GB/s
    cm = CollectiveModel(sysm, Grid.parse("1x1x1x8e8"))
    t1, t2 = all_to_all_time(cm, B), all_to_all_time(cm, 2 * B)
    assert t2 - t1 == pytest.approx(B / 8 / (25e9 / 4), rel=1e-9)


def test_imbalance_stretches_expert_rows_and_all_to_alls_as_stated():
    m = load_model("mixtral-tiny")  # E = 4, top-2
    assert stretch(m, 1, 1.5) == 1.5 and stretch(m, 4, 1.5) == pytest.approx(1.0)
    assert stretch(m, 2, 1.5) == pytest.approx((1.5 + (4 - 1.5) / 3) / 2)
    g = Grid.parse("1x1x1x4e4")
    base = build_program(m, g)
    hot = build_program(m, g, Options(moe_imbalance=1.5))
    for a, b in zip(base.ops, hot.ops):
        if a.name.split(".")[1].startswith("expert_") and a.kind == "gemm":
            assert b.flops == pytest.approx(1.5 * a.flops)
        elif a.kind == "all_to_all":
            assert b.bytes == pytest.approx(1.5 * a.bytes, abs=1)
        elif ".router." in a.name or ".moe." in a.name or a.phase in ("grad", "opt"):
            assert b.bytes == a.bytes
    cm = CollectiveModel(load_system("perlmutter"), g)
    op = next(o for o in hot.ops if o.kind == "all_to_all")
    latency = all_to_all_time(cm, 1)
    base_op = next(o for o in base.ops if o.kind == "all_to_all")
    assert all_to_all_time(cm, op.bytes) - latency == pytest.approx(
        1.5 * (all_to_all_time(cm, base_op.bytes) - latency), rel=1e-3)
    with pytest.raises(TwinError, match="between 1 .balanced. and 2"):
        build_program(m, g, Options(moe_imbalance=3))


def test_memory_counts_the_experts():
    m = load_model("mixtral-8x7b")
    one, eight = (memory_per_gpu(m, Grid.parse(g), batch=64) for g in ("1x1x8x8", "1x1x8x8e8"))
    # parameters: the rank's experts (all 8, or 1) of every layer, over the 8 z-shards
    expert = 32 * 3 * 4096 * 14336 // 8
    assert one.parameters - eight.parameters == 2 * 7 * expert


def run(*args):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize("args, says", [
    (["--model", "mixtral-tiny", "--gpus", "8", "--grid", "1x1x1x8e3"], "E_p=3 does not divide G_data=8"),
    (["--model", "mixtral-tiny", "--gpus", "8", "--grid", "1x1x1x8e8"], "not divisible by E_p=8"),
    (["--model", "mixtral-tiny", "--gpus", "8", "--grid", "1x1x1x8e2", "--moe-imbalance", "3"], "--moe-imbalance 3"),
    (["--model", "llama-tiny", "--gpus", "8", "--grid", "1x1x1x8", "--moe-imbalance", "2"], "has no experts"),
])
def test_twin_refuses_bad_moe_input_in_one_line(args, says):
    r = run("simulate", "--system", "frontier", *args)
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("text, says", [("top_k = 5", "top_k 5 must be between 1 and the 4 experts"),
                                        ("top_k = 2\ncapacity_factor = 0", "capacity_factor must be")])
def test_twin_refuses_a_bad_moe_model_file_in_one_line(tmp_path, text, says):
    f = tmp_path / "bad.toml"
    f.write_text('arch = "llama"\nlayers = 2\nhidden = 64\nheads = 4\nkv_heads = 2\nffn_size = 128\nvocab = 256\n'
                 f'seq_len = 32\nglobal_batch = 8\ntied_embeddings = false\nexperts = 4\n{text}\n')
    r = run("simulate", "--system", "frontier", "--model", str(f), "--gpus", "8", "--grid", "1x1x1x8e2")
    assert r.exit_code == 2 and says in r.output and len(r.output.strip().splitlines()) == 1


def test_simulating_an_moe_grid_adds_up():
    r = run("simulate", "--system", "perlmutter", "--model", "mixtral-tiny", "--gpus", "8", "--grid", "2x1x1x4e2",
            "--json")
    assert r.exit_code == 0, r.output
    import json
    d = json.loads(r.stdout)
    assert d["grid"] == {"x": 2, "y": 1, "z": 1, "data": 4, "expert": 2}
    b = d["breakdown_s"]
    assert b["compute"] + sum(b["exposed_comm"].values()) + b["idle"] == pytest.approx(d["iteration_time_s"])
    assert math.isfinite(d["iteration_time_s"]) and b["exposed_comm"]["data"] > 0


@pytest.mark.parametrize("full", [False, True])
def test_the_waits_of_an_moe_run_add_up_to_its_breakdown(full):
    """The all-to-alls and edata all-reduces run on the data stream: their exposed time is data's."""
    from twin.predict.run import simulate_grid
    from twin.predict.study import prepare
    r = simulate_grid(prepare("perlmutter", "mixtral-tiny", 8), Grid.parse("2x1x1x4e2"), full=full, record=True)
    per: dict[str, float] = {}
    for w in r.waits:
        per[w.args["axis"]] = per.get(w.args["axis"], 0.0) + w.duration_s / (8 if full else 1)
    assert set(per) <= {"x", "y", "z", "data"} and per["data"] > 0
    for axis, seconds in r.breakdown_s["exposed_comm"].items():
        assert per.get(axis, 0.0) == pytest.approx(seconds, abs=1e-9)


@pytest.mark.parametrize("variant", ["every other block", "capacity", "gpt experts"])
def test_moe_variants_build_checked_programs(variant, tmp_path):
    import dataclasses as dc
    tiny = load_model("mixtral-tiny")
    m = {"every other block": dc.replace(tiny, layers=4, moe_every=2),
         "capacity": dc.replace(tiny, capacity_factor=1.25),
         "gpt experts": ModelSpec(name="gmoe", layers=2, hidden=64, heads=4, vocab=256, seq_len=32, global_batch=16,
                                  experts=4, top_k=1)}[variant]
    for grid in ("1x1x1x4e2", "2x2x2x2e2"):
        p = build_program(m, Grid.parse(grid), Options(), batch=16)
        check_dataflow(p, grid)
        s = p.summary()
        if m.capacity_factor:  # buffers padded to capacity: R = E ceil(1.25 m k / E) rows
            up = next(op for op in p.ops if op.name == "L0.expert_up.fwd.gemm")
            tokens = 16 // (Grid.parse(grid).z * Grid.parse(grid).data) * 32
            assert up.m == 4 * math.ceil(1.25 * tokens * 2 / 4)
            hot = build_program(m, Grid.parse(grid), Options(moe_imbalance=1.5), batch=16)
            assert [op.bytes for op in hot.ops] == [op.bytes for op in p.ops]  # padded: imbalance changes nothing
        else:
            assert s["matmul_flops"] == s["reference_flops"]
        save_program(p, tmp_path / "p.json")
        assert load_program(tmp_path / "p.json").ops == p.ops
    if m.moe_every == 2:
        names = {op.name for op in p.ops}
        assert "L0.mlp_up.fwd.gemm" in names and "L1.expert_up.fwd.gemm" in names and "L1.mlp_up.fwd.gemm" not in names


def test_grid_auto_splits_mixtrals_experts_where_that_is_faster():
    from dataclasses import replace
    from twin.predict.auto import choose_grid
    from twin.predict.run import simulate_grid
    from twin.predict.study import prepare
    study = prepare("frontier", "mixtral-8x7b", 128, 128)
    best, how = choose_grid(study, simulate_top=1, pipelines=False)
    assert best.grid.expert > 1, how
    dense_axis = simulate_grid(study, replace(best.grid, expert=1))
    assert best.simulated_s < dense_axis.iteration_time_s


def test_profiles_and_measurements_accept_the_moe_axes():
    # `twin calibrate --run --model mixtral-tiny` fits training steps over the expert and expert-data
    # groups: the measurement and profile schemas must take those axes (they refused 'edata')
    from topologies.schema import PROFILE_AXES
    from twin.costs.profile import AXIS_KEYS
    from twin.program.grid import AXES
    from twin.program.moe import EXPERT_AXES
    assert set(AXES) | set(EXPERT_AXES) == set(PROFILE_AXES) == set(AXIS_KEYS)


def test_calibration_counts_all_to_alls_as_collectives():
    # an MoE run's all-to-alls are communication in the fit and in `twin validate` (they were counted
    # as compute ops, which put the all-to-all's time into the compute error)
    from calibration.measurements import COLLECTIVES as FIT
    from calibration.validate_measured import COLLECTIVES as VALIDATE
    from topologies.schema import PROFILE_COLLECTIVES
    from twin.program.ops import COLLECTIVES
    assert set(FIT) == set(VALIDATE) == set(PROFILE_COLLECTIVES) == set(COLLECTIVES)
