"""Max-min fair rates of concurrent flows on a network of links (the flow-level network model).

A flow is a path (an array of link indices); every link has a capacity in bytes/s; a flow may also
have its own rate cap (bytes/s; e.g. what one library channel can drive). The max-min fair
allocation gives every flow the largest rate such that raising any flow would lower a flow that is
no faster. It is computed by progressive filling in the "local bottleneck" form, vectorized over
all flows with numpy: in each round every link offers its remaining capacity shared equally among
its unfrozen flows; a link whose share is the smallest among all links of all of its flows is a
bottleneck, and its flows (plus any flow whose own cap is below all its links' shares) are frozen at
that rate and removed. The smallest share is always such a bottleneck, so each round freezes at
least one link; the number of rounds is the depth of the bottleneck hierarchy (a handful for the
regular traffic of collectives), and each round costs O(flows x path length).
"""

from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np

from topologies.memo import Memo, digest

RATES = Memo(64 * 2**20, lambda r: r.nbytes)  # rates already computed in this process
_ARRAY_KEYS: dict[int, tuple] = {}


def array_key(a: np.ndarray) -> bytes:
    """Digest of an array, remembered for as long as that very array lives (capacity vectors are
    built once per collective model and never changed)."""
    hit = _ARRAY_KEYS.get(id(a))
    if hit is not None and hit[0]() is a:
        return hit[1]
    key = digest(a)
    try:
        ref = weakref.ref(a)
    except TypeError:
        return key
    if len(_ARRAY_KEYS) > 256:
        _ARRAY_KEYS.clear()
    _ARRAY_KEYS[id(a)] = (ref, key)
    return key


def _csr(paths) -> tuple[np.ndarray, np.ndarray]:
    if hasattr(paths, "ptr") and hasattr(paths, "links"):
        return np.asarray(paths.ptr, dtype=np.int64), np.asarray(paths.links, dtype=np.int64)
    lens = np.array([len(p) for p in paths], dtype=np.int64)
    ptr = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    links = np.concatenate([np.asarray(p, dtype=np.int64) for p in paths]) if len(paths) else np.zeros(0, np.int64)
    return ptr, links


def max_min_rates(paths, capacity: np.ndarray, caps: Sequence[float] | np.ndarray | None = None,
                  rtol: float = 1e-9, key: bytes | None = None) -> np.ndarray:
    """Max-min fair rate of each flow, bytes/s.

    paths: an object with CSR arrays `ptr`, `links` (topologies.routing.Routes) or a sequence of
        link-index arrays, one per flow. A link may appear at most once per path.
    capacity: bytes/s of every link (indexed by link).
    caps: optional per-flow upper bound on the rate, bytes/s (np.inf for none).
    A flow with an empty path and no cap gets np.inf.
    Raises ValueError on a NaN or negative capacity or cap (which would defeat the loop's exit test).
    The same question asked twice in a process (the same paths, capacities of the links they use,
    caps) gets the same answer from a memo; treat the array returned as read-only. `key`, a digest
    that determines both the paths and the caps (the caller's), saves hashing them.
    """
    ptr, links = _csr(paths)
    cap_link = np.asarray(capacity, dtype=float)
    n = len(ptr) - 1
    cap_flow = np.full(n, np.inf) if caps is None else np.broadcast_to(np.asarray(caps, dtype=float), (n,)).copy()
    if np.isnan(cap_flow).any() or (cap_flow < 0).any():
        raise ValueError("max_min_rates: per-flow caps must be non-negative numbers (inf for none)")
    if key is None:
        key = digest(getattr(paths, "key", None) or digest(ptr, links), cap_flow)
    key = digest(key, array_key(cap_link), rtol)
    hit = RATES.get(key)
    if hit is not None:
        return hit
    rate = _max_min(ptr, links, cap_link, cap_flow, rtol)
    RATES.put(key, rate)
    return rate


def _max_min(ptr, links, cap_link, cap_flow, rtol) -> np.ndarray:
    n = len(ptr) - 1
    rate = np.full(n, np.inf)
    lens = np.diff(ptr)
    empty = lens == 0
    rate[empty] = cap_flow[empty]
    if links.size == 0:
        return rate
    per_link = np.bincount(links, minlength=len(cap_link))
    used = np.flatnonzero(per_link > 0)                # (on booleans: 4x faster than on counts)
    rem = cap_link[used].copy()                        # remaining capacity of each used link
    if not (rem >= 0).all():  # also refuses NaN: every round must freeze a flow
        raise ValueError("max_min_rates: link capacities must be non-negative numbers")
    U = len(rem)
    tol = 1 + rtol
    fcap = cap_flow[~empty]
    if fcap.size and np.isfinite(top := fcap.max()) and (rem / per_link[used] >= top).all():
        # every link's first fair share (the first round's, computed alike) is at least every
        # flow's cap, so the first round freezes every flow at its own cap: rate = cap
        rate[~empty] = fcap
        return rate
    # renumber the links that carry flows 0..U-1 (no sort: a lookup table over all links)
    local = np.empty(len(cap_link), dtype=np.int64)
    local[used] = np.arange(len(used))
    # the unfrozen flows and their entries, compacted after every round (entries keep their order,
    # so every sum below adds the same numbers in the same order as over all entries)
    flows = np.flatnonzero(~empty)                     # unfrozen flows
    flen = lens[flows]                                 # their path lengths
    lk = local[links]                                  # local link id of each of their entries
    cnt = per_link[used]                               # unfrozen flows per link (first round)
    starts = ptr[:-1][flows]                           # first entry of each flow (first round)
    first = True
    while len(flows):
        if starts is None:
            starts = np.zeros(len(flows), dtype=np.int64)
            np.cumsum(flen[:-1], out=starts[1:])
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(cnt > 0, rem / np.maximum(cnt, 1), np.inf)
        split = _first_round_split(share, lk, starts, flen, fcap, cnt, tol) if first else None
        first = False
        if split is not None:
            fmin, hit = split
        else:
            # per flow: smallest share on its path (and its own cap)
            share_e = share[lk]
            fmin = np.minimum(np.minimum.reduceat(share_e, starts), fcap)
            capped = fcap <= fmin * tol
            if capped.all():  # every flow at its own cap: the last round, no bottleneck to find
                rate[flows] = fmin
                break
            # a link is a bottleneck if its share is at most tol x the smallest fmin of its flows, that
            # is (rounding is monotone) if no flow on it has tol x fmin below the link's share
            slower = np.zeros(U, dtype=bool)
            slower[lk[share_e > np.repeat(fmin * tol, flen)]] = True
            bottleneck = (cnt > 0) & ~slower
            hit = np.maximum.reduceat(bottleneck[lk], starts) | capped
        if not hit.any():  # numerical safety: freeze the globally tightest flows
            hit = fmin <= fmin.min() * tol
        if not hit.any():  # cannot happen with valid inputs; never spin
            raise ValueError("max_min_rates: no flow could be frozen (non-finite rates)")
        if hit.all():  # the last round (often the only one): nothing left to update
            rate[flows] = fmin
            break
        rate[flows[hit]] = fmin[hit]
        done_e = np.repeat(hit, flen)
        rem -= np.bincount(lk[done_e], weights=np.repeat(fmin[hit], flen[hit]), minlength=U)
        np.maximum(rem, 0.0, out=rem)
        keep, keep_e = ~hit, ~done_e
        flows, flen, fcap, lk = flows[keep], flen[keep], fcap[keep], lk[keep_e]
        cnt, starts = np.bincount(lk, minlength=U), None
        if 2 * np.count_nonzero(cnt) < U:  # most links carry no flow any more: renumber the others
            left = np.flatnonzero(cnt > 0)
            local = np.empty(U, dtype=np.int64)
            local[left] = np.arange(len(left))
            lk, rem, cnt, U = local[lk], rem[left], cnt[left], len(left)
    return rate


def _first_round_split(share, lk, starts, flen, fcap, cnt, tol):
    """(fmin, hit) of progressive filling's first round, as the round computes them, working out in
    full only the flows that cross a link whose share is below the largest finite cap. The others
    (`easy`: a finite cap and every link's share at least the largest one) have fmin = their cap and
    are capped; on each link they share, they make it no bottleneck exactly when share > cap x tol,
    which with one cap for all of them is a test per link (the counts of the others give which
    links carry them). None where that does not hold or pays (fewer than half the flows easy)."""
    finite = np.isfinite(fcap)
    if not finite.any():
        return None
    top = fcap[finite].max()
    easy = np.minimum.reduceat((share >= top)[lk], starts) & finite   # every link of the path free
    if 2 * np.count_nonzero(easy) < len(fcap):
        return None
    c = fcap[easy]
    if not (c == c[0]).all():
        return None
    hard = ~easy
    fmin, hit = fcap.copy(), easy.copy()
    slower = np.zeros(len(share), dtype=bool)
    lk_h = lk[np.repeat(hard, flen)]                 # the entries of the other flows, in order
    if len(lk_h):
        flen_h, fcap_h = flen[hard], fcap[hard]
        starts_h = np.zeros(len(flen_h), dtype=np.int64)
        np.cumsum(flen_h[:-1], out=starts_h[1:])
        share_e = share[lk_h]
        fmin_h = np.minimum(np.minimum.reduceat(share_e, starts_h), fcap_h)
        fmin[hard] = fmin_h
        slower[lk_h[share_e > np.repeat(fmin_h * tol, flen_h)]] = True
    # links that carry an easy flow (cap c[0], fmin = c[0]): slower where share > c[0] x tol
    slower |= (cnt > np.bincount(lk_h, minlength=len(share))) & (share > c[0] * tol)
    if len(lk_h):
        bottleneck = (cnt > 0) & ~slower
        hit[hard] = np.maximum.reduceat(bottleneck[lk_h], starts_h) | (fcap_h <= fmin_h * tol)
    return fmin, hit
