"""The discrete-event engine: one training iteration of a program on many ranks (`simulate_program`).

Streams. Each simulated rank has a compute stream; each group of each communication axis has one
stream shared by its members (all members run the same collectives of that axis in program order, so
a group's stream stands for the axis stream of every member). An op starts when its stream has
finished the previous op and every op in its `deps` is done (for a collective: done on every member,
so it starts when its last member arrives); a collective then completes for the whole group at once.
How they run (small state machines on a heap of due times, no Python object per rank and op) is
twin.engine.sim's docstring.

Rates. A collective's duration comes from `collective_s(op, concurrent)` where `concurrent` is the set
of other axes that have a collective in flight at that moment (asked once per op and set, or with
`by_size` once per distinct (kind, axis, bytes) and set). When an axis starts or stops having
collectives in flight, every in-flight collective of the other axes is re-rated: its remaining work
(a fraction) is carried over at the new rate. A compute op runs `overlap_slowdown` times slower while
a collective of its rank is in flight, re-rated the same way; symmetrically, a collective runs
`comm_slowdown` times slower while the compute stream of one of its members runs an op (1 unless the
ranks share their cores with the communication threads: the host model, twin.host). An entry cannot be taken back: a
stream's live entry is the one at (stream.due, stream.slot), the others are stale and skipped. An
earlier finish schedules a new entry; a later one does not (the pending entry fires early, sees work
left, and schedules the rest), which saves entries when rates change several times.

Time is kept in integer nanoseconds, so no remaining time of 1e-18 s can
stall the clock; each scheduled delay is rounded to the nearest nanosecond.

Modes. Symmetric: one representative rank whose groups have one member. Every rank runs the same
program and the collective model gives one time per axis for all its groups at once (the slowest
group's), so every placement, regular or scattered, has a single placement class and one rank stands
for all. Full: every rank, each with an optional compute slowdown factor (stragglers); a collective
starts when its last member arrives. Ranks that behave alike (twin.engine.symmetry: equal factors, groups
of alike ranks) are one class, simulated once: a stream here stands for a class of ranks (a group
stream for a class of groups, whose members are classes), and sums over ranks weigh each class by
its size. Without stragglers that is one class, so full mode gives exactly the symmetric result;
with `merge_alike=False` every rank is its own class (the same to the rounding of re-rates, ns).
When every rank is its own class (at least LOCKSTEP_RANKS of them, comm_slowdown 1, no spans recorded),
twin.engine.lockstep.lockstep steps the program once over all ranks with numpy and gives this engine's result to
the nanosecond; where the order of same-nanosecond events would decide, it declines and this engine runs.

Breakdown (per rank, then averaged over ranks): compute = time its compute stream runs ops. A wait
of the compute stream ends when the op it waited for last completes; the wait is attributed by
walking back what delayed that collective: its transfer time is exposed communication of its axis;
before its transfer it waited either for its stream's previous collective or for a collective of
another axis (the walk continues there), or for a compute op of another rank (a straggler: idle).
Anything left (including the tail after the rank's last compute op) is idle, so
compute + exposed + idle = iteration time exactly.

The engine's modules: this one runs an iteration and sums up its result (simulate_program,
EngineResult); twin.engine.plan derives what a run needs from the program's streams, axes and deps
alone and keeps it for programs alike; twin.engine.sim holds one run's shared state (the clock and
its event loop, done flags, waiters, the rate tables of collectives, the blame walk); and
twin.engine.streams has the streams that run on it. Names with a leading underscore are shared by
these modules only.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable

from twin.engine.plan import plan_of
from twin.engine.sim import NS, Stopped, Sim
from twin.engine.streams import ComputeStream, GroupStream
from twin.program.grid import AXES, Grid
from twin.program.program import Program
from twin.engine.symmetry import RankClasses, one_class_per_rank, rank_classes

__all__ = ["LOCKSTEP_RANKS", "NS", "EngineResult", "Stopped", "simulate_program"]  # NS, Stopped: twin.engine.sim's

LOCKSTEP_RANKS = 128  # full mode with at least this many distinct ranks tries twin.engine.lockstep.lockstep first


@dataclass
class EngineResult:
    """What one simulated iteration took. Times in seconds."""

    iteration_s: float
    compute_s: float                 # mean over simulated ranks
    exposed_s: dict[str, float]      # mean over simulated ranks, per axis
    idle_s: float                    # mean over simulated ranks
    simulated_ops: int               # op executions over all simulated ranks (a collective counts per member)
    ranks: int                       # simulated ranks
    spans: list[tuple[int, int, float, float]] = field(default_factory=list)  # (rank, op, start_s, dur_s)
    classes: int = 1                 # classes of ranks that behave alike, each simulated once (twin.engine.symmetry)
    waits: list[tuple[int, float, float, str]] = field(default_factory=list)  # (rank, start_s, end_s, axis)
    # with record: every stretch the breakdown counts as exposed communication of `axis`, as blamed


def simulate_program(program: Program, compute_s: list[float],
                     collective_s: Callable[[int, frozenset], float], *, full: bool = False,
                     slowdown: dict[int, float] | None = None, overlap_slowdown: float = 1.0,
                     record: bool = False, merge_alike: bool = True, comm_slowdown: float = 1.0,
                     lockstep: bool | None = None, stop_ns: int = 0, tail_ns: list[int] | None = None,
                     by_size: bool = False, tick: Callable[[float], None] | None = None) -> EngineResult:
    """Simulate one iteration of `program`.

    compute_s[i]: seconds compute op i takes alone (ignored for collectives).
    collective_s(i, concurrent): seconds collective op i takes when every group of its axis runs it at
        once while the axes in `concurrent` also have collectives in flight.
    full: simulate every rank of the grid (else one representative rank).
    slowdown: rank -> factor >= 1 on its compute times (full mode; stragglers).
    overlap_slowdown: compute runs this many times slower while a collective of its rank is in flight.
    record: keep spans (rank, op index, start s, duration s) of every op for traces and plots.
    merge_alike: in full mode, simulate each class of ranks that behave alike once (twin.engine.symmetry;
        the result is every rank's); False runs rank by rank (for tests).
    comm_slowdown: a collective runs this many times slower while the compute stream of one of its
        members runs an op (1: unaffected; where ranks share their cores, the host model's 1 / comm_share).
    lockstep: try twin.engine.lockstep.lockstep where it applies (None: from LOCKSTEP_RANKS distinct ranks; False: never).
    stop_ns, tail_ns: branch and bound (symmetric mode): tail_ns[i] is at most the time (ns) from the
        start of op i to the end of the iteration, whatever the run (the longest path from op i on
        with each op at its least time, twin.predict.bounds.tail_ns); when a compute op starts at a time t
        with t + tail_ns[i] > stop_ns, the run stops and raises Stopped(t + tail_ns[i]), a lower bound
        on its end (ns). 0: run to the end.
    by_size: collective_s(i, concurrent) depends on op i only through its (kind, axis, bytes), as
        twin.costs.collectives.collective_timer's does: it is then asked once per distinct collective and
        concurrency (a program of 3,000 collectives has a few dozen distinct ones).
    tick: called now and then with the share of the run done (0-1, an estimate), for a progress bar.
    """
    grid: Grid = program.grid
    slowdown = slowdown or {}
    if slowdown and not full:
        raise ValueError("per-rank slowdown factors need full mode")
    plan = plan_of(program.ops)
    by_stream = plan.by_stream
    axes = tuple(a for a in AXES if by_stream[a])
    nranks = grid.size if full else 1
    if not full:
        classes = RankClasses([[0]], [1.0], {a: [[0]] for a in axes}, {a: [0] for a in axes})
    elif merge_alike:
        classes = rank_classes(grid, slowdown, axes)
    else:
        classes = one_class_per_rank(grid, slowdown, axes)
    nsim = len(classes)
    if not comm_slowdown >= 1:
        raise ValueError(f"comm_slowdown must be at least 1, got {comm_slowdown}")
    if lockstep is None:
        lockstep = nsim >= LOCKSTEP_RANKS
    if full and lockstep and nsim == nranks and comm_slowdown == 1.0 and not record:
        from twin.engine.lockstep.lockstep import simulate_lockstep
        res = simulate_lockstep(program, compute_s, collective_s, classes.factor, overlap_slowdown, tick=tick)
        if res is not None:
            end, compute_ns, exposed_ns, _ = res
            compute = compute_ns / nranks
            exposed = {a: exposed_ns.get(k, 0) / nranks for k, a in enumerate(AXES)}
            idle = end - compute - sum(exposed.values())
            ops = (len(by_stream["compute"]) + sum(len(by_stream[a]) for a in axes)) * nranks
            return EngineResult(iteration_s=end / NS, compute_s=compute / NS,
                                exposed_s={a: v / NS for a, v in exposed.items()}, idle_s=idle / NS,
                                simulated_ops=ops, ranks=nranks, spans=[], classes=nsim)
    sim = Sim(program, nsim, record, collective_s, by_size, plan)
    sim.comm_slow = comm_slowdown
    if stop_ns:
        if full or tail_ns is None or len(tail_ns) != sim.n:
            raise ValueError("stop_ns needs symmetric mode and a tail per op")
        sim.stop_ns, sim.tail_ns = stop_ns, tail_ns
    base_ns = [t * NS for t in compute_s]
    todo = sim.plan.todo
    sim.compute = [ComputeStream(sim, c, by_stream["compute"], todo["compute"], base_ns, classes.factor[c],
                                  overlap_slowdown) for c in range(nsim)]
    groups: list[GroupStream] = []
    for axis in axes:
        streams = [GroupStream(sim, axis, m, by_stream[axis], todo[axis]) for m in classes.groups[axis]]
        groups += streams
        sim.group_of[axis] = {c: streams[k] for c, k in enumerate(classes.group_of[axis])}
    gc_on = gc.isenabled()
    gc.disable()  # millions of short-lived objects and no cycles to collect: the collector only costs time
    try:
        for s in sim.compute:
            s.advance()
        for g in groups:
            g.advance()
        sim.run(tick)
    finally:
        if gc_on:
            gc.enable()
    stuck = [s for s in sim.compute if s.pc < len(s.ops)] + [g for g in groups if g.pc < len(g.ops)]
    if stuck:
        s = stuck[0]
        raise RuntimeError(f"deadlock: stream {getattr(s, 'axis', 'compute')} stopped at op "
                           f"{sim.ops[s.ops[s.pc]].name}")
    end = sim.end_ns
    size = [len(r) for r in classes.ranks]  # ints: the sums below are exact
    compute = sum(k * s.compute_ns for k, s in zip(size, sim.compute)) / nranks
    exposed = {a: sum(k * s.exposed[a] for k, s in zip(size, sim.compute)) / nranks for a in AXES}
    idle = end - compute - sum(exposed.values())
    ops = (len(by_stream["compute"]) + sum(len(by_stream[a]) for a in axes)) * nranks
    spans = [(r, i, t / NS, d / NS) for c, i, t, d in sim.spans for r in classes.ranks[c]]
    waits = [(r, a / NS, b / NS, axis) for c, a, b, axis in sim.waits for r in classes.ranks[c]]
    return EngineResult(iteration_s=end / NS, compute_s=compute / NS,
                        exposed_s={a: v / NS for a, v in exposed.items()}, idle_s=idle / NS,
                        simulated_ops=ops, ranks=nranks, spans=spans, classes=nsim, waits=waits)
