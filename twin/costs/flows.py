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

from typing import Sequence

import numpy as np

from topologies import caches
from topologies.memo import Memo, array_key, digest

# max-min rates already computed in this process, by a digest of the flows and capacities: at most 64 MiB
RATES = caches.register("twin.costs.flows.rates", Memo(64 * 2**20, lambda r: r.nbytes))
# link count -> a scratch table of link places (see _places): at most 4 network sizes
_PLACES: dict[int, np.ndarray] = caches.register("twin.costs.flows.places", {})


def _places(used: np.ndarray, n_links: int) -> np.ndarray:
    """A table over all n_links links that gives each of the `used` links its place in `used`
    (0..len(used)-1); read it at used links only (elsewhere it holds what earlier calls left).
    One table per network size, kept: a fresh one costs a page fault per page it touches."""
    table = _PLACES.get(n_links)
    if table is None:
        if len(_PLACES) >= 4:
            _PLACES.clear()
        table = _PLACES[n_links] = np.empty(n_links, dtype=np.int64)
    table[used] = np.arange(len(used))
    return table


def _csr(paths) -> tuple[np.ndarray, np.ndarray]:
    if hasattr(paths, "ptr") and hasattr(paths, "links"):
        return np.asarray(paths.ptr, dtype=np.int64), np.asarray(paths.links, dtype=np.int64)
    lens = np.array([len(p) for p in paths], dtype=np.int64)
    ptr = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    links = np.concatenate([np.asarray(p, dtype=np.int64) for p in paths]) if len(paths) else np.zeros(0, np.int64)
    return ptr, links


def max_min_rates(paths, capacity: np.ndarray, caps: Sequence[float] | np.ndarray | None = None,
                  rtol: float = 1e-9, key: bytes | None = None,
                  link_counts=None) -> np.ndarray:
    """Max-min fair rate of each flow, bytes/s.

    paths: an object with CSR arrays `ptr`, `links` (topologies.routing.Routes) or a sequence of
        link-index arrays, one per flow. A link may appear at most once per path.
    capacity: bytes/s of every link (indexed by link).
    caps: optional per-flow upper bound on the rate, bytes/s (np.inf for none).
    A flow with an empty path and no cap gets np.inf.
    Raises ValueError on a NaN or negative capacity or cap (which would defeat the loop's exit test).
    The same question asked twice in a process (the same paths, capacities of the links they use,
    caps) gets the same answer from a memo; treat the array returned as read-only. `key`, a digest
    that determines both the paths and the caps (the caller's), saves hashing them; with a key, `paths`
    and `caps` may be functions that return them (called only when the memo does not have the rates,
    as concatenating a million entries costs milliseconds). `link_counts`,
    (the links the paths cross, sorted; the number of paths through each of them), or a function
    that returns them (called only when the memo does not have the rates), saves counting them
    where the caller knows them.
    """
    cap_link = np.asarray(capacity, dtype=float)
    if key is not None:  # the memo first: nothing to lay out or check for a question asked before
        key = digest(key, array_key(cap_link), rtol)
        hit = RATES.get(key)
        if hit is not None:
            return hit
    paths, caps = paths() if callable(paths) else paths, caps() if callable(caps) else caps
    ptr, links = _csr(paths)
    n = len(ptr) - 1
    cap_flow = np.full(n, np.inf) if caps is None else np.broadcast_to(np.asarray(caps, dtype=float), (n,)).copy()
    if np.isnan(cap_flow).any() or (cap_flow < 0).any():
        raise ValueError("max_min_rates: per-flow caps must be non-negative numbers (inf for none)")
    if key is None:
        key = digest(digest(getattr(paths, "key", None) or digest(ptr, links), cap_flow), array_key(cap_link), rtol)
        hit = RATES.get(key)
        if hit is not None:
            return hit
    rate = _max_min(ptr, links, cap_link, cap_flow, rtol, link_counts() if callable(link_counts) else link_counts)
    RATES.put(key, rate)
    return rate


def _max_min(ptr, links, cap_link, cap_flow, rtol, link_counts=None) -> np.ndarray:
    n = len(ptr) - 1
    rate = np.full(n, np.inf)
    lens = np.diff(ptr)
    empty = lens == 0
    rate[empty] = cap_flow[empty]
    if links.size == 0:
        return rate
    if link_counts is None:
        per_link = np.bincount(links, minlength=len(cap_link))
        used = np.flatnonzero(per_link > 0)            # (on booleans: 4x faster than on counts)
        count = per_link[used]                         # flows per used link
    else:
        used, count = link_counts
    rem = cap_link[used]                               # remaining capacity of each used link (a copy)
    if not (rem >= 0).all():  # also refuses NaN: every round must freeze a flow
        raise ValueError("max_min_rates: link capacities must be non-negative numbers")
    tol = 1 + rtol
    # the unfrozen flows, their caps, path lengths and first entries (first round)
    if empty.any():
        flows = np.flatnonzero(~empty)
        fcap, flen, starts = cap_flow[flows], lens[flows], ptr[:-1][flows]
    else:  # (cap_flow is the caller's copy)
        flows, fcap, flen, starts = np.arange(n), cap_flow, lens, ptr[:-1]
    share = rem / count                                # every used link's first fair share
    if np.isfinite(top := fcap.max()) and (share >= top).all():
        # every link's first fair share is at least every flow's cap, so the first round freezes
        # every flow at its own cap: rate = cap
        rate[flows] = fcap
        return rate
    first = _first_round(links, cap_link, count, used, share, starts, flen, fcap, tol)
    if first is not None:
        fmin, hit, rest = first
        if rest is None:  # the first round froze every flow
            rate[flows] = fmin
            return rate
        rate[flows[hit]] = fmin[hit]
        keep, lk, rem, cnt = rest
        flows, flen, fcap, starts = flows[keep], flen[keep], fcap[keep], None
    else:
        # renumber the links that carry flows 0..U-1 (no sort: a lookup table over all links)
        lk = _places(used, len(cap_link))[links]       # local link id of each entry
        cnt = count                                    # unfrozen flows per link
    # the unfrozen flows and their entries, compacted after every round (entries keep their order,
    # so every sum below adds the same numbers in the same order as over all entries)
    U = len(rem)
    while len(flows):
        if starts is None:
            starts = np.zeros(len(flows), dtype=np.int64)
            np.cumsum(flen[:-1], out=starts[1:])
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(cnt > 0, rem / np.maximum(cnt, 1), np.inf)
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


def _flow_of(e: np.ndarray, starts: np.ndarray, flen: np.ndarray) -> np.ndarray:
    """The flow of each of the entries `e` (sorted entry indices; flows by their first entry
    `starts`, increasing, and path lengths `flen`, laid out one after the other)."""
    if 4 * len(e) < len(starts):  # a binary search per entry (sorted: from where the last one ended)
        return np.searchsorted(starts, e, side="right") - 1
    return np.repeat(np.arange(len(starts)), flen)[e]   # else a table of every entry's flow


def _entries(flows: np.ndarray, starts: np.ndarray, flen: np.ndarray) -> np.ndarray:
    """The entries of `flows` (flow indices, increasing), in order."""
    fl = flen[flows]
    at = np.zeros(len(flows), dtype=np.int64)
    np.cumsum(fl[:-1], out=at[1:])
    return np.repeat(starts[flows] - at, fl) + np.arange(at[-1] + fl[-1])


def _on(links: np.ndarray, n_links: int, which: np.ndarray) -> np.ndarray:
    """The entries (increasing) whose link is one of `which` (link indices)."""
    on = np.zeros(n_links, dtype=bool)
    on[which] = True
    return np.flatnonzero(on[links])


def _first_round(links, cap_link, count, used, share, starts, flen, fcap, tol):
    """Progressive filling's first round (as the loop of _max_min computes it) where most flows are
    `easy`: a finite cap c, the same for all of them, and no link of the path `narrow` (a first
    fair share, `share` of the `used` links crossed by `count` flows, below `top`, the largest
    finite cap). An easy flow freezes at c; on a link it crosses it makes the link no bottleneck
    exactly when share > c x tol. The other flows (`hard`) are worked out from a few entries `E`:

    - a hard flow that crosses a narrow link (N) has its first-round rate fmin = min(cap, its
      narrow links' shares) (every other link's share is at least top), and each link with share
      above fmin x tol is no bottleneck, by the flow itself; so a link with share above
      tau = max over N of fmin x tol is no bottleneck for any N flow: only its links with share
      at most tau can free it, and E holds every entry on those links (every flow there, easy ones
      included, is known: a link's test is exact);
    - a hard flow without a narrow link (an uncapped one: I) may be freed by any link it crosses:
      where there are N flows too, E holds every entry on every link an I flow crosses; with no
      narrow link at all there are no N flows, E holds the I flows' entries, and the other flows
      on their links are easy ones (the link's count minus E's).

    The links of the flows left unfrozen get their remaining capacity exactly as the loop's
    bincount gives it: capacity minus the frozen rates on the link added up in entry order; where
    no hard flow froze, that sum is c + c + ... (a table by count), else one weighted bincount over
    every entry (c for an easy flow's, the frozen rate or 0 for a hard flow's: adding 0 changes no
    sum, so each link's sum is the loop's, the same numbers in the same order).

    Returns None where that does not hold or pays (fewer than half the flows easy, easy caps that
    differ); else (fmin, hit, rest) over the flows: their first-round rate and whether they froze,
    rest None when every flow froze, else (indices of the unfrozen flows, their entries' link ids
    0..U-1, the remaining capacity of those U links, the unfrozen flows per link)."""
    finite = np.isfinite(fcap)
    if not finite.any():
        return None
    top = fcap.max(where=finite, initial=-np.inf)
    narrow = share < top
    if narrow.any():  # the flows with an entry on a narrow link (N) are not easy
        E = _on(links, len(cap_link), used[narrow])
        fE = _flow_of(E, starts, flen)
        easy = finite.copy()
        easy[fE] = False
    else:
        easy = finite
    if 2 * np.count_nonzero(easy) < len(fcap):
        return None
    c = fcap[np.argmax(easy)]                          # the first easy flow's cap
    if not np.all(fcap == c, where=easy):
        return None
    fmin, hit = fcap.copy(), easy.copy()
    hard = np.flatnonzero(~easy)
    if len(hard) == 0:
        return fmin, hit, None
    uidx = _places(used, len(cap_link))                # a used link's place in `used`
    if narrow.any():
        isn = np.zeros(len(fcap), dtype=bool)
        isn[fE] = True
        I = hard[~isn[hard]]                           # hard without a narrow link: uncapped
        lE = uidx[links[E]]
        gst = np.flatnonzero(np.diff(fE, prepend=-1))  # each N flow's first entry in E
        tau = np.minimum(np.minimum.reduceat(share[lE], gst), fcap[fE[gst]]).max() * tol
        more = (share >= top) & (share <= tau)         # not narrow, yet maybe an N flow's bottleneck
        if more.any() or len(I):  # E: every entry on narrow, `more` and I flows' links
            extra = [used[narrow | more]]
            if len(I):
                extra.append(links[_entries(I, starts, flen)])
            E = _on(links, len(cap_link), np.concatenate(extra))
            fE = _flow_of(E, starts, flen)
            lE = uidx[links[E]]
        scanned = True
    else:  # every hard flow is uncapped: E is their entries
        E = _entries(hard, starts, flen)
        fE = np.repeat(hard, flen[hard])
        lE = uidx[links[E]]
        scanned = False
    sE = share[lE]
    # the hard flows' rates from their entries in E, and which links are no bottleneck
    hE = ~easy[fE]
    fH = fE[hE]
    gst = np.flatnonzero(np.diff(fH, prepend=-1))      # each hard flow's first entry (every one has some)
    fmin_h = np.minimum(np.minimum.reduceat(sE[hE], gst), fcap[hard])
    fm = np.full(len(E), c)
    fm[hE] = np.repeat(fmin_h, np.diff(gst, append=len(fH)))
    slower = np.zeros(len(used), dtype=bool)
    slower[lE[sE > fm * tol]] = True
    if not scanned:  # an easy flow on the link (not in E) is slower
        slower |= (count > np.bincount(lE, minlength=len(used))) & (share > c * tol)
    hit_h = np.maximum.reduceat(~slower[lE[hE]], gst) | (fcap[hard] <= fmin_h * tol)
    fmin[hard], hit[hard] = fmin_h, hit_h
    if hit_h.all():
        return fmin, hit, None
    left = hard[~hit_h]
    lr = uidx[links[_entries(left, starts, flen)]]  # the unfrozen flows' entries
    need = np.zeros(len(used), dtype=bool)
    need[lr] = True                                    # the links they cross
    nl = np.flatnonzero(need)
    renum = np.empty(len(used), dtype=np.int64)
    renum[nl] = np.arange(len(nl))
    lk = renum[lr]
    cnt = np.bincount(lk, minlength=len(nl))
    if hit_h.any():  # hard flows' rates add up between the c's: in order
        w = np.repeat(np.where(hit, fmin, 0.0), flen)  # each entry's frozen rate (0: not frozen)
        acc = np.bincount(links, weights=w, minlength=len(cap_link))[used[nl]]
    else:  # only easy flows froze: c added (count - unfrozen) times, in turn
        easy_cnt = count[nl] - cnt
        acc = np.add.accumulate(np.concatenate([[0.0], np.full(int(easy_cnt.max()), c)]))[easy_cnt]
    rem = cap_link[used[nl]] - acc
    np.maximum(rem, 0.0, out=rem)
    return fmin, hit, (left, lk, rem, cnt)
