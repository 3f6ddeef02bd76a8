"""Lockstep (twin.engine.lockstep.lockstep) against the event engine: the same iteration, breakdown and every span, to
the nanosecond, on small grids with every rank its own compute factor, random switches and models;
where lockstep declines (a same-nanosecond tie the event engine's order decides), the engine runs.

The collective model is test_engine's stand-in (slower while other axes communicate), so the global
re-rating, the overlap slowdown and the breakdown's walk back are all exercised.
"""

import random

import pytest

from test_engine import AlphaBeta
from twin.engine import engine
from twin.engine.engine import simulate_program
from twin.program.grid import Grid
from twin.costs.kernels import KernelModel
from twin.engine.lockstep.lockstep import simulate_lockstep
from twin.program.model import load_model
from twin.costs.profile import load_profile
from twin.program.program import Options, build_program


def setup(model, grid, options, seed, spread=1e-3, contention=0.5):
    g = Grid.parse(grid)
    prog = build_program(load_model(model), g, options)
    km = KernelModel(load_profile("a100"))
    cm = AlphaBeta(g, contention=contention)
    compute = [0.0 if op.is_collective else km.kernel_time(op) for op in prog.ops]

    def timer(i, conc):
        op = prog.ops[i]
        return cm.time(op.kind, op.axis, op.bytes, conc)

    rng = random.Random(seed)
    slow = {r: 1 + rng.random() * spread for r in range(g.size)}
    return prog, compute, timer, slow


def both(prog, compute, timer, slow, overlap):
    ev = simulate_program(prog, compute, timer, full=True, slowdown=slow, overlap_slowdown=overlap, record=True,
                          merge_alike=False)
    ls = simulate_lockstep(prog, compute, timer, [slow[r] for r in range(prog.grid.size)], overlap, spans=True)
    return ev, ls


def assert_same(ev, ls, n):
    assert ls is not None, "lockstep declined"
    end, compute_ns, exposed, _, spans = ls
    assert end / 1e9 == ev.iteration_s
    assert compute_ns / n / 1e9 == ev.compute_s
    assert {a: exposed[k] / n / 1e9 for k, a in enumerate(("x", "y", "z", "data"))} == ev.exposed_s
    assert sorted(spans) == sorted(ev.spans)


CASES = [  # (model, grid, options, overlap slowdown)
    ("gpt-tiny", "2x2x2x2", Options(), 1.15),
    ("gpt-tiny", "2x1x2x2", Options(oag=False), 1.15),
    ("gpt-tiny", "1x2x2x2", Options(ors=False, oar=False), 1.0),
    ("gpt-tiny", "2x2x1x4", Options(micro_batches=2), 1.3),
    ("gpt-tiny", "4x1x2x2", Options(cache_layers=1, recompute=False), 1.15),
    ("gpt-tiny", "1x1x4x2", Options(grad_clip=False), 1.15),
    ("gpt-small", "2x2x2x2", Options(), 1.15),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_lockstep_equals_the_event_engine(case):
    model, grid, options, overlap = CASES[case]
    prog, compute, timer, slow = setup(model, grid, options, seed=case)
    ev, ls = both(prog, compute, timer, slow, overlap)
    assert_same(ev, ls, prog.grid.size)


def test_random_switches_and_factors():
    """Random grids of 16 ranks, switches and factor spreads: lockstep equals the engine wherever it
    runs, and runs on most."""
    rng = random.Random(7)
    ran = 0
    for trial in range(6):
        grid = rng.choice(["2x2x2x2", "2x2x1x4", "1x2x2x4", "2x1x4x2", "4x2x2x1"])
        g = Grid.parse(grid)
        options = Options(oar=rng.random() < 0.5, ors=rng.random() < 0.5, oag=rng.random() < 0.5,
                          cache_layers=rng.choice([0, 1]), recompute=rng.random() < 0.5,
                          micro_batches=rng.choice([1, 2]) if g.z * g.data <= 4 else 1)
        spread = rng.choice([1e-6, 1e-3, 0.2])
        prog, compute, timer, slow = setup("gpt-tiny", grid, options, seed=trial, spread=spread,
                                           contention=rng.choice([0.0, 0.5, 2.0]))
        overlap = rng.choice([1.0, 1.15, 2.0])
        ev, ls = both(prog, compute, timer, slow, overlap)
        if ls is not None:
            assert_same(ev, ls, prog.grid.size)
            ran += 1
    assert ran >= 5


def test_full_mode_uses_lockstep_with_the_same_result(monkeypatch):
    """simulate_program with every rank distinct takes lockstep (here from 16 ranks), with the event
    engine's result; record (spans) and comm_slowdown > 1 keep the event engine."""
    prog, compute, timer, slow = setup("gpt-tiny", "2x2x2x2", Options(), seed=3)
    calls = []
    import twin.engine.lockstep.lockstep as lockstep
    real = lockstep.simulate_lockstep
    monkeypatch.setattr(lockstep, "simulate_lockstep", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(engine, "LOCKSTEP_RANKS", 16)
    fast = simulate_program(prog, compute, timer, full=True, slowdown=slow, overlap_slowdown=1.15)
    assert calls
    slow_run = simulate_program(prog, compute, timer, full=True, slowdown=slow, overlap_slowdown=1.15, lockstep=False)
    assert fast == slow_run
    calls.clear()
    simulate_program(prog, compute, timer, full=True, slowdown=slow, overlap_slowdown=1.15, comm_slowdown=2.0)
    simulate_program(prog, compute, timer, full=True, slowdown=slow, overlap_slowdown=1.15, record=True)
    assert not calls


@pytest.mark.parametrize("grid", ["2x2x2x2", "1x2x2x4"])
def test_identical_ranks_ties_everywhere(grid):
    """Equal factors on every rank (rank by rank): every group of an axis starts and ends at the same
    nanosecond, the most ties the engine's order could decide; lockstep still gives its result."""
    prog, compute, timer, slow = setup("gpt-tiny", grid, Options(), seed=0, spread=0.0)
    ev, ls = both(prog, compute, timer, slow, 1.15)
    assert_same(ev, ls, prog.grid.size)


def test_declined_runs_fall_back_to_the_event_engine(monkeypatch):
    import twin.engine.lockstep.lockstep as lockstep
    prog, compute, timer, slow = setup("gpt-tiny", "2x2x2x2", Options(), seed=1)
    monkeypatch.setattr(engine, "LOCKSTEP_RANKS", 16)
    monkeypatch.setattr(lockstep, "simulate_lockstep", lambda *a, **k: None)
    got = simulate_program(prog, compute, timer, full=True, slowdown=slow, overlap_slowdown=1.15)
    assert got == simulate_program(prog, compute, timer, full=True, slowdown=slow, overlap_slowdown=1.15,
                                   lockstep=False)
