"""The streams of one run of the engine (twin.engine.engine), on its shared state (twin.engine.sim.Sim):
a simulated rank's compute stream (ComputeStream: its compute ops one after another, each at its time
alone times the rank's straggler factor, and the overlap slowdown while a collective of the rank is
in flight) and a group's stream of an axis (GroupStream: the axis's collectives in program order,
each starting once every member has done what it depends on, and completing for the whole group at
once). Each is a small state machine: advance() starts its next op if it can, or waits; rerate()
carries the work left over at a new rate; on_done() runs when its entry comes due."""

from __future__ import annotations

from array import array

from twin.engine.sim import BIT, Stopped, Sim
from twin.program.grid import AXES


class ComputeStream:
    __slots__ = ("sim", "rank", "ops", "todo", "pc", "end", "base", "slow", "overlap", "due", "work",
                 "factor", "seg", "start", "prev_end", "waited", "compute_ns", "exposed", "running", "slot")

    def __init__(self, sim: Sim, rank: int, ops: list[int], todo: list, base_ns: list[float], slow: float,
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


class GroupStream:
    __slots__ = ("sim", "axis", "members", "ops", "todo", "pc", "end", "due", "frac", "dur", "seg",
                 "start", "running", "blk", "starts", "blockers", "dk", "mk", "slot", "missing", "bit", "peers",
                 "same")

    def __init__(self, sim: Sim, axis: str, members: list[int], ops: list[int], todo: list):
        self.sim, self.axis, self.members, self.ops, self.pc, self.end = sim, axis, members, ops, 0, len(ops)
        self.todo = todo                             # [(op, deps on other streams)] shared by the axis
        self.bit, self.peers = BIT[axis], sim.running[axis]  # the axis's bit, its groups in flight
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
