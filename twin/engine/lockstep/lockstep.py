"""Full mode rank by rank, stepped in lockstep: every op once, over all ranks at once (numpy).

Every rank runs the same program; only timings differ. So instead of one event per rank and op
(twin.engine.engine), this steps through the program once with each op's start and end as an array over
ranks (compute ops) or over the groups of its axis (collectives): start = max(stream free, ends of its
deps on its members), end = the op's work integrated over the rate changes inside it, with the event
engine's arithmetic (integer nanoseconds, the same float expressions and rounding), so that the
result is the engine's to the nanosecond (tests/test_lockstep.py compares every span).

Rate changes come from two sources, as in twin.engine.engine:
- a rank's busy state (a collective of the rank in flight) re-rates its compute op (overlap_slowdown).
  Ops are stepped in an order where every collective comes right after the last of its dependencies
  and its stream predecessor; a collective that starts while a compute op of a rank runs depends on
  nothing after that op, so it is stepped before it, and the busy changes inside a compute op are read
  from the collectives already stepped (per axis and rank, a cursor over their starts and ends).
- the global concurrency mask (which axes have collectives in flight anywhere) re-rates collectives.
  It depends on every group's intervals, so a sweep takes it from the sweep before (none for the
  first) and rebuilds it from its own intervals; when it comes back unchanged, the sweep's intervals
  are consistent with it: the engine's causal solution (an op's end depends only on what happened
  before it). Usually two sweeps; after MAX_SWEEPS the event engine runs instead.

Ties. The engine orders the events of one nanosecond by its buckets. Where that order can change a
result, lockstep stops (`simulate_lockstep` returns None and the event engine runs): a rate change at
the very nanosecond an op ends that would move its end, one rank's collectives ending and others
starting at the same nanosecond unless one ends and each start is its stream successor or waits for
it, and waits whose blame (the breakdown's exposed communication) differs with the order. Where a
concurrency change may or may not happen (several groups of an axis end and others start at one
nanosecond), both ways are computed and must agree (the rate is the same on both sides).

twin/engine/lockstep/compute.py steps a compute op (busy re-rating), twin/engine/lockstep/collective.py a collective
(concurrency re-rating), twin/engine/lockstep/mask.py builds the concurrency timeline from a sweep's
intervals, twin/engine/lockstep/blame.py records each compute wait and walks it back for the breakdown.
"""

from __future__ import annotations

import numpy as np

from twin.program.grid import AXES
from twin.engine.lockstep.blame import PRED, Ambiguous, blame, blocker, record_waits
from twin.engine.lockstep.collective import collective_end, ties_ok
from twin.engine.lockstep.compute import compute_end
from twin.engine.lockstep.mask import INF, concurrency_timeline
from twin.engine.symmetry import axis_groups

NS = 1e9
MAX_SWEEPS = 40
FLUSH = 1 << 20     # compute waits kept before their blame walks run (memory)


def _conc(mask: int, k: int) -> frozenset:
    return frozenset(AXES[b] for b in range(len(AXES)) if b != k and mask >> b & 1)


class _Lockstep:
    """The state of one lockstep run: the program's order and layout, and each sweep's timelines."""

    tick = None      # progress callback (simulate_lockstep's tick)
    sweeps_done = 0

    def __init__(self, program, compute_s, collective_s, slow: np.ndarray, overlap: float):
        self.ops = ops = program.ops
        self.n = n = len(ops)
        grid = program.grid
        self.R = R = grid.size
        self.collective_s = collective_s
        self.base = [t * NS for t in compute_s]
        self.f1 = np.asarray(slow, dtype=np.float64) * 1.0
        self.fo = self.f1 * overlap
        self.ax = [AXES.index(op.stream) if op.stream != "compute" else -1 for op in ops]  # an expert axis: data's
        self.cross = [tuple(d for d in op.deps if ops[d].stream != op.stream) for op in ops]
        self.axes = sorted({k for k in self.ax if k >= 0})
        self.members, self.gid = {}, {}
        for k in self.axes:
            m = axis_groups(grid, AXES[k])
            self.members[k] = m
            g = np.empty(R, dtype=np.int64)
            g[m] = np.arange(len(m))[:, None]
            self.gid[k] = g
        self.colls = [i for i in range(n) if self.ax[i] >= 0]
        self.pred = [-1] * n   # previous op on the same stream
        last: dict[str, int] = {}
        for op in ops:
            self.pred[op.index] = last.get(op.stream, -1)
            last[op.stream] = op.index
        # the order ops are stepped in: compute ops in program order, each collective right after the
        # last of its dependencies and its stream predecessor (so that every collective that can start
        # while a compute op runs is stepped before it: twin.engine.lockstep.lockstep's docstring)
        keys: list[tuple] = [()] * n
        for i in range(n):
            if self.ax[i] < 0:
                keys[i] = (i,)
            else:
                parents = [keys[d] for d in ops[i].deps] + ([keys[self.pred[i]]] if self.pred[i] >= 0 else [])
                keys[i] = max(parents, default=(-1,)) + (i,)
        self.order = sorted(range(n), key=lambda i: keys[i])
        at = {i: k for k, i in enumerate(self.order)}
        uses = [-1] * n
        for i in range(n):
            for d in self.cross[i]:
                if uses[d] < 0 or at[i] > at[uses[d]]:
                    uses[d] = i
        self.last_use = uses
        self.axis_ops = {k: np.array([i for i in range(n) if self.ax[i] == k], dtype=np.int64) for k in self.axes}
        self.apos = np.zeros(n, dtype=np.int64)  # a collective's position on its axis' stream
        for v in self.axis_ops.values():
            self.apos[v] = np.arange(len(v))
        self.G = {k: len(self.members[k]) for k in self.axes}
        self.dtab: dict[int, np.ndarray] = {}
        self.keep_spans = False
        self.gm: dict[tuple[int, int], np.ndarray] = {}  # (axis, other axis) -> its groups' members' groups there
        self.ax_arr = np.array(self.ax, dtype=np.int64)
        self.pred_arr = np.array(self.pred, dtype=np.int64)
        self.depkeys = np.array(sorted(d * n + q for q in range(n) if self.ax[q] >= 0 for d in self.cross[q]),
                                dtype=np.int64)
        self.rows = np.arange(R, dtype=np.int64)

    # -- durations ---------------------------------------------------------------------------------
    def durations(self, i: int, k: int, masks: np.ndarray) -> np.ndarray:
        """Duration (ns) of collective op i under each concurrency mask (bits of the other axes)."""
        t = self.dtab.get(i)
        if t is None:
            t = self.dtab[i] = np.full(1 << len(AXES), np.nan)
        v = t[masks]
        miss = np.isnan(v)
        if miss.any():
            for m in np.nonzero(np.bincount(masks[miss], minlength=len(t)))[0].tolist():
                t[m] = self.collective_s(i, _conc(m, k)) * NS
            v = t[masks]
        return v

    def end_on_ranks(self, d: int, cend: dict, gend: dict) -> np.ndarray:
        k = self.ax[d]
        return cend[d] if k < 0 else gend[d][self.gid[k]]

    # -- one sweep ---------------------------------------------------------------------------------
    def sweep(self, mask_tl, final: bool = False):
        """One pass over the program against the given concurrency timeline. Only a final pass judges
        ties and records what blame needs."""
        R = self.R
        self.final = final
        self.ties = []
        self.cspans = {}
        Tm, Cm, Am = mask_tl
        # per axis: row 2j the starts, row 2j + 1 the ends of the axis' j-th collective on each group,
        # a last row of INF; INF where not stepped yet. Rank r's events on axis k: AT[k][e * G + gid].
        self.AT = {k: np.full((2 * len(self.axis_ops[k]) + 1) * self.G[k], INF, dtype=np.int64) for k in self.axes}
        self.cur = {k: np.zeros(R, dtype=np.int64) for k in self.axes}  # per axis and rank: next start/end
        prev_c = np.zeros(R, dtype=np.int64)
        free = {k: np.zeros(len(self.members[k]), dtype=np.int64) for k in self.axes}
        cend: dict[int, np.ndarray] = {}
        gstart: dict[int, np.ndarray] = {}  # views of AT
        gend: dict[int, np.ndarray] = {}
        gimm: dict[int, np.ndarray] = {}    # each group's dependencies were done before it started
        if final:   # per axis, [j * G + group]: what the j-th collective's start waited for last (blame)
            self.BLK = {k: np.full(len(self.axis_ops[k]) * self.G[k], PRED, dtype=np.int64) for k in self.axes}
            self.AMB = {k: np.zeros(len(self.axis_ops[k]) * self.G[k], dtype=bool) for k in self.axes}
            self.galt = {}                  # op -> (groups, classes) of its ambiguous blockers
            self.exposed = {k: 0 for k in range(len(AXES))}
        self.wid = 0                        # compute waits recorded so far (their ids)
        waits = []                          # rows (wait id, t1, t2, class) of compute waits, for blame
        pending = 0
        compute_ns = 0
        tick, n = self.tick, self.n
        for step, i in enumerate(self.order):
            if tick is not None and step % 256 == 0:
                tick((self.sweeps_done + step / n) / (self.sweeps_done + 2))  # sweeps to come: about 2
            k = self.ax[i]
            deps = self.cross[i]
            if k < 0:
                T0 = prev_c
                S = T0
                for d in deps:
                    S = np.maximum(S, self.end_on_ranks(d, cend, gend))
                if deps and final:
                    w = S > T0
                    if w.any():
                        pending += record_waits(self, r := np.nonzero(w)[0], T0[r], S[r], deps, cend, gend, waits)
                        if pending > FLUSH:
                            blame(self, waits)
                            waits, pending = [], 0
                E = compute_end(self, i, S)
                compute_ns += int((E - S).sum())
                if self.keep_spans:
                    self.cspans[i] = (S, E)
                prev_c = E
                if self.last_use[i] >= 0:
                    cend[i] = E
            else:
                M = self.members[k]
                T0 = free[k]
                ends = []
                dmax = np.full(len(T0), -1, dtype=np.int64)  # when its last dependency was done
                for d in deps:
                    e = self.end_on_ranks(d, cend, gend)[M]
                    ends.append((d, e))
                    dmax = np.maximum(dmax, e.max(axis=1))
                S = np.maximum(T0, dmax)
                gimm[i] = dmax < S
                if final:
                    G, j = self.G[k], int(self.apos[i])
                    blk, amb, alt = blocker(self, i, k, T0, S, ends)
                    self.BLK[k][j * G:(j + 1) * G] = blk
                    self.AMB[k][j * G:(j + 1) * G] = amb
                    if alt is not None:
                        self.galt[i] = alt
                del ends
                E = collective_end(self, i, k, S, Tm[k], Cm[k], Am[k])
                G, j = self.G[k], 2 * int(self.apos[i])
                at = self.AT[k]
                at[j * G:(j + 1) * G] = S
                at[(j + 1) * G:(j + 2) * G] = E
                gstart[i], gend[i] = at[j * G:(j + 1) * G], at[(j + 1) * G:(j + 2) * G]
                free[k] = gend[i]
            for d in deps:
                if self.last_use[d] == i and d in cend:
                    del cend[d]
        if final and waits:
            blame(self, waits)
        return dict(gstart=gstart, gend=gend, gimm=gimm, compute_ns=compute_ns,
                    end=max([int(prev_c.max())] + [int(e.max()) for e in gend.values()]))

    def event_time(self, k: int, e: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Time of event e (2j: start, 2j + 1: end of the axis' j-th collective; the last: INF) of axis
        k on ranks r."""
        return self.AT[k][e * self.G[k] + self.gid[k][r]]


    def spans(self, out) -> list[tuple[int, int, float, float]]:
        """Every op of every rank as the engine records it: (rank, op, start s, duration s)."""
        res = []
        for i in range(self.n):
            k = self.ax[i]
            if k < 0:
                S, E = self.cspans[i]
            else:
                S, E = out["gstart"][i][self.gid[k]], out["gend"][i][self.gid[k]]
            res += [(r, i, t / NS, d / NS) for r, t, d in zip(range(self.R), S.tolist(), (E - S).tolist())]
        return res

def simulate_lockstep(program, compute_s, collective_s, slow, overlap_slowdown: float,
                      max_sweeps: int = MAX_SWEEPS, spans: bool = False, tick=None):
    """Simulate every rank of `program` (twin.engine.engine.simulate_program's full mode, rank by rank,
    comm_slowdown 1, no spans) in lockstep. slow[r]: rank r's compute slowdown factor. Returns
    (iteration ns, compute ns summed over ranks, exposed ns per axis summed over ranks, sweeps), or
    None where the event engine's order of same-nanosecond events would decide (module docstring).
    tick(fraction): called now and then with the share of the work done (0-1, an estimate), for progress."""
    ls = _Lockstep(program, compute_s, collective_s, slow, overlap_slowdown)
    ls.keep_spans = spans
    ls.tick, ls.sweeps_done = tick, 0
    if any(d >= i for i in range(ls.n) for d in ls.cross[i]):
        return None
    big = np.array([INF - 1])
    mask_tl = ({k: big for k in ls.axes}, {k: np.zeros(1, dtype=np.int64) for k in ls.axes},
               {k: np.zeros(1, dtype=bool) for k in ls.axes})
    # sweeps after the first judge ties as they go: the one that reproduces its timeline is the answer
    try:
        for sweep in range(1, max_sweeps + 1):
            out = None
            out = ls.sweep(mask_tl, final=sweep > 1)
            ls.sweeps_done = sweep
            new_mask = concurrency_timeline(ls, out["gimm"])
            same = all(np.array_equal(new_mask[j][k], mask_tl[j][k]) for j in range(3) for k in ls.axes)
            mask_tl = new_mask
            if same:
                break
        else:
            ls.why = f"no fixed point in {max_sweeps} sweeps"
            return None
        if sweep == 1:
            out = ls.sweep(mask_tl, final=True)
        ties_ok(ls, out["gstart"], out["gend"])
    except Ambiguous as e:
        ls.why = str(e)
        return None
    exposed = ls.exposed
    if spans:
        return out["end"], out["compute_ns"], exposed, sweep, ls.spans(out)
    return out["end"], out["compute_ns"], exposed, sweep
