"""Full mode rank by rank, stepped in lockstep: every op once, over all ranks at once (numpy).

Every rank runs the same program; only timings differ. So instead of one event per rank and op
(twin.engine), this steps through the program once with each op's start and end as an array over
ranks (compute ops) or over the groups of its axis (collectives): start = max(stream free, ends of its
deps on its members), end = the op's work integrated over the rate changes inside it, with the event
engine's arithmetic (integer nanoseconds, the same float expressions and rounding), so that the
result is the engine's to the nanosecond (tests/test_lockstep.py compares every span).

Rate changes come from two sources, as in twin.engine:
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

twin/lockstep_mask.py builds the concurrency timeline from a sweep's intervals; twin/lockstep_blame.py
walks each compute wait back for the breakdown.
"""

from __future__ import annotations

import numpy as np

from twin.grid import AXES
from twin.lockstep_blame import BIG, IDLE, PRED, Ambiguous, blame
from twin.lockstep_mask import INF, concurrency_timeline
from twin.symmetry import axis_groups

NS = 1e9
MAX_SWEEPS = 40
FLUSH = 1 << 20     # compute waits kept before their blame walks run (memory)


def _conc(mask: int, k: int) -> frozenset:
    return frozenset(AXES[b] for b in range(len(AXES)) if b != k and mask >> b & 1)


class _Lockstep:
    """The state of one lockstep run: the program's order and layout, and each sweep's timelines."""

    def __init__(self, program, compute_s, collective_s, slow: np.ndarray, overlap: float):
        self.ops = ops = program.ops
        self.n = n = len(ops)
        grid = program.grid
        self.R = R = grid.size
        self.collective_s = collective_s
        self.base = [t * NS for t in compute_s]
        self.f1 = np.asarray(slow, dtype=np.float64) * 1.0
        self.fo = self.f1 * overlap
        self.ax = [AXES.index(op.axis) if op.stream != "compute" else -1 for op in ops]
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
        # while a compute op runs is stepped before it: twin.lockstep's docstring)
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
        self._gm: dict[tuple[int, int], np.ndarray] = {}  # (axis, other axis) -> its groups' members' groups there
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
        self._wid = 0
        waits = []                          # rows (wait id, t1, t2, class) of compute waits, for blame
        pending = 0
        compute_ns = 0
        for i in self.order:
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
                        pending += self._waits(r := np.nonzero(w)[0], T0[r], S[r], deps, cend, gend, waits)
                        if pending > FLUSH:
                            blame(self, waits)
                            waits, pending = [], 0
                E = self.compute_op(i, S)
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
                    blk, amb, alt = self._blocker(i, k, T0, S, ends)
                    self.BLK[k][j * G:(j + 1) * G] = blk
                    self.AMB[k][j * G:(j + 1) * G] = amb
                    if alt is not None:
                        self.galt[i] = alt
                del ends
                E = self.collective_op(i, k, S, Tm[k], Cm[k], Am[k])
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

    def _waits(self, r, t1, t2, deps, cend, gend, waits) -> None:
        """Record the compute waits [t1, t2] of ranks r for blame: one row (wait id, t1, t2, class) per
        candidate the wait may have ended with (the deps done at t2; the engine's order picks one)."""
        cands = []
        for d in deps:
            hit = self.end_on_ranks(d, cend, gend)[r] == t2
            if hit.any():
                kd = self.ax[d]
                j = np.nonzero(hit)[0]
                cands.append((j, np.full(len(j), IDLE, dtype=np.int64) if kd < 0 else d * BIG + self.gid[kd][r[j]]))
        j = np.concatenate([c[0] for c in cands])
        cls = np.concatenate([c[1] for c in cands])
        if len(j) > len(r):   # a wait with several candidates: one row per distinct (wait, class)
            u = np.unique(np.stack([j, cls], axis=1), axis=0)
            j, cls = u[:, 0], u[:, 1]
        coll = np.zeros(len(r), dtype=bool)
        coll[j[cls >= 0]] = True   # waits that may have ended with a collective (else no blame)
        keep = coll[j]
        j, cls = j[keep], cls[keep]
        if len(j):
            waits.append((j + self._wid, t1[j], t2[j], cls))
        self._wid += len(r)
        return len(j)

    def _blocker(self, i, k, T0, S, ends):
        """The blame class of each group's start: PRED (waited for nothing: the stream's previous op),
        IDLE (last waited for a compute op), or d * BIG + group (a collective d of that group); where
        equal-time candidates differ (the engine's order picks one), all candidates as (group, class)
        rows, for blame to follow each."""
        G = len(S)
        key = np.full(G, PRED, dtype=np.int64)
        amb = np.zeros(G, dtype=bool)
        waited = S > T0
        first = np.ones(G, dtype=bool)
        seen = []
        for d, e in ends:
            hit = e == S[:, None]
            hits = hit.any(axis=1)
            if not hits.any():
                continue
            kd = self.ax[d]
            if kd < 0:
                cls = None
                lo = IDLE
            else:
                gm = self._gm.get((k, kd))
                if gm is None:
                    gm = self._gm[k, kd] = self.gid[kd][self.members[k]]
                cls = d * BIG + gm
                if hit.shape[1] == 1:
                    lo = cls[:, 0]
                else:
                    lo = np.where(hit, cls, np.iinfo(np.int64).max).min(axis=1)
                    hi = np.where(hit, cls, np.iinfo(np.int64).min).max(axis=1)
                    amb |= hits & (lo != hi)
            amb |= hits & ~first & (key != lo)
            amb |= hits & ~waited  # a dependency done exactly when the stream freed: PRED or it
            key = np.where(hits & first & waited, lo, key)
            first &= ~hits
            seen.append((hit, cls))
        if not amb.any():
            return key, amb, None
        gs, cs = [np.nonzero(~waited & amb)[0]], []
        cs.append(np.full(len(gs[0]), PRED, dtype=np.int64))
        for hit, cls in seen:
            gi, mj = np.nonzero(hit & amb[:, None])
            gs.append(gi)
            cs.append(np.full(len(gi), IDLE, dtype=np.int64) if cls is None else cls[gi, mj])
        u = np.unique(np.stack([np.concatenate(gs), np.concatenate(cs)], axis=1), axis=0)
        return key, amb, (u[:, 0], u[:, 1])

    def _time(self, k: int, e: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Time of event e (2j: start, 2j + 1: end of the axis' j-th collective; the last: INF) of axis
        k on ranks r."""
        return self.AT[k][e * self.G[k] + self.gid[k][r]]

    def compute_op(self, i, S):
        """End (ns) of compute op i started at S on every rank, re-rated when its rank's collectives in
        flight go from none to some or back (overlap_slowdown), as twin.engine does."""
        rows, cur, axes = self.rows, self.cur, self.axes
        cnt = np.zeros(self.R, dtype=np.int64)   # collectives of the rank in flight
        nt = {}                                   # per axis: each rank's next start or end after S
        for k in axes:   # events at or before S have happened
            c = cur[k]
            t = self._time(k, c, rows)
            r = np.nonzero(t <= S)[0]
            while len(r):
                c[r] += 1
                tt = self._time(k, c[r], r)
                t[r] = tt
                r = r[tt <= S[r]]
            nt[k] = t
            cnt += c & 1
        f = np.where(cnt > 0, self.fo, self.f1)
        w0 = self.base[i]
        E = S + np.floor(w0 * f + 0.5).astype(np.int64)
        tn = nt[axes[0]] if axes else np.full(self.R, INF)
        for k in axes[1:]:
            tn = np.minimum(tn, nt[k])
        if self.final:
            at = np.nonzero(tn == E)[0]
            if len(at):
                self._end_tie(i, at, tn[at], np.full(len(at), w0), f[at], S[at], cnt[at])
        r = np.nonzero(tn < E)[0]
        if not len(r):
            return E
        w = np.full(len(r), w0)
        f, seg, tn, c0 = f[r], S[r], tn[r], cnt[r]
        nt = {k: v[r] for k, v in nt.items()}
        while True:
            # take every event at tn: ends before starts (an axis' stream successor starts after its end)
            ends = np.zeros(len(r), dtype=np.int64)
            starts = np.zeros(len(r), dtype=np.int64)
            end_op = np.full(len(r), -1, dtype=np.int64)
            start_ops = []
            for k in axes:
                c, t = cur[k], nt[k]
                m = np.nonzero(t == tn)[0]
                while len(m):
                    rm = r[m]
                    e = c[rm]
                    is_end = (e & 1) == 1
                    ends[m] += is_end
                    starts[m] += ~is_end
                    q = self.axis_ops[k][np.minimum(e >> 1, len(self.axis_ops[k]) - 1)]
                    end_op[m[is_end]] = q[is_end]
                    if self.final:
                        start_ops.append((m[~is_end], q[~is_end], k))
                    c[rm] += 1
                    tt = self._time(k, c[rm], rm)
                    t[m] = tt
                    m = m[tt == tn[m]]
            c1 = c0 - ends + starts
            pair = (c0 > 0) & (ends == c0) & (starts > 0)
            toggle = ((c0 == 0) & (starts > 0)) | ((c0 > 0) & (c1 == 0)) | pair
            if self.final and pair.any():
                self._pair_ok(pair, ends, end_op, start_ops)
            w = np.where(toggle, np.maximum(0.0, w - (tn - seg) / f), w)
            seg = np.where(toggle, tn, seg)
            f = np.where(toggle, np.where(c1 > 0, self.fo[r], self.f1[r]), f)
            Er = np.where(toggle, tn + np.floor(w * f + 0.5).astype(np.int64), E[r])
            E[r] = Er
            c0 = c1
            tn = nt[axes[0]]
            for k in axes[1:]:
                tn = np.minimum(tn, nt[k])
            if self.final:
                at = np.nonzero(tn == Er)[0]
                if len(at):
                    self._end_tie(i, r[at], tn[at], w[at], f[at], seg[at], c0[at])
            act = np.nonzero(tn < Er)[0]
            if not len(act):
                break
            r, w, f, seg, tn, c0 = r[act], w[act], f[act], seg[act], tn[act], c0[act]
            nt = {k: v[act] for k, v in nt.items()}
        return E

    def _pair_ok(self, pair, ends, end_op, start_ops) -> None:
        """Every collective of a rank ends at t and some start at t: the engine splits the compute op
        there (off, then on) only if nothing starts before the end. Certain when one ends and each start
        is its stream successor or waits for it (it starts in or after that end)."""
        if (pair & (ends != 1)).any():
            raise Ambiguous("busy: several collectives of a rank end as others start")
        n = self.n
        for m, q, k in start_ops:
            sel = pair[m]
            if not sel.any():
                continue
            eo = end_op[m[sel]]
            same_axis = np.array([self.ax[x] == k for x in eo.tolist()], dtype=bool)
            dep = np.isin(eo * n + q[sel], self.depkeys)
            if not (same_axis | dep).all():
                raise Ambiguous("busy: a collective starts as another ends")
        return True

    def _end_tie(self, i, r, tn, w, f, seg, cnt) -> None:
        """Busy changes at the very nanosecond compute op i ends on ranks r (collectives stepped before
        it, so none waits for it): harmless only if taking them first leaves the end where it is."""
        ends = np.zeros(len(r), dtype=np.int64)
        starts = np.zeros(len(r), dtype=np.int64)
        for k in self.axes:
            c = self.cur[k][r].copy()
            while True:
                m = self._time(k, c, r) == tn
                if not m.any():
                    break
                ends += m & (c & 1 == 1)
                starts += m & (c & 1 == 0)
                c += m
        c1 = cnt - ends + starts
        toggle = ((cnt == 0) & (starts > 0)) | ((cnt > 0) & (c1 == 0)) | ((cnt > 0) & (ends == cnt) & (starts > 0))
        if not toggle.any():
            return True
        f2 = np.where(c1 > 0, self.fo[r], self.f1[r])
        w2 = np.maximum(0.0, w - (tn - seg) / f)
        if (toggle & (np.floor(w2 * f2 + 0.5) != 0)).any():
            raise Ambiguous("busy changes as a compute op ends")
        return True

    def collective_op(self, i, k, S, Tm, Cm, Am):
        """End (ns) of collective op i on every group of axis k started at S, re-rated at the
        concurrency changes of the other axes."""
        idx = np.searchsorted(Tm, S, side="right")
        mask = np.where(idx > 0, Cm[np.maximum(idx - 1, 0)], 0)
        dur = self.durations(i, k, mask)
        dur0, idx0 = dur, idx
        frac = np.ones(len(S))
        E = S + np.floor(dur + 0.5).astype(np.int64)
        g = np.arange(len(S))
        seg = S
        split = []   # groups split at an ambiguous pair (the engine may not split there)
        while True:
            tn = Tm[idx]
            act = tn < E[g]
            if self.final:
                at = tn == E[g]
                if at.any():
                    self._end_tie_collective(i, k, g[at], tn[at], frac[at], dur[at], seg[at], idx[at], Tm, Cm)
            if not act.any():
                break
            g, tn, idx = g[act], tn[act], idx[act]
            frac, dur, seg = frac[act], dur[act], seg[act]
            if self.final:
                a = Am[idx] & (tn > seg)
                if a.any():
                    split.append(g[a])
            frac = np.where(dur > 0, np.maximum(0.0, frac - (tn - seg) / np.where(dur > 0, dur, 1.0)), 0.0)
            seg = tn
            dur = self.durations(i, k, Cm[idx])
            E[g] = tn + np.floor(frac * dur + 0.5).astype(np.int64)
            idx = idx + 1
        if split:
            for gg in np.unique(np.concatenate(split)).tolist():
                self._check_splits(i, k, int(S[gg]), float(dur0[gg]), int(idx0[gg]), int(E[gg]), Tm, Cm, Am)
        return E

    def _check_splits(self, i, k, S, dur, idx, E, Tm, Cm, Am) -> None:
        """A collective's window holds pairs of concurrency changes (one axis off and on at t) that the
        engine may or may not make, depending on its order of same-time events: the same end whichever
        it makes, or Ambiguous. The rate is the same on both sides of a pair, so they only split the
        work's arithmetic; every combination is computed (Python floats: numpy's arithmetic)."""
        amb, sure = set(), set()
        j = idx
        while Tm[j] < E:
            (amb if Am[j] else sure).add(int(Tm[j]))
            j += 1
        times = sorted(amb - sure)
        if len(times) > 6:
            raise Ambiguous("many ambiguous concurrency changes in one collective")
        ends = set()
        for choice in range(1 << len(times)):
            skip = {t for b, t in enumerate(times) if not choice >> b & 1}
            frac, d, seg, end, j = 1.0, dur, S, S + int(dur + 0.5), idx
            while Tm[j] < end:
                t = int(Tm[j])
                if t not in skip:
                    frac = max(0.0, frac - (t - seg) / d) if d > 0 else 0.0
                    seg = t
                    d = float(self.durations(i, k, Cm[j:j + 1])[0])
                    end = t + int(frac * d + 0.5)
                j += 1
            ends.add(end)
        if len(ends) > 1:
            raise Ambiguous("a collective's end depends on the engine's order of same-time events")

    def _end_tie_collective(self, i, k, g, tn, frac, dur, seg, idx, Tm, Cm) -> None:
        """Concurrency changes at the very nanosecond collective op i ends on groups g: harmless if
        taking them before the end leaves it; the others are kept for `ties_ok`."""
        j = idx.copy()
        while True:
            more = Tm[j + 1] == tn
            if not more.any():
                break
            j = j + more
        dur2 = self.durations(i, k, Cm[j])
        frac2 = np.where(dur > 0, np.maximum(0.0, frac - (tn - seg) / np.where(dur > 0, dur, 1.0)), 0.0)
        moved = np.floor(frac2 * dur2 + 0.5) != 0
        for gg, t in zip(g[moved].tolist(), tn[moved].tolist()):
            self.ties.append((i, k, gg, t))

    def ties_ok(self, gstart, gend) -> None:
        """The kept end ties, judged on the final intervals: harmless if each concurrency change there
        is another axis starting with collectives that wait for the ending one on a member of its group
        (they start after its end)."""
        for i, k, gg, t in self.ties:
            ranks = set(self.members[k][gg].tolist())
            for q in self.colls:
                kq = self.ax[q]
                if kq == k:
                    continue
                if (gend[q] == t).any():
                    raise Ambiguous("another axis may stop as a collective ends")
                hs = np.nonzero(gstart[q] == t)[0]
                if not len(hs):
                    continue
                if i not in self.cross[q]:
                    raise Ambiguous("another axis starts as a collective ends")
                for h in hs.tolist():
                    if not ranks.intersection(self.members[kq][h].tolist()):
                        raise Ambiguous("another axis starts as a collective ends")
        return True

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
                      max_sweeps: int = MAX_SWEEPS, spans: bool = False):
    """Simulate every rank of `program` (twin.engine.simulate_program's full mode, rank by rank,
    comm_share 1, no spans) in lockstep. slow[r]: rank r's compute slowdown factor. Returns
    (iteration ns, compute ns summed over ranks, exposed ns per axis summed over ranks, sweeps), or
    None where the event engine's order of same-nanosecond events would decide (module docstring)."""
    ls = _Lockstep(program, compute_s, collective_s, slow, overlap_slowdown)
    ls.keep_spans = spans
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
        ls.ties_ok(out["gstart"], out["gend"])
    except Ambiguous as e:
        ls.why = str(e)
        return None
    exposed = ls.exposed
    if spans:
        return out["end"], out["compute_ns"], exposed, sweep, ls.spans(out)
    return out["end"], out["compute_ns"], exposed, sweep
