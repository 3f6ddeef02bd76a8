"""Grid search: enumeration, the analytical model, and the choice `--grid auto` makes."""

import pytest

from topologies.common import TwinError
from twin.costs.profile_types import HostSharing
from twin.program.grid import Grid
from twin.predict.search import Bandwidth, analytical, candidate_grids, estimate_grids, rank_grids
from twin.predict.auto import choose_grid, search
from twin.predict.study import prepare


class FlatBandwidth:
    """Stand-in collective model: every group gets `bw` bytes/s of ring volume, strided ones less."""

    def __init__(self, bw=20e9):
        self.bw = bw

    def time(self, kind, axis, nbytes, concurrent=frozenset()):
        return nbytes / (self.bw if axis == "x" else self.bw / 4)


def test_candidate_grids():
    grids = candidate_grids(16)
    assert len(grids) == 35 and len(set(grids)) == 35  # C(4+3, 3)
    assert all(g.size == 16 for g in grids)
    twelve = candidate_grids(12)  # 12 = 3 x 2^2: a factor 3 on one of four axes, 2^2 over four
    assert len(twelve) == 4 * 10 and Grid(3, 2, 1, 2) in twelve


def test_ranking_keeps_fitting_grids_only_and_sorts():
    study = prepare("perlmutter", "gpt-20b", 64, batch=64)
    cands = rank_grids(study, collectives=FlatBandwidth())
    assert cands and all(c.memory_bytes <= study.system.gpu.hbm_bytes for c in cands)
    assert [c.analytical_s for c in cands] == sorted(c.analytical_s for c in cands)
    assert all(c.grid.tensor_size >= 4 for c in cands)  # 20B does not fit on fewer than 4 A100-40GB


def test_analytical_terms_follow_the_ring_volumes():
    study = prepare("perlmutter", "gpt-1b", 16, batch=16)
    bw = Bandwidth(study, FlatBandwidth())
    a = analytical(study, Grid(1, 1, 1, 16), bw)
    assert a.comm_s["x"] == a.comm_s["y"] == a.comm_s["z"] == 0 and a.comm_s["data"] > 0
    b = analytical(study, Grid(1, 1, 16, 1), bw)
    assert b.comm_s["data"] == 0 and b.comm_s["z"] > 0
    # weights are gathered twice and reduce-scattered once: 3 x (p-1)/p x weight bytes per layer
    m = study.model
    weight_bytes = 2 * sum(k * n for _, k, n, _ in m.linear_shapes()) * m.layers  # gathered: whole (x=y=1)
    expected = 3 * 15 / 16 * weight_bytes / bw(16, 1) + 3 * 4 * m.layers * bw.latency(16, 1)
    assert b.comm_s["z"] == pytest.approx(expected, rel=1e-6)


def test_search_simulates_the_best_and_auto_picks_the_fastest():
    import twin.predict.auto as sim_mod
    from twin.predict.bounds import lower_bound
    study = prepare("perlmutter", "gpt-1b", 16, batch=16)
    cands = search(study, top=3, simulate_top=3)
    assert len(cands) >= 3 and all(c.simulated_s is not None for c in cands)
    assert all(c.bound_s <= c.simulated_s for c in cands[3:])  # simulated because they might be faster
    fastest = min(c.simulated_s for c in cands)
    # the grids of grid auto's pool (the top 3 + SCAN of the routing-free estimate) that it did not
    # simulate cannot beat the fastest
    shown = {str(c.grid) for c in cands}
    scanned = estimate_grids(study)[:3 + sim_mod.SCAN]
    assert scanned and all(sim_mod.BOUND_SLACK * max(lower_bound(study, c.grid), sim_mod.stopped_bound(study, c.grid))
                           >= fastest for c in scanned if str(c.grid) not in shown)
    best, how = choose_grid(study, simulate_top=3)
    assert best.simulated_s == fastest
    assert how.startswith("auto") and str(best.grid) in how


@pytest.mark.parametrize("system,model,gpus,batch", [("alps", "gpt-1b", 32, 32), ("frontier", "gpt-1b", 32, 32)])
def test_lower_bound_is_below_every_simulation(system, model, gpus, batch):
    """The bound that rules grids out stays below the simulated time of every valid grid (Alps: groups
    crossing its 4-GPU nodes; Frontier: 8 GCDs per node), and contention sped no collective up by
    more than the search's slack."""
    from twin.predict.auto import BOUND_SLACK
    from twin.predict.bounds import lower_bound
    from twin.predict.study_cache import model_for
    from twin.predict.run import simulate_grid
    study = prepare(system, model, gpus, batch=batch)
    grids = [c.grid for c in rank_grids(study)]
    assert len(grids) >= 10
    gaps = []
    for g in grids:
        bound, sim = lower_bound(study, g), simulate_grid(study, g).iteration_time_s
        assert bound <= sim + 1e-6, g
        assert bound >= 0.5 * sim, g  # and it is a useful bound, not zero
        gaps.append(sim / bound)
    if system == "frontier":  # the overlap slowdown where a collective is surely in flight is counted (5.5 % without)
        assert max(gaps) < 1.02
        cm = model_for(study, g)
        for (kind, axis, nbytes, conc), t in list(cm._times.items()):
            assert t >= cm.time(kind, axis, nbytes) * BOUND_SLACK * 0.9, (g, kind, axis, conc)
    # grid auto (the top of the routing-free estimate, bounded) picks the fastest of every grid
    fastest = min(grids, key=lambda g: (simulate_grid(study, g).iteration_time_s, str(g)))
    assert str(choose_grid(study)[0].grid) == str(fastest)


def test_nothing_fits_is_a_twin_error():
    study = prepare("perlmutter", "gpt-640b", 4)
    with pytest.raises(TwinError, match="does not fit"):
        rank_grids(study, collectives=FlatBandwidth())


def test_branch_and_bound_keeps_the_best_and_bounds_the_rest():
    study = prepare("perlmutter", "gpt-1b", 16, batch=16)
    bnb = rank_grids(study, keep=5)
    exhaustive = rank_grids(study)
    assert [(str(c.grid), c.analytical_s) for c in bnb[:5]] == [(str(c.grid), c.analytical_s) for c in exhaustive[:5]]
    assert {str(c.grid) for c in bnb} == {str(c.grid) for c in exhaustive}  # every valid grid is ranked
    exact = {str(c.grid): c.analytical_s for c in exhaustive}
    bounds = [c for c in bnb if not c.exact]
    assert bounds and all(c.analytical_s <= exact[str(c.grid)] * (1 + 1e-12) for c in bounds)


def test_a_second_search_in_the_process_reuses_the_first(monkeypatch):
    """search, --grid auto, scaling and sensitivity share ranked probes, bounds and simulations: asking
    again for an equal study (a new Study object) simulates and bounds nothing again."""
    import twin.predict.bounds as bounds_mod
    import twin.predict.run as sim_mod
    study = prepare("perlmutter", "gpt-1b", 16, batch=16)
    first, _ = choose_grid(study)
    cands = search(study, top=3, simulate_top=2)  # simulates the exact top 2 for its table too
    assert min(c.simulated_s for c in cands if c.simulated_s) == first.simulated_s
    calls = []
    monkeypatch.setattr(sim_mod, "_simulate_grid", lambda *a, **k: calls.append("simulate"))
    monkeypatch.setattr(bounds_mod, "_path_ns", lambda *a, **k: calls.append("bound"))
    again, how = choose_grid(prepare("perlmutter", "gpt-1b", 16, batch=16))
    assert calls == [] and str(again.grid) == str(first.grid) and again.simulated_s == first.simulated_s
    cands = search(study, top=3, simulate_top=2)
    assert calls == [] and min(c.simulated_s for c in cands if c.simulated_s) == first.simulated_s


@pytest.mark.parametrize("system,model,gpus,batch", [("frontier", "gpt-1b", 32, 32), ("cpu", "gpt-tiny", 8, 8)])
def test_a_stopped_simulation_shows_a_bound_below_its_time(system, model, gpus, batch, tmp_path, fresh_caches):
    """simulate_grid(stop_s=...) gives up once the clock plus the least time left (twin.predict.bounds.tail_ns)
    passes stop_s: the bound it keeps lies between stop_s and the simulated time; a run that ends
    before stop_s is the plain run. The CPU case takes the shipped profile without its span_spread: a
    grid whose spans are drawn (twin.host.spread) is the mean of several runs, which no single run's bound
    holds, so it is never stopped (test_a_drawn_cpu_simulation_is_never_stopped)."""
    import re
    from topologies import caches
    from twin.costs.profile import PROFILES_DIR
    from twin.predict.run import simulate_grid, stopped_bound
    profile = None
    if system == "cpu":
        profile = tmp_path / "cpu.toml"
        profile.write_text(re.sub(r"(?m)^span_spread = .*\n", "", (PROFILES_DIR / "cpu.toml").read_text()))
        profile = str(profile)
    study = prepare(system, model, gpus, batch=batch, profile=profile)
    assert not (study.profile.for_ranks(gpus).host or HostSharing()).span_spread
    grids = [c.grid for c in rank_grids(study)][:3]
    stops = 0
    for g in grids:
        full = simulate_grid(study, g).iteration_time_s
        caches.clear()  # simulated again, not handed back from the run above
        assert simulate_grid(study, g, stop_s=full * 1.0001).iteration_time_s == full
        for f in (0.5, 0.999):
            caches.clear()
            r = simulate_grid(study, g, stop_s=f * full)
            if r is None:
                stops += 1
                assert f * full < stopped_bound(study, g) <= full + 1e-9, (g, f)
            else:
                assert r.iteration_time_s == full
    assert stops >= len(grids)


def test_a_drawn_cpu_simulation_is_never_stopped(fresh_caches):
    """The shipped CPU profile draws the spans of a step (twin.host.spread): a stop below its time still
    gives the whole result, the mean over the draws."""
    from topologies import caches
    from twin.predict.run import simulate_grid
    study = prepare("cpu", "gpt-tiny", 8, batch=8)
    assert study.profile.for_ranks(8).host.span_spread
    g = rank_grids(study)[0].grid
    full = simulate_grid(study, g).iteration_time_s
    caches.clear()  # simulated again, not handed back from the run above
    assert simulate_grid(study, g, stop_s=0.5 * full).iteration_time_s == full



def test_grid_auto_simulates_in_full_only_grids_that_could_win():
    """The analytical top is not simulated for its rank alone: on the default Frontier study every grid
    grid auto simulates in full could still beat the fastest by its lower bound, and grids of the
    analytical top that their bounds (or a stopped simulation's) rule out are not simulated in full."""
    from twin.predict.bounds import lower_bound
    from twin.predict.auto import _auto, BOUND_SLACK
    study = prepare("frontier")
    looked = _auto(study, 2, None)
    sims = [c for c in looked if c.simulated_s is not None]
    fastest = min(c.simulated_s for c in sims)
    assert all(BOUND_SLACK * lower_bound(study, c.grid) < fastest for c in sims)
    skipped = [c for c in looked if c.simulated_s is None]
    assert any(c in skipped for c in looked[:4])
    assert all(BOUND_SLACK * c.bound_s >= fastest for c in skipped)
