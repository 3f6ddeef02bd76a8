"""twin.solobound: lower bounds on a collective's time alone, without routing, and the search's use of them."""

import pytest

from twin.grid import Grid
from twin.search import lower_bound, model_for, program_for, quick_bound, rank_grids
from twin.solobound import SoloBound
from twin.study import prepare

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


def test_quick_bound_is_below_the_bound_and_both_below_the_simulation():
    from twin.simulate import simulate_grid
    study = prepare("alps", "gpt-1b", 32, batch=32)
    for c in rank_grids(study)[:6]:
        q, b = quick_bound(study, c.grid), lower_bound(study, c.grid)
        assert 0.8 * b <= q <= b
        assert b <= simulate_grid(study, c.grid).iteration_time_s + 1e-6


def test_the_ranking_bound_is_below_every_exact_estimate():
    """rank_grids' branch and bound estimates the grids it does not probe exactly with twin.solobound's
    figures (at least the bandwidth, at most the latency): never above the exact estimate."""
    study = prepare("frontier", "gpt-1b", 32, batch=32)
    exact = {str(c.grid): c.analytical_s for c in rank_grids(study)}
    bounded = [c for c in rank_grids(study, keep=3) if not c.exact]
    assert bounded and all(c.analytical_s <= exact[str(c.grid)] * (1 + 1e-12) for c in bounded)
