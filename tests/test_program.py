"""The schedule program: flops add up to the exact count, bytes match closed-form ring volumes,
names are stable and unique, dependencies point backwards, and the switches shape the program."""

import json
import re

import pytest

from twin import Grid, Options, build_program, load_model

GRIDS = ["2x2x2x64", "8x8x4x1", "1x1x1x512", "4x2x8x8", "1x4x2x2"]


def block_linear_ops(prog):
    """Collectives of the four linear layers of the blocks (layer-norm statistics excluded)."""
    pat = re.compile(r"^(mb\d+\.)?L\d+\.(qkv|attn_out|mlp_up|mlp_down)\.")
    return [op for op in prog.ops if op.is_collective and pat.match(op.name)]


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("recompute", [True, False])
def test_matmul_flops_equal_reference_formula(grid, recompute):
    m = load_model("gpt-5b")
    prog = build_program(m, Grid.parse(grid), Options(recompute=recompute, micro_batches=2))
    ref = m.reference_flops(prog.batch, prog.seq_len, prog.vocab, recompute=recompute)
    assert prog.matmul_flops() == pytest.approx(ref, rel=1e-12)
    # everything else (norms, GELU, loss, optimizer) is a small addition
    assert 1.0 < prog.model_flops() / ref < 1.01


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("recompute", [True, False])
def test_collective_bytes_match_closed_form(grid, recompute):
    """Ring volumes per rank per iteration, by axis, as in docs/reference/collective-bandwidth.md.

    For each linear layer of width K (W of H x K*H or K*H x H) with B' tokens per rank:
    forward all-reduce over the input axis of the output (twice with recomputation), backward
    all-reduce over the output axis of the input gradient, 3 z-collectives of the weight block
    (all-gather forward, all-gather backward, reduce-scatter) and the fp32 all-reduce over data.
    The reference writes the x and y terms with the layer's width K for every layer; for the
    transposed MLP-down layer the all-reduced tensors are [B', H/G] (forward) and [B', 4H/G]
    (backward), which this closed form uses.
    """
    m = load_model("gpt-5b")
    g = Grid.parse(grid)
    mb = 2
    prog = build_program(m, g, Options(recompute=recompute, micro_batches=mb))
    Bp, E = prog.tokens_per_micro_batch, 2
    ring = {a: 2 * (g.axis_size(a) - 1) / g.axis_size(a) for a in ("x", "y", "z", "data")}
    expect = {a: 0.0 for a in ring}
    for _, k, n, transposed in m.linear_shapes():
        gin, gout = ("y", "x") if transposed else ("x", "y")
        k_loc, n_loc = k // g.axis_size(gin), n // g.axis_size(gout)
        expect[gin] += mb * (2 if recompute else 1) * ring[gin] * Bp * n_loc * E
        expect[gout] += mb * ring[gout] * Bp * k_loc * E
        z_ag = 2 * mb * E * k * n / (g.x * g.y)     # all-gather forward and backward, per micro-batch
        z_rs = mb * E * k * n / (g.x * g.y)
        expect["z"] += ring["z"] / 2 * (z_ag + z_rs)
        expect["data"] += ring["data"] * 4 * k * n / g.tensor_size
    got = {a: 0.0 for a in ring}
    for op in block_linear_ops(prog):
        got[op.axis] += op.wire_bytes(g.axis_size(op.axis))
    for a in ring:
        assert got[a] == pytest.approx(expect[a] * m.layers, rel=1e-9, abs=1e-6), a


def test_reference_z_and_data_terms_per_block():
    """The z and data terms of the reference's comm model, in elements, for one block."""
    m = load_model("gpt-5b")
    g = Grid.parse("2x2x4x16")
    prog = build_program(m, g)
    H = m.hidden
    z_ref = sum(3 * (g.z - 1) / g.z * K * H * H / (g.x * g.y) for K in (3, 1, 4, 4))
    d_ref = sum(4 * (g.data - 1) / g.data * K * H * H / g.tensor_size for K in (3, 1, 4, 4))
    ops = [op for op in prog.ops if op.is_collective and re.match(r"^L0\.(qkv|attn_out|mlp_up|mlp_down)\.", op.name)]
    z = sum(op.wire_bytes(g.z) for op in ops if op.axis == "z") / 2
    d = sum(op.wire_bytes(g.data) for op in ops if op.axis == "data") / 2
    assert z == pytest.approx(z_ref, rel=1e-12)
    assert d == pytest.approx(d_ref, rel=1e-12)


def test_names_unique_deps_backward_streams_valid():
    prog = build_program(load_model("gpt-5b"), Grid.parse("2x2x2x64"), Options(micro_batches=2, cache_layers=3))
    names = [op.name for op in prog.ops]
    assert len(names) == len(set(names))
    for op in prog.ops:
        assert all(d < op.index for d in op.deps)
        assert op.stream in ("compute", "x", "y", "z", "data")
        if op.is_collective:
            assert op.stream == op.axis and op.bytes > 0
            assert re.search(rf"\.(ag|rs|ar)_{op.axis}(_max|_sum)?$", op.name), op.name
        else:
            assert op.stream == "compute"
    assert "mb1.L3.mlp_up.bwd.dgrad" in names and "L23.qkv.grad.ar_data" in names


def test_axis_of_size_one_has_no_collectives():
    prog = build_program(load_model("gpt-5b"), Grid.parse("1x4x1x512"))
    axes = {op.axis for op in prog.ops if op.is_collective}
    assert axes == {"y", "data"}


def test_gemm_layouts_and_shapes():
    m = load_model("gpt-5b")
    g = Grid.parse("2x4x2x64")
    prog = build_program(m, g)
    ops = {op.name: op for op in prog.ops}
    T = prog.tokens_per_micro_batch
    fwd = ops["L0.qkv.fwd.gemm"]
    assert (fwd.m, fwd.n, fwd.k, fwd.layout) == (T, 3 * m.hidden // 4, m.hidden // 2, "NN")
    dgrad = ops["L0.mlp_down.bwd.dgrad"]  # transposed: W is 4h/G_y x h/G_x
    assert (dgrad.m, dgrad.n, dgrad.k, dgrad.layout) == (T, 4 * m.hidden // 4, m.hidden // 2, "NT")
    wgrad = ops["L0.mlp_down.bwd.wgrad"]
    assert (wgrad.m, wgrad.n, wgrad.k, wgrad.layout) == (4 * m.hidden // 4, m.hidden // 2, T, "TN")
    assert ops["L0.attn.fwd"].replicas == g.x


def test_switches_shape_dependencies():
    m, g = load_model("gpt-tiny"), Grid.parse("2x2x2x1")
    def op(prog, name):
        return next(o for o in prog.ops if o.name == name)
    on = build_program(m, g, Options())
    off = build_program(m, g, Options(oar=False, ors=False, oag=False))
    # OAR: the weight-gradient GEMM waits for the input-gradient all-reduce only when OAR is off
    ar = op(off, "L1.qkv.bwd.ar_y").index
    assert ar in op(off, "L1.qkv.bwd.wgrad").deps
    assert op(on, "L1.qkv.bwd.ar_y").index not in op(on, "L1.qkv.bwd.wgrad").deps
    # ORS: without it the next compute op waits for the reduce-scatter
    rs = op(off, "L1.mlp_down.bwd.rs_z").index
    nxt = next(o for o in off.ops[rs + 1:] if o.stream == "compute")
    assert rs in nxt.deps
    # OAG: with it, the next layer's gather is issued before this layer's GEMM
    names_on = [o.name for o in on.ops]
    assert names_on.index("L0.attn_out.fwd.ag_z") < names_on.index("L0.qkv.fwd.gemm")
    names_off = [o.name for o in off.ops]
    assert names_off.index("L0.attn_out.fwd.ag_z") > names_off.index("L0.qkv.fwd.gemm")


def test_cache_and_recompute_change_gathers():
    m, g = load_model("gpt-tiny"), Grid.parse("1x1x2x1")
    def gathers(opts):
        return [o.name for o in build_program(m, g, opts).ops if o.kind == "all_gather"]
    base = gathers(Options(micro_batches=2))
    cached = gathers(Options(micro_batches=2, cache_layers=1))
    assert "mb1.L0.qkv.fwd.ag_z" in base and "mb1.L0.qkv.fwd.ag_z" not in cached
    assert "mb0.L0.qkv.fwd.ag_z" in cached and "mb0.L0.qkv.bwd.ag_z" not in cached
    rec = build_program(m, g, Options(recompute=True))
    norec = build_program(m, g, Options(recompute=False))
    assert any(".rec." in o.name for o in rec.ops) and not any(".rec." in o.name for o in norec.ops)
    # with recomputation, the backward gather is issued before the recomputed GEMM
    names = [o.name for o in rec.ops]
    assert names.index("L1.qkv.bwd.ag_z") < names.index("L1.qkv.rec.gemm") < names.index("L1.qkv.bwd.dgrad")


def test_json_roundtrip():
    prog = build_program(load_model("gpt-tiny"), Grid.parse("2x2x2x1"))
    from twin.program.programfile import program_json

    data = json.loads(program_json(prog))
    assert data["summary"]["ops"] == len(data["ops"]) == len(prog.ops)
    assert data["ops"][0]["name"] == prog.ops[0].name


@pytest.mark.parametrize("model,gpus,options", [
    ("gpt-tiny", 64, {}), ("gpt-tiny", 64, {"cache_layers": 1, "micro_batches": 2, "grad_clip": False}),
    ("gpt-tiny", 48, {"oag": False, "ors": False, "recompute": False}), ("llama-tiny", 64, {"goldfish_h": 3})])
def test_regrid_gives_the_built_program(model, gpus, options):
    """A program made from a class-mate's (twin.program.program.regrid, as the search does) equals the one
    build_program makes, on every pair of grids of a class; other pairs are refused."""
    from itertools import permutations

    from topologies.common import TwinError
    from twin.program.program import regrid, same_ops_but_shards
    from twin.predict.search import candidate_grids
    m, opts = load_model(model), Options(**options)
    built = {}
    for g in candidate_grids(gpus):
        try:
            built[g] = build_program(m, g, opts, 96)
        except TwinError:
            continue
    pairs = [(a, b) for a, b in permutations(built, 2) if same_ops_but_shards(a, b)]
    assert len(pairs) >= 10
    for a, b in pairs:
        assert regrid(built[a], b) == built[b], (a, b)
    other = next((a, b) for a, b in permutations(built, 2) if not same_ops_but_shards(a, b))
    with pytest.raises(ValueError):
        regrid(built[other[0]], other[1])


def test_builder_ops_equal_dataclass_ops_and_refuse_unknown_fields():
    """The builder makes ops without Op.__init__: each equals the Op that __init__ makes from its
    fields (same fields, in order), and an unknown field is refused as __init__ would refuse it."""
    from dataclasses import fields

    from twin.program.ops import Builder, Op
    prog = build_program(load_model("llama-tiny"), Grid.parse("2x2x2x1"), Options(micro_batches=2))
    names = [f.name for f in fields(Op)]
    for op in prog.ops:
        assert list(vars(op)) == names
        assert Op(**vars(op)) == op
    b = Builder(load_model("gpt-tiny"), Grid.parse("2x2x2x1"), Options(), 8, 64)
    with pytest.raises(TypeError, match="colour"):
        b.compute("x", "gemm", colour="red")
    with pytest.raises(TypeError, match="index"):
        b.collective("y", "all_reduce", "x", 4, index=3)
    from dataclasses import replace

    from twin.program.ops import changed
    op = prog.ops[7]
    new = changed(op, bytes=5, writes=("a",))
    assert new == replace(op, bytes=5, writes=("a",)) and list(vars(new)) == names and op.bytes != 5
    with pytest.raises(TypeError, match="colour"):
        changed(op, colour="red")
