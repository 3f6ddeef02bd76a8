"""The breakdown's walk back for twin.engine.lockstep.lockstep: each compute wait that ended with a collective is
attributed by walking back what delayed that collective (twin.engine.sim.Sim.blame), all walks at once.

A collective's start records what it waited for last as a class: PRED (nothing: the stream's previous
op), IDLE (a compute op: the walk ends, the time is idle) or op * BIG + group (a collective of another
axis on that group). Where the engine's order of same-nanosecond events decides which it was, every
candidate is followed and they must agree (else Ambiguous). The final sweep records both as it goes:
`blocker` for each collective's start, `record_waits` for each compute wait.
"""

from __future__ import annotations

import numpy as np

from twin.program.grid import AXES

BIG = 1 << 40        # a collective's blame class is op * BIG + group
IDLE, PRED = -2, -1  # blame classes: a compute op (idle), the stream's previous collective


class Ambiguous(Exception):
    """The event engine's order of same-nanosecond events decides the result here."""


def _node(ls, op, grp):
    """For collectives `op` on groups `grp`: start, blame class, ambiguity, and the key of the
    ambiguous ones' candidate list."""
    start = np.empty(len(op), dtype=np.int64)
    blk = np.empty(len(op), dtype=np.int64)
    amb = np.empty(len(op), dtype=bool)
    ax = ls.ax_arr[op]
    for k in ls.axes:
        m = ax == k
        if not m.any():
            continue
        G = ls.G[k]
        j = ls.apos[op[m]] * G + grp[m]
        start[m] = ls.AT[k][j + ls.apos[op[m]] * G]   # row 2 * apos
        blk[m] = ls.BLK[k][j]
        amb[m] = ls.AMB[k][j]
    return start, blk, amb, ax

def blame(ls, waits: list) -> None:
    """Exposed communication (ns summed over ranks) per axis, added to ls.exposed: each compute
    wait that ended with a collective walks back what delayed it (twin.engine.sim.Sim.blame), all walks
    at once. Where the engine's order of equal-time events decides what a wait or a start waited
    for, every candidate is followed: Ambiguous if they disagree."""
    wid = np.concatenate([w[0] for w in waits])
    t1 = np.concatenate([w[1] for w in waits])
    t2 = np.concatenate([w[2] for w in waits])
    cls = np.concatenate([w[3] for w in waits])
    waits.clear()
    # walks with one row add straight to the totals; walks with several (candidates of equal-time
    # events) keep their rows' sums to compare them at the end
    fk = np.zeros(len(wid), dtype=bool)
    if len(wid) > 1:
        dup = wid[1:] == wid[:-1]   # a wait's candidate rows are adjacent
        fk[1:] |= dup
        fk[:-1] |= dup
    acc = np.zeros((int(fk.sum()), len(AXES)), dtype=np.int64)   # for the rows with fk, in order
    tot = [0] * len(AXES)
    done_w, done_acc = [], []
    alt = None
    while len(wid):
        # follow each row's class: IDLE ends the walk, PRED goes to the stream's previous op
        # (none: the walk ends), a collective class to that collective on its group
        live = cls >= 0
        fl = live[fk]
        done_w.append(wid[fk][~fl])
        done_acc.append(acc[~fl])
        wid, t1, t2, cls, fk, acc = wid[live], t1[live], t2[live], cls[live], fk[live], acc[fl]
        op, grp = cls // BIG, cls % BIG
        start, nxt, forks, a = _node(ls, op, grp)
        fin = start <= t1
        amount = np.where(fin, t2 - t1, t2 - start)
        for k in ls.axes:
            m = (a == k) & ~fk
            tot[k] += int(amount[m].sum())
        if fk.any():
            acc[np.arange(len(acc)), a[fk]] += amount[fk]
        ff = fin[fk]
        done_w.append(wid[fk][ff])
        done_acc.append(acc[ff])
        go = ~fin
        wid, t1, op, grp, nxt, forks, fk, acc = wid[go], t1[go], op[go], grp[go], nxt[go], forks[go], fk[go], acc[~ff]
        t2 = start[go]
        if forks.any():
            if alt is None:
                keys = np.concatenate([op_ * BIG + g for op_, (g, _) in ls.galt.items()])
                vals = np.concatenate([c for _, c in ls.galt.values()])
                o = np.argsort(keys, kind="stable")
                alt = keys[o], vals[o]
            af, ac = alt
            fi = np.nonzero(forks)[0]
            key = op[fi] * BIG + grp[fi]
            lo = np.searchsorted(af, key, "left")
            cnt = np.searchsorted(af, key, "right") - lo
            rep = np.repeat(fi, cnt)
            at = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(lo, cnt)
            # forked rows join the compared ones with what they kept so far (a walk that had one row
            # added its part to the totals: its candidates then compare only what follows)
            full = np.zeros((len(wid), len(AXES)), dtype=np.int64)
            full[fk] = acc
            take = np.concatenate([np.nonzero(~forks)[0], rep])
            nxt = np.concatenate([nxt[~forks], ac[at]])
            newfk = np.concatenate([fk[~forks], np.ones(len(rep), dtype=bool)])
            wid, t1, t2, op, grp, full = wid[take], t1[take], t2[take], op[take], grp[take], full[take]
            fk = newfk
            acc = full[fk]
        p = ls.pred_arr[op]
        is_pred = nxt == PRED
        cls = np.where(is_pred, np.where(p >= 0, p * BIG + grp, IDLE), nxt)
    for k in range(len(AXES)):
        ls.exposed[k] += tot[k]
    w = np.concatenate(done_w)
    if not len(w):
        return
    A = np.concatenate(done_acc)
    o = np.argsort(w, kind="stable")
    w, A = w[o], A[o]
    _, first, counts = np.unique(w, return_index=True, return_counts=True)
    if (A != np.repeat(A[first], counts, axis=0)).any():
        raise Ambiguous("blame differs by the order of equal-time events")
    s = A[first].sum(axis=0)
    for k in range(len(AXES)):
        ls.exposed[k] += int(s[k])


def record_waits(ls, r, t1, t2, deps, cend, gend, waits) -> None:
    """Record the compute waits [t1, t2] of ranks r for blame: one row (wait id, t1, t2, class) per
    candidate the wait may have ended with (the deps done at t2; the engine's order picks one)."""
    cands = []
    for d in deps:
        hit = ls.end_on_ranks(d, cend, gend)[r] == t2
        if hit.any():
            kd = ls.ax[d]
            j = np.nonzero(hit)[0]
            cands.append((j, np.full(len(j), IDLE, dtype=np.int64) if kd < 0 else d * BIG + ls.gid[kd][r[j]]))
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
        waits.append((j + ls.wid, t1[j], t2[j], cls))
    ls.wid += len(r)
    return len(j)

def blocker(ls, i, k, T0, S, ends):
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
        kd = ls.ax[d]
        if kd < 0:
            cls = None
            lo = IDLE
        else:
            gm = ls.gm.get((k, kd))
            if gm is None:
                gm = ls.gm[k, kd] = ls.gid[kd][ls.members[k]]
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
