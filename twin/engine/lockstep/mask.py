"""The global concurrency timeline for twin.engine.lockstep.lockstep: when each axis has collectives in flight on any
group (twin.engine.engine re-rates a collective whenever another axis starts or stops having some).
"""

from __future__ import annotations

import numpy as np

INF = 1 << 62  # a time never reached (ns)


def concurrency_timeline(ls, gimm: dict) -> tuple[dict, dict, dict]:
    """From the intervals a sweep left in ls.AT (twin.engine.lockstep.lockstep; gimm[op][group]: its dependencies were
    done before it started, so it started in its predecessor's end): for each axis k, the times of concurrency changes of the other axes (sorted, sentinel at the
    end), the mask of the other axes in flight after each, and whether it is ambiguous.

    An axis' in-flight count over all its groups turns 0 -> 1 and 1 -> 0 at the ends of the union of
    their collectives' intervals. Where intervals touch (every collective in flight ends at t and
    some start at t) the engine's order decides: one ending and its stream successor starting
    turn it off and on (a split at t); several ending with at least two successors starting at
    once in their own ends (their dependencies done before t) keep it on; other cases are marked
    ambiguous."""
    Ts, As, Xs = [], [], []
    for k in ls.axes:
        G, nk = ls.G[k], len(ls.axis_ops[k])
        ev = ls.AT[k][:-G].reshape(nk, 2, G)
        st, en = ev[:, 0, :].reshape(-1), ev[:, 1, :].reshape(-1)
        imm = np.concatenate([gimm[i] for i in ls.axis_ops[k].tolist()])
        pe = np.concatenate([np.full(G, -2, dtype=np.int64), en[:-G]])  # its stream predecessor's end
        order = np.argsort(st, kind="stable")
        st, en, imm, pe = st[order], en[order], imm[order], pe[order]
        cm = np.maximum.accumulate(en)
        prev = np.concatenate([[-1], cm[:-1]])
        new = st >= prev
        new[0] = True
        touch = new & (st == prev)
        amb = np.zeros(len(st), dtype=bool)
        if touch.any():
            ends_sorted = np.sort(en)
            tj = np.nonzero(touch)[0]
            t = st[tj]
            n_end = np.searchsorted(ends_sorted, t, "right") - np.searchsorted(ends_sorted, t, "left")
            first = np.searchsorted(st, t, "left")
            n_start = np.searchsorted(st, t, "right") - first
            succ = pe == st                  # its stream predecessor ended as it started
            immediate = succ & imm           # ... and it started in that very end
            c = np.concatenate([[0], np.cumsum(immediate)])
            all_imm = c[first + n_start] - c[first] == n_start
            pair = (n_end == 1) & (n_start == 1) & succ[tj]
            merge = ~pair & (n_start >= 2) & all_imm
            amb[tj] = ~(pair | merge)
            new[tj[merge]] = False
        idx = np.nonzero(new)[0]
        t = np.empty(2 * len(idx) + 1, dtype=np.int64)   # off (of the component before), on; last off
        t[0:-1:2], t[1:-1:2], t[-1] = prev[idx], st[idx], cm[-1]
        a = np.zeros(len(t), dtype=bool)
        a[0:-1:2], a[1:-1:2] = amb[idx], amb[idx]
        Ts.append(t[1:])
        As.append(a[1:])
        Xs.append(np.full(len(t) - 1, k, dtype=np.int64))
    T, A, X = np.concatenate(Ts), np.concatenate(As), np.concatenate(Xs)
    o = np.lexsort((np.arange(len(T)), A, T))   # by time, unambiguous first, then as emitted
    T, A, X = T[o], A[o], X[o]
    masks = np.bitwise_xor.accumulate(np.left_shift(1, X))
    T = np.append(T, INF - 1)
    A = np.append(A, False)
    masks = np.append(masks, masks[-1] if len(masks) else 0)
    X = np.append(X, -1)
    out_T, out_C, out_A = {}, {}, {}
    for k in ls.axes:
        keep = X != k
        out_T[k] = T[keep]
        out_C[k] = masks[keep] & ~(1 << k)
        out_A[k] = A[keep]
    return out_T, out_C, out_A
