"""The shared state of one run of the engine (twin.engine.engine): the clock and its event loop, the done
flags of every op and rank, who waits for what, the collectives in flight per axis and the tables of
their durations under each set of axes in flight, and the walk that blames a compute stream's wait on
what delayed it (Sim); NS, the engine's unit of time, and Stopped, what its branch and bound raises.

Streams (twin.engine.streams) are small state machines, not simpy processes: a faithful port onto
simpy's event loop cost 1.12x on the engine alone (docs/architecture.md, "The engine and simpy"). A pending completion is an entry (the
stream) in the bucket of its due time; a heap holds the distinct due times, and the loop runs each
time's bucket in scheduling order (entries added while it runs, zero-time ops, run last: simpy's
order on ties). No Python object is made per rank and op: done flags are a bytearray per op (a
group's members' flags for one op sit together), a group's start and blocker of each op are int
arrays, a stream kind's (op, deps) list is shared. No cyclic GC during a run (only cost).
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import TYPE_CHECKING, Callable

from twin.engine.plan import Plan, first_alike, plan_of
from twin.program.grid import AXES
from twin.program.program import Program

if TYPE_CHECKING:
    from twin.engine.streams import ComputeStream, GroupStream

NS = 1e9  # nanoseconds per second
TICK_EVERY = 1 << 14  # due times between two progress ticks (Sim.run)


class Stopped(Exception):
    """A run given `stop_ns` was stopped at `now_ns`: its iteration would end at `bound_ns` or later."""

    def __init__(self, bound_ns: int, now_ns: int = 0):
        super().__init__(bound_ns)
        self.bound_ns, self.now_ns = bound_ns, now_ns


BIT = {a: 1 << k for k, a in enumerate(AXES)}
# _CONC[mask][a]: the axes other than a whose bit is set in mask (the `concurrent` argument of collective_s)
_CONC = [{a: frozenset(b for b in AXES if b != a and mask & BIT[b]) for a in AXES} for mask in range(1 << len(AXES))]


class Sim:
    """Shared state of one run: the clock, per-rank done flags, waiters, in-flight bookkeeping."""

    def __init__(self, program: Program, nranks: int, record: bool,
                 collective_s: Callable[[int, frozenset], float], by_size: bool = False, plan: Plan | None = None):
        self.now = 0                                    # the clock (ns)
        self.heap: list[int] = []                       # due times (ns) that have a bucket
        self.ops, self.n = program.ops, len(program.ops)
        self.plan = plan = plan or plan_of(program.ops)
        self.axis_of = plan.axis_of
        self.done = [bytearray(nranks) for _ in range(self.n)]  # done[op][rank]
        self.waiters: dict[int, list] = {}
        self.busy = [0] * nranks                        # collectives in flight that include the rank
        self.running: dict[str, dict] = {a: {} for a in AXES}  # axis -> in-flight group streams
        self.runs = [self.running[a] for a in AXES]     # the same in AXES order
        self.mask = 0                                   # bit AXES.index(a) set: axis a has collectives in flight
        self.conc = _CONC[0]                            # axis -> the other axes now in flight
        self.compute: list[ComputeStream] = []
        self.group_of: dict[str, dict[int, GroupStream]] = {a: {} for a in AXES}  # axis -> rank -> stream
        self.pos = plan.pos                             # position of each op in its stream
        self.end_ns, self.record = 0, record
        self.spans: list[tuple[int, int, int, int]] = []
        self.waits: list[tuple[int, int, int, str]] = []  # (rank, start ns, end ns, axis): blamed exposed waits
        self._collective_s = collective_s
        # same[i]: the first op with op i's (kind, axis, bytes) where collective_s depends on nothing else
        # (by_size): it is asked once per distinct collective and concurrency, not once per op
        self.same = first_alike(self.ops, plan) if by_size else range(self.n)
        self._tables: dict[frozenset, list] = {}         # concurrent axes -> collective op -> ns (None: not yet)
        self._mask_tables: list[dict | None] = [None] * len(_CONC)  # mask -> {axis: table}, made as reached
        self.table = self.tables_of(0)  # axis -> the table of its concurrency now
        self.cross, self.waited_on, self.counted = plan.cross, plan.waited_on, plan.counted
        self.woken = -1  # rank * n + op: the completion whose waiters are being advanced
        self.buckets: dict[int, list] = {}  # due time (ns) -> streams in scheduling order
        self.comm_slow = 1.0  # comm_slowdown: a collective's time factor while a member's compute runs
        self.stop_ns = 0      # > 0: stop once the end is sure to come later (simulate_program's stop_ns)
        self.tail_ns: list[int] = []

    def comm_factor(self, members: list[int]) -> float:
        """Time factor of a collective of `members` now: comm_slowdown while one of them computes."""
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

    def run(self, tick: Callable[[float], None] | None = None) -> None:
        """Run the buckets in time order until none is left; `tick(fraction)`, where given, is called
        every TICK_EVERY due times with the share of the compute ops done (for a progress bar)."""
        heap, buckets = self.heap, self.buckets
        count = 0
        while heap:
            self.now = now = heappop(heap)
            for k, s in enumerate(buckets[now]):  # entries added at this very time (zero delays) run last
                if s.slot == k and s.due == now:
                    s.on_done()
            del buckets[now]
            if tick is not None:
                count += 1
                if count % TICK_EVERY == 0:
                    tick(sum(c.pc for c in self.compute) / max(1, sum(c.end for c in self.compute)))

    def blame(self, rank: int, t1: int, t2: int, op: int, exposed: dict[str, int]) -> None:
        """Attribute the compute stream's wait [t1, t2] (ns), which ended when `op` completed, by walking
        back what delayed each collective: its transfer time is exposed communication of its axis; a wait
        for its stream's previous collective or for a collective of another axis continues the walk;
        a wait for a compute op of another rank (a straggler) is left to idle. With `record`, each
        stretch blamed on an axis is kept in `waits` as (rank, start, end, axis): the one attribution
        that the breakdown sums and every picture draws."""
        waits = self.waits if self.record else None
        me = rank
        while t2 > t1:
            axis = self.axis_of[op]
            if axis is None:
                return  # a compute op delayed it: load imbalance, counted as idle
            g = self.group_of[axis][rank]
            pc = self.pos[op]
            start = g.starts[pc]
            if start <= t1:
                exposed[axis] += t2 - t1
                if waits is not None:
                    waits.append((me, t1, t2, axis))
                return
            exposed[axis] += t2 - start
            if waits is not None:
                waits.append((me, start, t2, axis))
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
