"""twin.costs.solobound: lower bounds on a collective's time alone, without routing, and the search's use of them."""

import pytest

from twin.predict.bounds import lower_bound, quick_bound
from twin.program.grid import Grid
from twin.predict.search import rank_grids
from twin.costs.solobound import SoloBound
from twin.predict.study import prepare
from twin.predict.study_cache import model_for, program_for

STUDIES = [("alps", "gpt-1b", 32, 32, "contiguous"), ("frontier", "gpt-1b", 32, 32, "contiguous"),
           ("perlmutter", "gpt-1b", 32, 32, "scattered")]


@pytest.mark.parametrize("system,model,gpus,batch,placement", STUDIES)
def test_solo_bound_is_below_the_routed_time_of_every_collective(system, model, gpus, batch, placement):
    """Every collective of every valid grid's program: the bound is at most the routed time alone
    (Alps: groups across 4-GPU nodes, hierarchical all-reduces; Frontier: 8 GCDs on 4 NICs;
    Perlmutter: a scattered placement, where routing matters most), and not far below it."""
    study = prepare(system, model, gpus, batch=batch, placement=placement)
    grids = [c.grid for c in rank_grids(study)]
    assert len(grids) >= 10
    ratios = []
    for g in grids[:8]:
        cm = model_for(study, g)
        sb = SoloBound(cm)
        for op in {(op.kind, op.axis, op.bytes) for op in program_for(study, g).ops if op.is_collective}:
            exact, bound = cm.time(*op), sb.time(*op)
            assert bound <= exact, (g, op)
            ratios.append(bound / exact)
    assert min(ratios) > 0.2 and sorted(ratios)[len(ratios) // 2] > 0.5


def test_solo_bound_rate_is_the_routed_rate_inside_a_group():
    """On Frontier, rings inside one dragonfly group are limited by their NICs and channels, which no
    routing changes: the bound's rate is the routed one (to the bound's rounding margin)."""
    study = prepare("frontier", "gpt-1b", 512, batch=512)
    cm = model_for(study, Grid(2, 4, 8, 8))
    sb = SoloBound(cm)
    for axis in ("x", "y", "z", "data"):
        routed = cm._bus_rates(frozenset({axis}), "ring")[axis][0]
        assert sb._phases(axis, "ring")[0][0] == pytest.approx(routed, rel=1e-6), axis


def test_quick_bound_is_below_the_bound_and_both_below_the_simulation(fresh_caches):
    """quick_bound <= routed_bound <= lower_bound <= the simulated time; routed_bound routes nothing
    and reaches lower_bound once the grid's axes are routed."""
    import twin.predict.bounds as bounds_mod
    from twin.predict.run import simulate_grid
    study = prepare("alps", "gpt-1b", 32, batch=32)
    grids = [c.grid for c in rank_grids(study)[:6]]
    for g in grids:
        model = model_for(study, g)
        before = {a: model.routed(a) for a in "xyz"}
        r = bounds_mod.routed_bound(study, g)
        assert {a: model.routed(a) for a in "xyz"} == before  # nothing routed for it
        q, b = quick_bound(study, g), lower_bound(study, g)
        assert 0.8 * b <= q <= r * (1 + 1e-12) and r <= b * (1 + 1e-12)
        assert b <= simulate_grid(study, g).iteration_time_s + 1e-6
        # routed_bound computed again, the grid's model (routed now) kept: only the bounds are dropped
        bounds_mod._ROUTED.clear()
        bounds_mod._BOUNDS.clear()
        assert bounds_mod.routed_bound(study, g) == b  # all its axes are routed now


def test_the_ranking_bound_is_below_every_exact_estimate():
    """rank_grids' branch and bound estimates the grids it does not probe exactly with twin.costs.solobound's
    figures (at least the bandwidth, at most the latency): never above the exact estimate."""
    study = prepare("frontier", "gpt-1b", 32, batch=32)
    exact = {str(c.grid): c.analytical_s for c in rank_grids(study)}
    bounded = [c for c in rank_grids(study, keep=3) if not c.exact]
    assert bounded and all(c.analytical_s <= exact[str(c.grid)] * (1 + 1e-12) for c in bounded)


@pytest.mark.parametrize("model,gpus,options", [("gpt-1b", 32, {}), ("llama-tiny", 64, {"recompute": False}),
                                                ("gpt-1b", 16, {"micro_batches": 2, "grad_clip": True})])
def test_a_program_stands_for_its_class_with_smaller_ops(model, gpus, options):
    """quick_bound reads the program of a class-mate: the same ops, streams and deps; with a larger
    G_z every op at most the grid's own (data all-reduces of gradient shards scaled as _longest_path
    scales them); with a smaller G_z only the optimizer's ops are larger (_longest_path counts them
    as 0). Either way the longest path is at most the grid's own."""
    from twin.program.program import Options
    from twin.predict.bounds import program_class
    from twin.predict.search import candidate_grids
    study = prepare("frontier", model, gpus, batch=64, options=Options(**options))
    km = study.kernels
    grids = [g for g in candidate_grids(gpus) if g.x * g.y <= 4]
    classes: dict = {}
    for g in grids:
        try:
            program_for(study, g)
        except Exception:
            continue
        classes.setdefault(program_class(g), []).append(g)
    pairs = [(max(gs, key=lambda g: g.z), g) for gs in classes.values() for g in gs if len(gs) > 1]
    assert len(pairs) >= 4
    for like, g in pairs:
        a, b = program_for(study, like).ops, program_for(study, g).ops
        assert [(o.name, o.kind, o.stream, o.axis, o.deps) for o in a] == [(o.name, o.kind, o.stream, o.axis, o.deps) for o in b]
        for x, y in zip(a, b):
            if x.is_collective:
                scaled = x.bytes * like.tensor_size // g.tensor_size if x.axis == "data" and x.weight != "norms" else x.bytes
                assert scaled <= y.bytes and (x.axis == "data" or x.bytes == y.bytes), (like, g, x.name)
            else:
                assert km.kernel_time(x) <= km.kernel_time(y) and (x.phase == "opt" or x == y), (like, g, x.name)

    class Flat:  # a stand-in collective model whose times grow with the bytes
        def time(self, kind, axis, nbytes, concurrent=frozenset()):
            return 1e-5 + nbytes / 1e10

    from twin.predict.bounds import _longest_path
    for gs in classes.values():
        for g in gs:
            own = _longest_path(study, g, Flat())
            for like in gs:
                assert _longest_path(study, g, Flat(), like) <= own, (like, g)
