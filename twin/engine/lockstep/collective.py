"""Collectives for twin.engine.lockstep.lockstep: each op's end on every group of its axis, re-rated at the concurrency
changes of the other axes, with twin.engine.engine's arithmetic; and the checks that stop lockstep where the
engine's order of same-nanosecond events would move an end (Ambiguous).
"""

from __future__ import annotations

import numpy as np

from twin.engine.lockstep.blame import Ambiguous


def collective_end(ls, i, k, S, Tm, Cm, Am):
    """End (ns) of collective op i on every group of axis k started at S, re-rated at the
    concurrency changes of the other axes."""
    idx = np.searchsorted(Tm, S, side="right")
    mask = np.where(idx > 0, Cm[np.maximum(idx - 1, 0)], 0)
    dur = ls.durations(i, k, mask)
    dur0, idx0 = dur, idx
    frac = np.ones(len(S))
    E = S + np.floor(dur + 0.5).astype(np.int64)
    g = np.arange(len(S))
    seg = S
    split = []   # groups split at an ambiguous pair (the engine may not split there)
    while True:
        tn = Tm[idx]
        act = tn < E[g]
        if ls.final:
            at = tn == E[g]
            if at.any():
                _end_tie_collective(ls, i, k, g[at], tn[at], frac[at], dur[at], seg[at], idx[at], Tm, Cm)
        if not act.any():
            break
        g, tn, idx = g[act], tn[act], idx[act]
        frac, dur, seg = frac[act], dur[act], seg[act]
        if ls.final:
            a = Am[idx] & (tn > seg)
            if a.any():
                split.append(g[a])
        frac = np.where(dur > 0, np.maximum(0.0, frac - (tn - seg) / np.where(dur > 0, dur, 1.0)), 0.0)
        seg = tn
        dur = ls.durations(i, k, Cm[idx])
        E[g] = tn + np.floor(frac * dur + 0.5).astype(np.int64)
        idx = idx + 1
    if split:
        for gg in np.unique(np.concatenate(split)).tolist():
            _check_splits(ls, i, k, int(S[gg]), float(dur0[gg]), int(idx0[gg]), int(E[gg]), Tm, Cm, Am)
    return E

def _check_splits(ls, i, k, S, dur, idx, E, Tm, Cm, Am) -> None:
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
                d = float(ls.durations(i, k, Cm[j:j + 1])[0])
                end = t + int(frac * d + 0.5)
            j += 1
        ends.add(end)
    if len(ends) > 1:
        raise Ambiguous("a collective's end depends on the engine's order of same-time events")

def _end_tie_collective(ls, i, k, g, tn, frac, dur, seg, idx, Tm, Cm) -> None:
    """Concurrency changes at the very nanosecond collective op i ends on groups g: harmless if
    taking them before the end leaves it; the others are kept for `ties_ok`."""
    j = idx.copy()
    while True:
        more = Tm[j + 1] == tn
        if not more.any():
            break
        j = j + more
    dur2 = ls.durations(i, k, Cm[j])
    frac2 = np.where(dur > 0, np.maximum(0.0, frac - (tn - seg) / np.where(dur > 0, dur, 1.0)), 0.0)
    moved = np.floor(frac2 * dur2 + 0.5) != 0
    for gg, t in zip(g[moved].tolist(), tn[moved].tolist()):
        ls.ties.append((i, k, gg, t))

def ties_ok(ls, gstart, gend) -> None:
    """The kept end ties, judged on the final intervals: harmless if each concurrency change there
    is another axis starting with collectives that wait for the ending one on a member of its group
    (they start after its end)."""
    for i, k, gg, t in ls.ties:
        ranks = set(ls.members[k][gg].tolist())
        for q in ls.colls:
            kq = ls.ax[q]
            if kq == k:
                continue
            if (gend[q] == t).any():
                raise Ambiguous("another axis may stop as a collective ends")
            hs = np.nonzero(gstart[q] == t)[0]
            if not len(hs):
                continue
            if i not in ls.cross[q]:
                raise Ambiguous("another axis starts as a collective ends")
            for h in hs.tolist():
                if not ranks.intersection(ls.members[kq][h].tolist()):
                    raise Ambiguous("another axis starts as a collective ends")
    return True
