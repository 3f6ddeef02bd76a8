"""Adaptive (UGAL-like) routing between switches of a Network.

Every flow picks, among its L minimal paths and a few Valiant paths, the one with the lowest
(1 + 0.1 x hops) x (utilization of its busiest link), utilization counting the demand (bytes/s) of
the flows already placed; flows are placed in small batches (random order) so that later ones see
earlier ones: UGAL with global knowledge of queue depths, a simplification of Slingshot's per-packet
choice (callers that want packet-level spreading route a flow as several sub-flows). The candidates
are the integers of topologies.routing's `minimal` and `valiant` (with `_valiant_draws`' draws),
read from the network's lookup tables; `route` (topologies.routing) calls `adaptive`.
"""

from __future__ import annotations

import numpy as np

from topologies import caches
from topologies.network import Network, mod

HOPS = 5  # switch-to-switch columns in a path matrix
_CHUNK = 8192  # flows whose candidates adaptive lays out at once


def _live_draws(net: Network, s: np.ndarray, d: np.ndarray, live: np.ndarray, seeds: list[int]) -> list:
    """[x[live] for x in _valiant_draws(net, s, d, seed)] for each seed, without the whole-length
    arrays (the same generators, asked the same numbers in the same order), in the smallest integer
    type that holds them (a byte for Frontier: an eighth of the memory a run touches for them)."""
    G, S = net.groups, net.S
    gs, gd = s // S, d // S
    via = (gs != gd) & (G > 2)
    inside = (gs == gd) & (s != d)
    small = np.min_scalar_type(max(G, S, net.L, 1))
    zero = np.zeros(len(live), dtype=small)

    def reader(draws: np.ndarray):
        """(draws made, index of each live flow's draw among them, which live flows draw or None if all)."""
        k = int(draws.sum())
        if k == 0 or k == len(draws):   # none, or every flow draws: flow i's draw is the i-th
            return k, live, None
        rank = (np.cumsum(draws) - 1)[live]
        lm = draws[live]
        return k, rank, None if lm.all() else lm

    def pick(values: np.ndarray, rank: np.ndarray, lm: np.ndarray | None) -> np.ndarray:
        values = values.astype(small).take(rank)
        return values if lm is None else np.where(lm, values, small.type(0))

    (kv, rv, lv), (ki, ri, li) = reader(via), reader(inside)
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        gi = j = mid = zero
        if kv:
            gi = pick(rng.integers(0, G - 2, kv), rv, lv)
            j = pick(rng.integers(0, net.L, kv), rv, lv)
        if ki:
            mid = pick(rng.integers(0, S, ki), ri, li)
        out.append((gi, j, mid))
    return out


def _candidates(net: Network, s: np.ndarray, d: np.ndarray, draws: list, L: int) -> np.ndarray:
    """(5, flows, L + detours) hops of each flow's candidate paths from switch s to switch d != s
    (-1 = no hop): minimal(net, s, d, j) for each cable j < L (padded to 5 hops), then the Valiant
    path of each set of `_valiant_draws` in `draws` (as `_valiant_paths`). The same integers as those
    formulas, read from the network's lookup tables in the tables' integer type (int32 arithmetic is
    about 2x faster than int64 here; lookups go through take, which does not convert int32 indices
    the way fancy indexing does, 3-4x slower)."""
    port, cable, loc = net.cable_tables
    small = loc.dtype.type
    S, G = net.S, net.groups
    s, d = s.astype(small), d.astype(small)
    cand = np.full((HOPS, len(s), L + len(draws)), -1, dtype=small)
    gs, gd = s // S, d // S
    is_same = gs == gd
    same = np.flatnonzero(is_same)
    cross = np.flatnonzero(~is_same) if len(same) else slice(None)  # a slice writes faster
    if len(same):  # minimal: the local link; Valiant: via a third switch of the group
        s1, d1 = s[same], d[same]
        s1S, sp, dp = s1 * S, s1 - gs[same] * S, d1 - gd[same] * S   # positions in the group
        direct = loc.take(s1S + dp)
        onward = (s1 - sp) * S + dp          # + mid * S: the link from the third switch to d
        cand[1, same, :L] = direct[:, None]
        for k, (_, _, mid) in enumerate(draws):
            mid = mid[same].astype(small)
            # no detour where the third switch is s (loc's -1 for a switch itself would read there) or d
            # (loc gives the direct link, then -1 from d to itself: what no detour gives)
            stay = mid == sp
            cand[0, same, L + k] = np.where(stay, direct, loc.take(s1S + mid))
            cand[1, same, L + k] = np.where(stay, -1, loc.take(mid * S + onward))
    s2, d2, g1, g2 = s[cross], d[cross], gs[cross], gd[cross]
    if len(s2):
        land = net.cable_landing
        there = g1 * G + g2
        dp, s2S = d2 - g2 * S, s2 * S
        port_j, cable_j, land_j = net.cable_tables_by_cable   # (L, pairs): fewer passes over short rows
        cand[0, cross, :L] = loc.take(port_j.take(there, axis=1) + s2S).T
        cand[1, cross, :L] = cable_j.take(there, axis=1).T
        cand[2, cross, :L] = loc.take(land_j.take(there, axis=1) * S + dp).T
        pf, cf = port.ravel(), cable.ravel()       # row r, cable j at r * L + j
        lo, hi, g1GL = np.minimum(g1, g2), np.maximum(g1, g2), g1 * (G * L)
        for k, (gi, j, _) in enumerate(draws):
            c = cand[:, cross, L + k]
            if G > 2:  # via group gi (the draw from G-2 skips both ends), then minimal from where it lands
                gi = gi[cross].astype(small)
                gi += gi >= lo
                gi += gi >= hi
                out = g1GL + gi * L + j[cross].astype(small)    # g1's cable j to group gi
                at = land.take(out)                               # the switch it lands on
                j2 = mod(at + d2, L)
                on = (gi * G + g2) * L + j2                       # gi's cable j2 to g2
                c[0] = loc.take(s2S + pf.take(out))
                c[1] = cf.take(out)
                c[2] = loc.take(at * S + pf.take(on))
                c[3] = cf.take(on)
                c[4] = loc.take(land.take(on) * S + dp)
            else:  # two groups only: minimal, by the address hash
                j = mod(s2 + d2, L)
                c[0] = loc.take(s2S + pf.take(there * L + j))
                c[1] = cf.take(there * L + j)
                c[2] = loc.take(land.take(there * L + j) * S + dp)
            if not isinstance(cross, slice):  # c is a copy, not a view
                cand[:, cross, L + k] = c
    return cand


def _uniform_capacity(net: Network) -> float | None:
    """The capacity (bytes/s) every switch-to-switch link has, or None if they differ."""
    cap = net.capacity[net.b_loc:]
    if len(cap) and cap[0] > 0 and np.isfinite(cap[0]) and (cap == cap[0]).all():
        return float(cap[0])
    return None


# (flows, seed) -> the order adaptive places them in (_placement_order), the last 8
_ORDERS: dict[tuple[int, int], np.ndarray] = caches.register("topologies.adaptive.orders", {})


def _placement_order(n: int, seed: int) -> np.ndarray:
    """The random order in which `adaptive` places n flows: default_rng(seed + 1).permutation(n), kept
    (read-only) for the next call of the same size and seed: a run's axes often route as many flows
    with the same seed, and a shuffle costs about 15 ns per flow."""
    key = (n, seed)
    order = _ORDERS.get(key)
    if order is None:
        if len(_ORDERS) >= 8:
            _ORDERS.pop(next(iter(_ORDERS)))
        order = _ORDERS[key] = np.random.default_rng(seed + 1).permutation(n)
        order.flags.writeable = False
    return order


def _count_costs(one: float, cap: float, flows: int) -> np.ndarray:
    """(flows + 1,) utilization (T[k] + one) / cap of a link that k flows of demand `one` cross, T[k]
    being `one` added k times to 0 in turn (cumsum adds in turn: each entry is the same float
    whatever the table's length)."""
    held = np.zeros(flows + 1)
    np.cumsum(np.full(flows, one), out=held[1:])
    return (held + one) / cap


def adaptive(net: Network, s, d, demand=None, seed: int = 0, batch: int = 128, detours: int = 4,
             hop_weight: float = 0.1, out: np.ndarray | None = None) -> np.ndarray:
    """(flows, 5) switch link matrix chosen UGAL-like among the L minimal paths and `detours` Valiant
    paths, for flows that each want `demand` bytes/s (scalar or per flow; default one link's rate).

    Cost of a path: (1 + hop_weight x hops) x the utilization of its busiest link with this flow
    added (demand placed / capacity): a long path costs a little more than a short one equally
    loaded (plain UGAL's hops x queue would keep two flows on one link rather than detour one).
    Flows are placed `batch` at a time (random order); each batch sees one load snapshot, so small
    batches matter: with 32768 flows, batches of 1024 left the worst ring of Frontier's data axis
    at 3.2 GB/s, batches of 128 at the full 5 GB/s. For the same reason the cost is not clamped at
    full utilization: with a flat cost below saturation a whole batch would pile onto one path.
    `out`: a (flows, 5) integer matrix filled with -1 (a view, say; int32 suffices) to write the result into."""
    s, d = np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64)
    n = len(s)
    if out is None:
        out = np.full((n, HOPS), -1, dtype=np.int64)
    if n == 0:
        return out
    dem = np.broadcast_to(np.asarray(net.capacity.max() if demand is None else demand, dtype=float), (n,))
    order = _placement_order(n, seed)
    parts = max(1, -(-n // batch))                 # the batches of np.array_split(order, parts)
    size, extra = divmod(n, parts)
    bounds = np.concatenate([[0], np.cumsum(np.where(np.arange(parts) < extra, size + 1, size))])
    # A flow that stays on its switch has no hop on any candidate: its path is empty and it places
    # no load (it only adds to the sentinel below), so only the others are laid out and placed, each
    # in the batch it belongs to. The loop over batches is sequential (each batch reads the load the
    # earlier ones placed), so it costs a few small numpy calls per batch: everything else is laid
    # out beforehand, in placement order, chunk by chunk.
    pos = np.flatnonzero((s != d).take(order))
    if len(pos) == 0:
        return out
    live = order[pos]
    nb = np.searchsorted(pos, bounds).tolist()     # batch k places live[nb[k]:nb[k+1]]
    draws = _live_draws(net, s, d, live, [seed + 7919 * k for k in range(detours)])
    cap = _uniform_capacity(net)
    # one demand for all (live) flows: added as a scalar (the same sums); per flow in placement order
    # where demands differ or capacities do (the general path reads them per flow)
    one = dem[live[0]] if (dem == dem[0]).all() else None
    dem = np.ascontiguousarray(dem[live]) if one is None or cap is None else None
    if one is None and (dem == dem[0]).all():
        one = dem[0]
    dem_hops = np.repeat(dem, HOPS) if one is None else None
    L = max(net.L, 1)
    # Utilization of a hop = (load + demand) / capacity, -1 (no hop) reads a sentinel link. With one
    # capacity C for every switch link, max over hops of (load + dem) / C = (max load + dem) / C
    # exactly (rounding is monotone), so a batch reads the load alone; the sentinel's load is -inf
    # (a path of a flow that leaves its switch always has a hop). Else the sentinel's capacity is
    # infinite and the batch also reads capacities.
    # With one demand D for all flows too, a link that k flows cross holds the load T[k], D added k
    # times to 0 in turn: the same float whichever flows they are. T never decreases, so a path's
    # busiest hop is its hop with the most flows, and its cost (T[k] + D) / C is looked up by that
    # count: a batch reads and adds integer counts (in any order) and computes the same floats.
    counts = cap is not None and one is not None and one >= 0
    if counts:
        wide = np.int32 if len(live) * HOPS < 2**30 else np.int64   # (the sentinel stays below 0)
        count = np.zeros(net.n_links + 1, dtype=wide)
        count[-1] = np.iinfo(wide).min // 2       # the sentinel: never a path's busiest hop
        # (T[k] + D) / C for k up to a few hundred flows on a link (the fixed grid's busiest holds 25),
        # grown when a link holds more: at most every flow, as no path crosses a link twice
        cost_of_count = _count_costs(one, cap, min(len(live), 255))
        unit = wide(1)
    else:
        load = np.zeros(net.n_links + 1)           # bytes/s placed per link (sentinel last)
        if cap is None:
            cap_ext = np.append(net.capacity, np.inf)
        else:
            load[-1] = -np.inf
    K = L + detours
    cost_of_hops = 1 + hop_weight * np.arange(HOPS + 1)   # a path's factor by its hops (looked up: 7x faster)
    chunk = max(1, _CHUNK // max(size, 1))        # batches per chunk of laid-out candidates
    rows = np.arange(chunk * (size + 1)) * K      # where each flow's candidates start in a chunk's `flat`
    for k0 in range(0, parts, chunk):
        k1 = min(k0 + chunk, parts)
        A, B = nb[k0], nb[k1]
        if A == B:
            continue
        sel = live[A:B]
        cand = _candidates(net, s[sel], d[sel], [[x[A:B] for x in dr] for dr in draws], L)  # (hops, flows, K)
        factor = cost_of_hops.take(np.add.reduce((cand >= 0).view(np.uint8), axis=0, dtype=np.uint8))  # (flows, K)
        flat = cand.reshape(HOPS, -1)                                                      # (hops, flows*K)
        picked = np.empty(B - A, dtype=np.intp)   # each flow's chosen candidate, as an index into flat
        for k in range(k0, k1):
            a, b = nb[k] - A, nb[k + 1] - A
            if a == b:
                continue
            c = cand[:, a:b]
            if counts:
                busiest = count.take(c).max(0)            # take: a third of the time of x[c] here
                try:
                    cost = cost_of_count.take(busiest)
                except IndexError:
                    cost_of_count = _count_costs(one, cap, min(len(live), 2 * int(busiest.max())))
                    cost = cost_of_count.take(busiest)
            elif cap is None:
                util = load.take(c)
                util += dem[A + a:A + b, None]
                util /= cap_ext.take(c)
                cost = util.max(0)
            else:
                cost = load.take(c).max(0)
                cost += dem[A + a:A + b, None] if one is None else one
                cost /= cap
            cost *= factor[a:b]
            pick = picked[a:b]
            np.add(cost.argmin(1), rows[a:b], out=pick)
            # -1 (no hop) adds to the sentinel, which no cost reads: no effect
            if counts:
                np.add.at(count, flat.take(pick, axis=1), unit)
            else:  # flow by flow, so that each link's load sums its demands in the order it always did
                placed = flat.take(pick, axis=1).T.ravel()
                np.add.at(load, placed, dem_hops[(A + a) * HOPS:(A + b) * HOPS] if one is None else one)
        out[sel] = flat.take(picked, axis=1).T
    return out
