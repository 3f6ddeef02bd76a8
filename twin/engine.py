"""The discrete-event engine: one training iteration of a program on many ranks.

Streams. Each simulated rank has a compute stream; each group of each communication axis has one
stream shared by its members (all members run the same collectives of that axis in program order, so
a group's stream stands for the axis stream of every member). An op starts when its stream has
finished the previous op and every op in its `deps` is done (for a collective: done on every member,
so it starts when its last member arrives); a collective then completes for the whole group at once.
Streams are small state machines, not simpy processes (simpy's generators and events cost several
times a plain loop's time per event): a pending completion is an entry (the stream) in the bucket of
its due time; a heap holds the distinct due times, and the loop runs each time's bucket in scheduling
order (entries added while it runs, zero-time ops, run last: simpy's order on ties). No Python object is made per rank and op: done flags are a bytearray
per op (a group's members' flags for one op sit together), a group's start and blocker of each op
are int arrays, a stream kind's (op, deps) list is shared. No cyclic GC during a run (only cost).
What a run derives from the program's streams, axes and deps alone (a _Plan) is kept for the next
program alike (a grid search's class-mates differ only in sizes, twin.program.regrid).

Rates. A collective's duration comes from `collective_s(op, concurrent)` where `concurrent` is the set
of other axes that have a collective in flight at that moment (asked once per op and set, or with
`by_size` once per distinct (kind, axis, bytes) and set). When an axis starts or stops having
collectives in flight, every in-flight collective of the other axes is re-rated: its remaining work
(a fraction) is carried over at the new rate. A compute op runs `overlap_slowdown` times slower while
a collective of its rank is in flight, re-rated the same way; symmetrically, with `comm_share` < 1 (CPU:
gloo's threads and the ranks' compute share the cores), a collective progresses at that share of its
rate while the compute stream of one of its members runs an op. An entry cannot be taken back: a
stream's live entry is the one at (stream.due, stream.slot), the others are stale and skipped. An
earlier finish schedules a new entry; a later one does not (the pending entry fires early, sees work
left, and schedules the rest), which saves entries when rates change several times.

Time is kept in integer nanoseconds, so no remaining time of 1e-18 s can
stall the clock; each scheduled delay is rounded to the nearest nanosecond.

Modes. Symmetric: one representative rank whose groups have one member. Every rank runs the same
program and the collective model gives one time per axis for all its groups at once (the slowest
group's), so every placement, regular or scattered, has a single placement class and one rank stands
for all. Full: every rank, each with an optional compute slowdown factor (stragglers); a collective
starts when its last member arrives. Ranks that behave alike (twin.symmetry: equal factors, groups
of alike ranks) are one class, simulated once: a stream here stands for a class of ranks (a group
stream for a class of groups, whose members are classes), and sums over ranks weigh each class by
its size. Without stragglers that is one class, so full mode gives exactly the symmetric result;
with `merge_alike=False` every rank is its own class (the same to the rounding of re-rates, ns).
When every rank is its own class (at least LOCKSTEP_RANKS of them, comm_share 1, no spans recorded),
twin.lockstep steps the program once over all ranks with numpy and gives this engine's result to
the nanosecond; where the order of same-nanosecond events would decide, it declines and this engine runs.

Breakdown (per rank, then averaged over ranks): compute = time its compute stream runs ops. A wait
of the compute stream ends when the op it waited for last completes; the wait is attributed by
walking back what delayed that collective: its transfer time is exposed communication of its axis;
before its transfer it waited either for its stream's previous collective or for a collective of
another axis (the walk continues there), or for a compute op of another rank (a straggler: idle).
Anything left (including the tail after the rank's last compute op) is idle, so
compute + exposed + idle = iteration time exactly.
"""

from __future__ import annotations

import gc
from array import array
from dataclasses import dataclass, field
from typing import Callable

from heapq import heappop, heappush

from twin.grid import AXES, Grid
from twin.program import Program
from twin.symmetry import RankClasses, one_class_per_rank, rank_classes

NS = 1e9  # nanoseconds per second
LOCKSTEP_RANKS = 128  # full mode with at least this many distinct ranks tries twin.lockstep first


class Stopped(Exception):
    """A run given `stop_ns` was stopped at `now_ns`: its iteration would end at `bound_ns` or later."""

    def __init__(self, bound_ns: int, now_ns: int = 0):
        super().__init__(bound_ns)
        self.bound_ns, self.now_ns = bound_ns, now_ns


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
    classes: int = 1                 # classes of ranks that behave alike, each simulated once (twin.symmetry)


_BIT = {a: 1 << k for k, a in enumerate(AXES)}
# _CONC[mask][a]: the axes other than a whose bit is set in mask (the `concurrent` argument of collective_s)
_CONC = [{a: frozenset(b for b in AXES if b != a and mask & _BIT[b]) for a in AXES} for mask in range(1 << len(AXES))]


class _Plan:
    """What a run derives from the program's streams, axes and deps alone (kept for programs alike).

    by_stream: stream -> its ops in program order; pos[i]: op i's position in its stream; axis_of[i];
    cross[i]: op i's dependencies on other streams (a stream's own earlier ops are done by stream
    order); waited_on[i]: an op of another stream depends on op i; counted[j]: every dependency of
    op j has j as its only such dependent, so nothing else ever waits for them and a group may wait
    for all its members' at once (_GroupStream); todo: stream -> [(op, cross deps)] in order."""

    __slots__ = ("by_stream", "pos", "axis_of", "cross", "waited_on", "counted", "todo")

    def __init__(self, ops: list):
        n = len(ops)
        streams = [op.stream for op in ops]
        self.by_stream = by_stream = {s: [] for s in ("compute",) + AXES}
        for op in ops:
            by_stream[op.stream].append(op.index)
        self.pos = pos = [0] * n
        for stream_ops in by_stream.values():
            for k, i in enumerate(stream_ops):
                pos[i] = k
        self.axis_of = [op.axis for op in ops]
        self.cross = cross = []
        dependents = [0] * n
        for op, s in zip(ops, streams):
            deps = op.deps
            if len(deps) == 1:  # most ops
                d = deps[0]
                if streams[d] == s:
                    deps = ()
                else:
                    dependents[d] += 1
            elif deps:
                deps = tuple([d for d in deps if streams[d] != s])
                for d in deps:
                    dependents[d] += 1
            cross.append(deps)
        self.waited_on = bytearray(k > 0 for k in dependents)
        self.counted = counted = bytearray(b"\x01" * n)
        for j, deps in enumerate(cross):
            for d in deps:
                if dependents[d] != 1:
                    counted[j] = 0
                    break
        self.todo = {k: [(i, cross[i]) for i in stream_ops] for k, stream_ops in by_stream.items()}


_PLANS: dict[tuple, _Plan] = {}  # (streams, axes, deps of every op) -> its plan, the latest few
PLANS_KEPT = 16


def _plan(ops: list) -> _Plan:
    """The _Plan of a program's ops, made once for ops alike in streams, axes and deps (a grid search
    runs programs that differ only in sizes: twin.program.regrid)."""
    key = (tuple([op.stream for op in ops]), tuple([op.axis for op in ops]), tuple([op.deps for op in ops]))
    plan = _PLANS.pop(key, None)
    if plan is None:
        plan = _Plan(ops)
        if len(_PLANS) >= PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = plan  # the latest last
    return plan


class _Sim:
    """Shared state of one run: the clock, per-rank done flags, waiters, in-flight bookkeeping."""

    def __init__(self, program: Program, nranks: int, record: bool,
                 collective_s: Callable[[int, frozenset], float], by_size: bool = False, plan: _Plan | None = None):
        self.now = 0                                    # the clock (ns)
        self.heap: list[int] = []                       # due times (ns) that have a bucket
        self.ops, self.n = program.ops, len(program.ops)
        self.plan = plan = plan or _plan(program.ops)
        self.axis_of = plan.axis_of
        self.done = [bytearray(nranks) for _ in range(self.n)]  # done[op][rank]
        self.waiters: dict[int, list] = {}
        self.busy = [0] * nranks                        # collectives in flight that include the rank
        self.running: dict[str, dict] = {a: {} for a in AXES}  # axis -> in-flight group streams
        self.runs = [self.running[a] for a in AXES]     # the same in AXES order
        self.mask = 0                                   # bit AXES.index(a) set: axis a has collectives in flight
        self.conc = _CONC[0]                            # axis -> the other axes now in flight
        self.compute: list[_ComputeStream] = []
        self.group_of: dict[str, dict[int, _GroupStream]] = {a: {} for a in AXES}  # axis -> rank -> stream
        self.pos = plan.pos                             # position of each op in its stream
        self.end_ns, self.record = 0, record
        self.spans: list[tuple[int, int, int, int]] = []
        self._collective_s = collective_s
        # same[i]: the first op with op i's (kind, axis, bytes) where collective_s depends on nothing else
        # (by_size): it is asked once per distinct collective and concurrency, not once per op
        self.same = _first_alike(self.ops, plan) if by_size else range(self.n)
        self._tables: dict[frozenset, list] = {}         # concurrent axes -> collective op -> ns (None: not yet)
        self._mask_tables: list[dict | None] = [None] * len(_CONC)  # mask -> {axis: table}, made as reached
        self.table = self.tables_of(0)  # axis -> the table of its concurrency now
        self.cross, self.waited_on, self.counted = plan.cross, plan.waited_on, plan.counted
        self.woken = -1  # rank * n + op: the completion whose waiters are being advanced
        self.buckets: dict[int, list] = {}  # due time (ns) -> streams in scheduling order
        self.comm_slow = 1.0  # 1 / comm_share: a collective's time factor while a member's compute runs
        self.stop_ns = 0      # > 0: stop once the end is sure to come later (simulate_program's stop_ns)
        self.tail_ns: list[int] = []

    def comm_factor(self, members: list[int]) -> float:
        """Time factor of a collective of `members` now: 1 / comm_share while one of them computes."""
        compute = self.compute
        return self.comm_slow if any(compute[r].running for r in members) else 1.0

    def compute_changed(self, rank: int) -> None:
        """The rank's compute stream started or stopped running: re-rate its in-flight collectives."""
        for a in AXES:
            g = self.group_of[a].get(rank)
            if g is not None and g.running:
                g.rerate()

    def table_of(self, conc: frozenset) -> list:
        """The durations (ns) of collective ops under concurrency `conc`, filled as asked (coll_ns; only
        at the ops `same` names)."""
        t = self._tables.get(conc)
        if t is None:
            t = self._tables[conc] = [None] * self.n
        return t

    def tables_of(self, mask: int) -> dict:
        """{axis: table_of(the other axes in flight)} when the axes of `mask` have collectives in flight."""
        t = self._mask_tables[mask]
        if t is None:
            t = self._mask_tables[mask] = {a: self.table_of(_CONC[mask][a]) for a in AXES}
        return t

    def coll_ns(self, j: int, axis: str) -> float:
        """Duration of collective op j of `axis` (j = same[j]: the ops alike share its entry) under the
        concurrency now (ns, memoised)."""
        table = self.table[axis]
        t = table[j]
        if t is None:
            t = table[j] = self._collective_s(j, self.conc[axis]) * NS
        return t

    def wait(self, key: int, stream) -> None:
        """Advance `stream` when op `key % n` of rank `key // n` is done (after earlier waiters)."""
        self.waiters.setdefault(key, []).append(stream)

    def schedule(self, due: int, stream) -> None:
        """Call stream.on_done() at `due` (ns) unless the stream schedules again before. One bucket per
        distinct time keeps scheduling order. The stream's latest entry is the one at
        (stream.due, stream.slot): the caller sets stream.due = due."""
        b = self.buckets.get(due)
        if b is None:
            b = self.buckets[due] = []
            heappush(self.heap, due)
        stream.slot = len(b)
        b.append(stream)

    def run(self) -> None:
        """Run the buckets in time order until none is left."""
        heap, buckets = self.heap, self.buckets
        while heap:
            self.now = now = heappop(heap)
            for k, s in enumerate(buckets[now]):  # entries added at this very time (zero delays) run last
                if s.slot == k and s.due == now:
                    s.on_done()
            del buckets[now]

    def blame(self, rank: int, t1: int, t2: int, op: int, exposed: dict[str, int]) -> None:
        """Attribute the compute stream's wait [t1, t2] (ns), which ended when `op` completed, by walking
        back what delayed each collective: its transfer time is exposed communication of its axis; a wait
        for its stream's previous collective or for a collective of another axis continues the walk;
        a wait for a compute op of another rank (a straggler) is left to idle."""
        while t2 > t1:
            axis = self.axis_of[op]
            if axis is None:
                return  # a compute op delayed it: load imbalance, counted as idle
            g = self.group_of[axis][rank]
            pc = self.pos[op]
            start = g.starts[pc]
            if start <= t1:
                exposed[axis] += t2 - t1
                return
            exposed[axis] += t2 - start
            t2 = start
            blk = g.blockers[pc]
            if blk < 0:
                if pc == 0:
                    return
                op = g.ops[pc - 1]
            else:
                rank, op = divmod(blk, self.n)

    def axis_changed(self, bit: int, mine: dict) -> None:
        """An axis (its bit, its in-flight groups `mine`) started or stopped having collectives in
        flight: re-rate the other axes' collectives."""
        self.mask = mask = self.mask ^ bit
        self.conc = _CONC[mask]
        self.table = self._mask_tables[mask] or self.tables_of(mask)
        for running in self.runs:
            if running and running is not mine:
                for g in list(running):
                    g.rerate()


def _first_alike(ops: list, plan: _Plan) -> list[int]:
    """For each op, the index of the first collective with its (kind, axis, bytes) (itself if none)."""
    first: dict[tuple, int] = {}
    same = list(range(len(ops)))
    for axis in AXES:
        for i in plan.by_stream[axis]:
            op = ops[i]
            same[i] = first.setdefault((op.kind, op.axis, op.bytes), i)
    return same


class _ComputeStream:
    __slots__ = ("sim", "rank", "ops", "todo", "pc", "end", "base", "slow", "overlap", "due", "work",
                 "factor", "seg", "start", "prev_end", "waited", "compute_ns", "exposed", "running", "slot")

    def __init__(self, sim: _Sim, rank: int, ops: list[int], todo: list, base_ns: list[float], slow: float,
                 overlap: float):
        self.sim, self.rank, self.ops, self.todo, self.pc, self.end = sim, rank, ops, todo, 0, len(ops)
        self.base, self.slow, self.overlap = base_ns, slow, overlap
        self.work = self.factor = 0.0
        self.due = self.seg = self.start = self.prev_end = 0
        self.waited: int | None = None  # the op it last waited for
        self.compute_ns, self.exposed = 0, {a: 0 for a in AXES}
        self.running, self.slot = False, -1

    def advance(self) -> None:
        if self.running or self.pc == self.end:
            return
        sim = self.sim
        i, deps = self.todo[self.pc]
        rank = self.rank
        if deps:
            done = sim.done
            for d in deps:
                if not done[d][rank]:
                    self.waited = d
                    sim.wait(rank * sim.n + d, self)
                    return
        now = sim.now
        if sim.stop_ns and now + sim.tail_ns[i] > sim.stop_ns:
            raise Stopped(now + sim.tail_ns[i], now)
        if self.waited is not None:
            if now > self.prev_end:
                sim.blame(rank, self.prev_end, now, self.waited, self.exposed)
            self.waited = None
        self.running = True
        self.start = self.seg = now
        self.work = w = self.base[i]
        self.factor = f = self.slow * (self.overlap if sim.busy[rank] else 1.0)
        self.due = due = now + int(w * f + 0.5)
        sim.schedule(due, self)
        if sim.comm_slow != 1.0:
            sim.compute_changed(rank)

    def rerate(self) -> None:
        """The rank's communication state changed: carry the remaining work over at the new rate.
        A later finish needs no new event (the pending one fires early and reschedules)."""
        if not self.running:
            return
        sim = self.sim
        now = sim.now
        self.work = max(0.0, self.work - (now - self.seg) / self.factor)
        self.seg = now
        self.factor = self.slow * (self.overlap if sim.busy[self.rank] else 1.0)
        due = now + int(self.work * self.factor + 0.5)
        if due < self.due:
            self.due = due
            sim.schedule(due, self)

    def on_done(self) -> None:
        sim = self.sim
        now = sim.now
        left = self.work * self.factor - (now - self.seg)
        if left >= 0.5:  # slowed down since scheduled: not finished yet
            self.due = due = now + int(left + 0.5)
            sim.schedule(due, self)
            return
        i, rank = self.ops[self.pc], self.rank
        self.compute_ns += now - self.start
        if sim.record:
            sim.spans.append((rank, i, self.start, now - self.start))
        if now > sim.end_ns:
            sim.end_ns = now
        self.prev_end, self.running = now, False
        self.pc += 1
        sim.done[i][rank] = 1
        if sim.waited_on[i]:
            key = rank * sim.n + i
            ws = sim.waiters.pop(key, None)
            if ws:
                sim.woken = key
                for s in ws:
                    s.advance()
        self.advance()
        if sim.comm_slow != 1.0 and not self.running:
            sim.compute_changed(rank)


class _GroupStream:
    __slots__ = ("sim", "axis", "members", "ops", "todo", "pc", "end", "due", "frac", "dur", "seg",
                 "start", "running", "blk", "starts", "blockers", "dk", "mk", "slot", "missing", "bit", "peers",
                 "same")

    def __init__(self, sim: _Sim, axis: str, members: list[int], ops: list[int], todo: list):
        self.sim, self.axis, self.members, self.ops, self.pc, self.end = sim, axis, members, ops, 0, len(ops)
        self.todo = todo                             # [(op, deps on other streams)] shared by the axis
        self.bit, self.peers = _BIT[axis], sim.running[axis]  # the axis's bit, its groups in flight
        self.same = sim.same
        self.blk = -1                                # rank * n + op it last waited for (-1: none)
        self.dk = self.mk = 0                        # (dep, member) where the dependency scan resumes
        self.missing = 0                             # dependencies still awaited, when waiting for all at once
        self.slot = -1
        self.starts = array("q", bytes(8 * len(ops)))          # start of each op (ns)
        self.blockers = array("q", b"\xff" * (8 * len(ops)))  # what each op waited for last (-1: predecessor)
        self.frac = self.dur = 0.0
        self.due, self.seg, self.start, self.running = 0, 0, 0, False

    def advance(self) -> None:
        sim = self.sim
        if self.missing:  # woken by one of the dependencies it waits for at once
            self.missing -= 1
            if self.missing:
                return
            self.blk = sim.woken  # the last one done, as the one-by-one scan would have waited for last
            i = self.ops[self.pc]
        elif self.running or self.pc == self.end:
            return
        else:
            i, deps = self.todo[self.pc]
            if deps and self.scan(i, deps):
                return
        now = sim.now
        axis = self.axis
        self.starts[self.pc] = now
        self.blockers[self.pc] = self.blk
        self.blk = -1
        self.running = True
        self.start = self.seg = now
        self.frac = 1.0
        j = self.same[i]
        dur = sim.table[axis][j]
        if dur is None:
            dur = sim.coll_ns(j, axis)
        if sim.comm_slow != 1.0:
            dur *= sim.comm_factor(self.members)
        self.dur = dur
        self.due = due = now + int(dur + 0.5)
        sim.schedule(due, self)
        peers = self.peers
        peers[self] = None
        if len(peers) == 1:
            sim.axis_changed(self.bit, peers)
        busy, compute = sim.busy, sim.compute
        for r in self.members:
            b = busy[r] = busy[r] + 1
            if b == 1:
                c = compute[r]
                if c.running:
                    c.rerate()

    def scan(self, i: int, deps: tuple[int, ...]) -> bool:
        """Wait for what op i needs of its members' other streams, if anything: True when it waits.
        Its dependencies' waiters are woken in the order they began waiting; where nothing else waits
        for them (sim.counted), the group waits for all its members at once and counts them down,
        else it waits for one at a time (the same start, blocker and order of wake-ups)."""
        sim = self.sim
        members, done = self.members, sim.done
        if sim.counted[i]:
            missing = 0
            for d in deps:
                flags = done[d]
                for r in members:
                    if not flags[r]:
                        missing += 1
                        sim.wait(r * sim.n + d, self)
            self.missing = missing
            return missing > 0
        # done flags never revert, so a wait resumes the scan where it stopped (large groups)
        n, nd = len(members), len(deps)
        dj, mk = self.dk, self.mk
        while dj < nd:
            d = deps[dj]
            flags = done[d]
            while mk < n:
                r = members[mk]
                if not flags[r]:
                    self.dk, self.mk = dj, mk
                    self.blk = key = r * sim.n + d
                    sim.wait(key, self)
                    return True
                mk += 1
            mk = 0
            dj += 1
        self.dk = self.mk = 0
        return False

    def rerate(self) -> None:
        sim = self.sim
        now = sim.now
        self.frac = max(0.0, self.frac - (now - self.seg) / self.dur) if self.dur > 0 else 0.0
        self.seg = now
        self.dur = sim.coll_ns(self.same[self.ops[self.pc]], self.axis) * (
            sim.comm_factor(self.members) if sim.comm_slow != 1.0 else 1.0)
        due = now + int(self.frac * self.dur + 0.5)
        if due < self.due:
            self.due = due
            sim.schedule(due, self)

    def on_done(self) -> None:
        sim = self.sim
        now = sim.now
        left = self.frac * self.dur - (now - self.seg)
        if left >= 0.5:  # slowed down since scheduled: not finished yet
            self.due = due = now + int(left + 0.5)
            sim.schedule(due, self)
            return
        i, members = self.ops[self.pc], self.members
        if sim.record:
            for r in members:
                sim.spans.append((r, i, self.start, now - self.start))
        if now > sim.end_ns:
            sim.end_ns = now
        self.running = False
        self.pc += 1
        peers = self.peers
        del peers[self]
        if not peers:
            sim.axis_changed(self.bit, peers)
        busy, compute, flags = sim.busy, sim.compute, sim.done[i]
        waited = sim.waited_on[i]
        waiters, n = sim.waiters, sim.n
        for r in members:
            b = busy[r] = busy[r] - 1
            if b == 0:
                c = compute[r]
                if c.running:
                    c.rerate()
            flags[r] = 1
            if waited:
                key = r * n + i
                ws = waiters.pop(key, None)
                if ws:
                    sim.woken = key
                    for s in ws:
                        s.advance()
        self.advance()


def simulate_program(program: Program, compute_s: list[float],
                     collective_s: Callable[[int, frozenset], float], *, full: bool = False,
                     slowdown: dict[int, float] | None = None, overlap_slowdown: float = 1.0,
                     record: bool = False, merge_alike: bool = True, comm_share: float = 1.0,
                     lockstep: bool | None = None, stop_ns: int = 0, tail_ns: list[int] | None = None,
                     by_size: bool = False) -> EngineResult:
    """Simulate one iteration of `program`.

    compute_s[i]: seconds compute op i takes alone (ignored for collectives).
    collective_s(i, concurrent): seconds collective op i takes when every group of its axis runs it at
        once while the axes in `concurrent` also have collectives in flight.
    full: simulate every rank of the grid (else one representative rank).
    slowdown: rank -> factor >= 1 on its compute times (full mode; stragglers).
    overlap_slowdown: compute runs this many times slower while a collective of its rank is in flight.
    record: keep spans (rank, op index, start s, duration s) of every op for traces and plots.
    merge_alike: in full mode, simulate each class of ranks that behave alike once (twin.symmetry;
        the result is every rank's); False runs rank by rank (for tests).
    comm_share: a collective progresses at this share of its rate while the compute stream of one of
        its members runs an op (1: unaffected; CPU profiles measure less).
    lockstep: try twin.lockstep where it applies (None: from LOCKSTEP_RANKS distinct ranks; False: never).
    stop_ns, tail_ns: branch and bound (symmetric mode): tail_ns[i] is at most the time (ns) from the
        start of op i to the end of the iteration, whatever the run (the longest path from op i on
        with each op at its least time, twin.search.tail_ns); when a compute op starts at a time t
        with t + tail_ns[i] > stop_ns, the run stops and raises Stopped(t + tail_ns[i]), a lower bound
        on its end (ns). 0: run to the end.
    by_size: collective_s(i, concurrent) depends on op i only through its (kind, axis, bytes), as
        twin.simulate.collective_timer's does: it is then asked once per distinct collective and
        concurrency (a program of 3,000 collectives has a few dozen distinct ones).
    """
    grid: Grid = program.grid
    slowdown = slowdown or {}
    if slowdown and not full:
        raise ValueError("per-rank slowdown factors need full mode")
    plan = _plan(program.ops)
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
    if not 0 < comm_share <= 1:
        raise ValueError(f"comm_share must be in (0, 1], got {comm_share}")
    if lockstep is None:
        lockstep = nsim >= LOCKSTEP_RANKS
    if full and lockstep and nsim == nranks and comm_share == 1.0 and not record:
        from twin.lockstep import simulate_lockstep
        res = simulate_lockstep(program, compute_s, collective_s, classes.factor, overlap_slowdown)
        if res is not None:
            end, compute_ns, exposed_ns, _ = res
            compute = compute_ns / nranks
            exposed = {a: exposed_ns.get(k, 0) / nranks for k, a in enumerate(AXES)}
            idle = end - compute - sum(exposed.values())
            ops = (len(by_stream["compute"]) + sum(len(by_stream[a]) for a in axes)) * nranks
            return EngineResult(iteration_s=end / NS, compute_s=compute / NS,
                                exposed_s={a: v / NS for a, v in exposed.items()}, idle_s=idle / NS,
                                simulated_ops=ops, ranks=nranks, spans=[], classes=nsim)
    sim = _Sim(program, nsim, record, collective_s, by_size, plan)
    sim.comm_slow = 1.0 / comm_share
    if stop_ns:
        if full or tail_ns is None or len(tail_ns) != sim.n:
            raise ValueError("stop_ns needs symmetric mode and a tail per op")
        sim.stop_ns, sim.tail_ns = stop_ns, tail_ns
    base_ns = [t * NS for t in compute_s]
    todo = sim.plan.todo
    sim.compute = [_ComputeStream(sim, c, by_stream["compute"], todo["compute"], base_ns, classes.factor[c],
                                  overlap_slowdown) for c in range(nsim)]
    groups: list[_GroupStream] = []
    for axis in axes:
        streams = [_GroupStream(sim, axis, m, by_stream[axis], todo[axis]) for m in classes.groups[axis]]
        groups += streams
        sim.group_of[axis] = {c: streams[k] for c, k in enumerate(classes.group_of[axis])}
    gc_on = gc.isenabled()
    gc.disable()  # millions of short-lived objects and no cycles to collect: the collector only costs time
    try:
        for s in sim.compute:
            s.advance()
        for g in groups:
            g.advance()
        sim.run()
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
    return EngineResult(iteration_s=end / NS, compute_s=compute / NS,
                        exposed_s={a: v / NS for a, v in exposed.items()}, idle_s=idle / NS,
                        simulated_ops=ops, ranks=nranks, spans=spans, classes=nsim)
