"""Compute ops for twin.engine.lockstep.lockstep: each op's end on every rank, re-rated when the rank's collectives in
flight go from none to some or back (overlap_slowdown), with twin.engine.engine's arithmetic; and the checks
that stop lockstep where the engine's order of same-nanosecond events would move an end (Ambiguous).
"""

from __future__ import annotations

import numpy as np

from twin.engine.lockstep.blame import Ambiguous
from twin.engine.lockstep.mask import INF


def compute_end(ls, i, S):
    """End (ns) of compute op i started at S on every rank, re-rated when its rank's collectives in
    flight go from none to some or back (overlap_slowdown), as twin.engine.engine does."""
    rows, cur, axes = ls.rows, ls.cur, ls.axes
    cnt = np.zeros(ls.R, dtype=np.int64)   # collectives of the rank in flight
    nt = {}                                   # per axis: each rank's next start or end after S
    for k in axes:   # events at or before S have happened
        c = cur[k]
        t = ls.event_time(k, c, rows)
        r = np.nonzero(t <= S)[0]
        while len(r):
            c[r] += 1
            tt = ls.event_time(k, c[r], r)
            t[r] = tt
            r = r[tt <= S[r]]
        nt[k] = t
        cnt += c & 1
    f = np.where(cnt > 0, ls.fo, ls.f1)
    w0 = ls.base[i]
    E = S + np.floor(w0 * f + 0.5).astype(np.int64)
    tn = nt[axes[0]] if axes else np.full(ls.R, INF)
    for k in axes[1:]:
        tn = np.minimum(tn, nt[k])
    if ls.final:
        at = np.nonzero(tn == E)[0]
        if len(at):
            _end_tie(ls, i, at, tn[at], np.full(len(at), w0), f[at], S[at], cnt[at])
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
                q = ls.axis_ops[k][np.minimum(e >> 1, len(ls.axis_ops[k]) - 1)]
                end_op[m[is_end]] = q[is_end]
                if ls.final:
                    start_ops.append((m[~is_end], q[~is_end], k))
                c[rm] += 1
                tt = ls.event_time(k, c[rm], rm)
                t[m] = tt
                m = m[tt == tn[m]]
        c1 = c0 - ends + starts
        pair = (c0 > 0) & (ends == c0) & (starts > 0)
        toggle = ((c0 == 0) & (starts > 0)) | ((c0 > 0) & (c1 == 0)) | pair
        if ls.final and pair.any():
            _pair_ok(ls, pair, ends, end_op, start_ops)
        w = np.where(toggle, np.maximum(0.0, w - (tn - seg) / f), w)
        seg = np.where(toggle, tn, seg)
        f = np.where(toggle, np.where(c1 > 0, ls.fo[r], ls.f1[r]), f)
        Er = np.where(toggle, tn + np.floor(w * f + 0.5).astype(np.int64), E[r])
        E[r] = Er
        c0 = c1
        tn = nt[axes[0]]
        for k in axes[1:]:
            tn = np.minimum(tn, nt[k])
        if ls.final:
            at = np.nonzero(tn == Er)[0]
            if len(at):
                _end_tie(ls, i, r[at], tn[at], w[at], f[at], seg[at], c0[at])
        act = np.nonzero(tn < Er)[0]
        if not len(act):
            break
        r, w, f, seg, tn, c0 = r[act], w[act], f[act], seg[act], tn[act], c0[act]
        nt = {k: v[act] for k, v in nt.items()}
    return E

def _pair_ok(ls, pair, ends, end_op, start_ops) -> None:
    """Every collective of a rank ends at t and some start at t: the engine splits the compute op
    there (off, then on) only if nothing starts before the end. Certain when one ends and each start
    is its stream successor or waits for it (it starts in or after that end)."""
    if (pair & (ends != 1)).any():
        raise Ambiguous("busy: several collectives of a rank end as others start")
    n = ls.n
    for m, q, k in start_ops:
        sel = pair[m]
        if not sel.any():
            continue
        eo = end_op[m[sel]]
        same_axis = np.array([ls.ax[x] == k for x in eo.tolist()], dtype=bool)
        dep = np.isin(eo * n + q[sel], ls.depkeys)
        if not (same_axis | dep).all():
            raise Ambiguous("busy: a collective starts as another ends")
    return True

def _end_tie(ls, i, r, tn, w, f, seg, cnt) -> None:
    """Busy changes at the very nanosecond compute op i ends on ranks r (collectives stepped before
    it, so none waits for it): harmless only if taking them first leaves the end where it is."""
    ends = np.zeros(len(r), dtype=np.int64)
    starts = np.zeros(len(r), dtype=np.int64)
    for k in ls.axes:
        c = ls.cur[k][r].copy()
        while True:
            m = ls.event_time(k, c, r) == tn
            if not m.any():
                break
            ends += m & (c & 1 == 1)
            starts += m & (c & 1 == 0)
            c += m
    c1 = cnt - ends + starts
    toggle = ((cnt == 0) & (starts > 0)) | ((cnt > 0) & (c1 == 0)) | ((cnt > 0) & (ends == cnt) & (starts > 0))
    if not toggle.any():
        return True
    f2 = np.where(c1 > 0, ls.fo[r], ls.f1[r])
    w2 = np.maximum(0.0, w - (tn - seg) / f)
    if (toggle & (np.floor(w2 * f2 + 0.5) != 0)).any():
        raise Ambiguous("busy changes as a compute op ends")
    return True
