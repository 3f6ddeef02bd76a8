"""Routing on a Network: minimal, non-minimal (Valiant) and adaptive (UGAL-like) paths.

All functions are vectorized over flows: they take arrays of endpoints and return `Routes`, a CSR
layout of link indices (the links of flow f are `links[ptr[f]:ptr[f+1]]`, in path order).

Between switches:
- minimal: local hop to the switch holding a global link to the destination group, the global link,
  local hop to the destination switch: at most 3 switch-to-switch hops. Among the
  `global_links_per_pair` cables of a group pair, a flow takes cable (src switch + dst switch) mod L,
  like a hash on the addresses.
- non-minimal (Valiant): a global link to an intermediate group (drawn per flow from `seed`), then a
  minimal path from where it lands: at most 5 hops. Inside one group, via a random third switch.
- adaptive: every flow picks, among its L minimal paths and a few Valiant paths, the one with the
  lowest (1 + 0.1 x hops) x (utilization of its busiest link), utilization counting the demand
  (bytes/s) of the flows already placed; flows are placed in small batches (random order) so
  that later ones see earlier ones: UGAL with global knowledge of queue depths, a simplification of
  Slingshot's per-packet choice (callers that want packet-level spreading route a flow as several
  sub-flows).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from topologies.memo import Memo, array_key, digest
from topologies.network import Network, mod, same_block
from twin.common import InputError

MODES = ("minimal", "nonminimal", "adaptive")
_HOPS = 5  # switch-to-switch columns in a path matrix
_CHUNK = 8192  # flows whose candidates adaptive lays out at once
_ROWS = 16384  # rows of a path matrix compacted at once


@dataclass
class Routes:
    """Paths of flows in CSR form: links of flow f are links[ptr[f]:ptr[f+1]] (link indices)."""

    ptr: np.ndarray
    links: np.ndarray
    key: bytes | None = None  # digest of what determined these routes (set by `route`), for memos

    @property
    def nbytes(self) -> int:
        return self.ptr.nbytes + self.links.nbytes

    def __len__(self) -> int:
        return len(self.ptr) - 1

    def path(self, f: int) -> np.ndarray:
        return self.links[self.ptr[f]:self.ptr[f + 1]]

    @staticmethod
    def from_matrix(m: np.ndarray) -> "Routes":
        """From a (flows, columns) matrix of link indices padded with -1 (links as int64)."""
        mask = m >= 0
        ptr = np.zeros(len(m) + 1, dtype=np.int64)
        # hops per row: a byte dot product is about 3x faster than count_nonzero(mask, axis=1)
        lens = mask.view(np.uint8) @ np.ones(m.shape[1], np.uint8) if m.shape[1] < 256 else mask.sum(1)
        np.cumsum(lens, out=ptr[1:])
        # compress (the indices of the mask's ones, then a gather) is about 4x faster than m[mask] here;
        # by blocks of rows, so that its index array and the narrow links stay small (fresh pages cost)
        links = np.empty(int(ptr[-1]), dtype=np.int64)
        flat, keep, w = m.reshape(-1), mask.reshape(-1), m.shape[1]
        for r0 in range(0, len(m), _ROWS):
            r1 = min(len(m), r0 + _ROWS)
            links[ptr[r0]:ptr[r1]] = np.compress(keep[r0 * w:r1 * w], flat[r0 * w:r1 * w])
        return Routes(ptr, links)

    @staticmethod
    def concat(parts: list["Routes"]) -> "Routes":
        """The flows of all parts, in order (one part: that part itself, not a copy)."""
        if len(parts) == 1:
            return parts[0]
        ptrs, off = [np.zeros(1, dtype=np.int64)], 0
        for r in parts:
            ptrs.append(r.ptr[1:] + off)
            off += len(r.links)
        keys = [r.key for r in parts]
        return Routes(np.concatenate(ptrs), np.concatenate([r.links for r in parts] or [np.zeros(0, np.int64)]),
                      digest(*keys) if parts and None not in keys else None)


def minimal(net: Network, s, d, j=None) -> np.ndarray:
    """(flows, 3) switch-to-switch link matrix (-1 = no hop) of minimal paths from switch s to switch d
    (switch indices, not vertex ids), using global cable j (default: the address hash)."""
    s, d = np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64)
    out = np.full((len(s), 3), -1, dtype=np.int64)
    gs, gd = s // net.S, d // net.S
    same = gs == gd
    i = same & (s != d)
    out[i, 1] = net.local_link(s[i], d[i])
    x = ~same
    if x.any():
        s, d, gs, gd = s[x], d[x], gs[x], gd[x]
        jj = (s + d) % net.L if j is None else np.asarray(j, dtype=np.int64)[x] if np.ndim(j) else np.full(len(s), j)
        a, b = net.global_switch(gs, gd, jj), net.global_switch(gd, gs, jj)
        first = np.where(a != s, net.local_link(s, a), -1)
        last = np.where(b != d, net.local_link(b, d), -1)
        out[x] = np.stack([first, net.global_link(gs, gd, jj), last], 1)
    return out


def valiant(net: Network, s, d, seed: int = 0) -> np.ndarray:
    """(flows, 5) switch-to-switch link matrix of Valiant paths via a random intermediate group
    (or, inside one group or with two groups only, via a random intermediate switch)."""
    s, d = np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64)
    return _valiant_paths(net, s, d, *_valiant_draws(net, s, d, seed))


def _valiant_draws(net: Network, s: np.ndarray, d: np.ndarray, seed: int) -> tuple[np.ndarray, ...]:
    """The random choices of `valiant` per flow (0 where a flow draws none): the intermediate group
    (an index among the G-2 groups other than both ends), the cable to it, the intermediate switch
    (inside one group). Drawn apart from the paths so that adaptive routing can lay them out in
    any order; the draws are those valiant has always made, in flow order."""
    rng = np.random.default_rng(seed)
    n, G, S = len(s), net.groups, net.S
    gs, gd = s // S, d // S
    gi, j, mid = (np.zeros(n, dtype=np.int64) for _ in range(3))
    via_group = (gs != gd) & (G > 2)
    if via_group.any():
        k = int(via_group.sum())
        gi[via_group] = rng.integers(0, G - 2, k)
        j[via_group] = rng.integers(0, net.L, k)
    inside = (gs == gd) & (s != d)
    if inside.any():
        mid[inside] = rng.integers(0, S, int(inside.sum()))
    return gi, j, mid


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


def _valiant_paths(net: Network, s: np.ndarray, d: np.ndarray, gi: np.ndarray, j: np.ndarray,
                   mid: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(flows, 5) Valiant paths from switch s to switch d given the draws of `_valiant_draws`
    (written into `out`, a (flows, 5) array or view filled with -1, if given)."""
    n, G, S = len(s), net.groups, net.S
    if out is None:
        out = np.full((n, _HOPS), -1, dtype=np.int64)
    gs, gd = s // S, d // S
    via_group = (gs != gd) & (G > 2)
    if via_group.any():
        rows = np.flatnonzero(via_group)
        ss, dd, g1, g2, gi, j = s[rows], d[rows], gs[rows], gd[rows], gi[rows], j[rows]
        # an intermediate group distinct from both ends: the draw from G-2 skips the two ends
        lo, hi = np.minimum(g1, g2), np.maximum(g1, g2)
        gi = gi + (gi >= lo)
        gi = gi + (gi >= hi)
        land = net.global_switch(gi, g1, j)
        # minimal(ss, land, j)[:, :2] and minimal(land, dd): both cross groups (gi differs from g1, g2)
        a = net.global_switch(g1, gi, j)
        out[rows, 0] = np.where(a != ss, net.local_link(ss, a), -1)
        out[rows, 1] = net.global_link(g1, gi, j)
        j2 = (land + dd) % net.L
        a, b = net.global_switch(gi, g2, j2), net.global_switch(g2, gi, j2)
        out[rows, 2] = np.where(a != land, net.local_link(land, a), -1)
        out[rows, 3] = net.global_link(gi, g2, j2)
        out[rows, 4] = np.where(b != dd, net.local_link(b, dd), -1)
    inside = (gs == gd) & (s != d)
    if inside.any():  # same group: via a random third switch of the group
        ss, dd = s[inside], d[inside]
        mid = gs[inside] * S + mid[inside]
        detour = (mid != ss) & (mid != dd)
        out[inside, 0] = np.where(detour, net.local_link(ss, np.where(detour, mid, dd)), net.local_link(ss, dd))
        out[inside, 1] = np.where(detour, net.local_link(np.where(detour, mid, ss), dd), -1)
    two = (gs != gd) & ~via_group  # two groups only: no intermediate group, stay minimal
    if two.any():
        out[two, :3] = minimal(net, s[two], d[two])
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
    cand = np.full((_HOPS, len(s), L + len(draws)), -1, dtype=small)
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


_ORDERS: dict[tuple[int, int], np.ndarray] = {}


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
        out = np.full((n, _HOPS), -1, dtype=np.int64)
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
    dem_hops = np.repeat(dem, _HOPS) if one is None else None
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
        wide = np.int32 if len(live) * _HOPS < 2**30 else np.int64   # (the sentinel stays below 0)
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
    cost_of_hops = 1 + hop_weight * np.arange(_HOPS + 1)   # a path's factor by its hops (looked up: 7x faster)
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
        flat = cand.reshape(_HOPS, -1)                                                      # (hops, flows*K)
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
                np.add.at(load, placed, dem_hops[(A + a) * _HOPS:(A + b) * _HOPS] if one is None else one)
        out[sel] = flat.take(picked, axis=1).T
    return out


ROUTES = Memo(512 * 2**20, lambda r: r.nbytes)  # routes already computed in this process
_NET_KEYS: "weakref.WeakKeyDictionary[Network, bytes]" = weakref.WeakKeyDictionary()


def network_key(net: Network) -> bytes:
    """Digest of what routing reads from a network: its shape and its link capacities."""
    key = _NET_KEYS.get(net)
    if key is None:
        key = _NET_KEYS[net] = digest(net.groups, net.nodes, net.gpn, net.nics_per_node, net.S, net.E, net.L,
                                      net.system.nodes_per_group, net.gpu_nic, array_key(net.capacity))
    return key


def route(net: Network, src, dst, src_nic_gpu=None, dst_nic_gpu=None, mode: str = "minimal",
          seed: int = 0, demand=None, key: bytes | None = None) -> Routes:
    """Routes of flows from GPU src to GPU dst (machine-wide GPU ids).

    Inside a node a flow takes the direct GPU-GPU link. Across nodes it leaves through the NIC of
    GPU src_nic_gpu (default: src itself; another GPU of src's node models a library channel that
    uses that GPU's NIC, reached over the node fabric) and enters through the NIC of dst_nic_gpu.
    `demand` (bytes/s, scalar or per flow) is what adaptive routing assumes each flow wants.
    The result is shared with any later call that asks the same (treat it as read-only): keyed by a
    digest of the arguments, or by `key`, a digest of what determines them all (the caller's: it
    saves hashing the arrays).
    """
    if mode not in MODES:
        raise InputError(f"unknown routing mode {mode!r}: choose one of {', '.join(MODES)}")
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    sv = src if src_nic_gpu is None else np.asarray(src_nic_gpu, dtype=np.int64)
    dv = dst if dst_nic_gpu is None else np.asarray(dst_nic_gpu, dtype=np.int64)
    n = len(src)
    dem_key = None if demand is None or mode != "adaptive" else \
        np.broadcast_to(np.asarray(demand, dtype=float), (n,))
    if key is None:
        key = digest(network_key(net), mode, seed if mode != "minimal" else 0, src, dst, sv, dv, dem_key)
    else:
        key = digest("caller", key)
    hit = ROUTES.get(key)
    if hit is not None:
        return hit
    out = _route(net, src, dst, sv, dv, mode, seed, demand)
    out.key = key
    ROUTES.put(key, out)
    return out


def _route(net: Network, src, dst, sv, dv, mode: str, seed: int, demand) -> Routes:
    """Routes of `route`, laid out as a (flows, columns) matrix of link indices padded with -1 and
    compacted: [GPU -> NIC GPU] GPU -> NIC, NIC -> switch, [switch hops], switch -> NIC, NIC -> GPU,
    [NIC GPU -> GPU] for node-crossing flows, the one GPU-GPU link for the others. Columns that no
    flow uses are left out, and a matrix without holes is the CSR layout itself (no compaction)."""
    n = len(src)
    g = net.gpn
    intra = same_block(src, dst, g)
    x = ~intra
    if not x.any():  # every flow stays in its node: one link each (none to itself)
        i = src != dst
        if i.all():
            return Routes(np.arange(n + 1, dtype=np.int64), net.gpu_link(src, dst).astype(np.int64, copy=False))
        return Routes.from_matrix(np.where(i, net.gpu_link(src, dst), -1)[:, None])
    has_intra = not x.all()
    rows = np.flatnonzero(x) if has_intra else slice(None)   # a slice reads and writes faster
    s, t, a, b = src[rows], dst[rows], sv[rows], dv[rows]
    off_a, off_b = a != s, b != t
    first = has_intra or bool(off_a.any())    # a column for the first GPU-GPU link
    last = bool(off_b.any())                  # one for the last
    sa, sb = net.switch_of_gpu[a], net.switch_of_gpu[b]
    hops = 0 if not (sa != sb).any() else 3 if mode == "minimal" else _HOPS
    c = int(first)                            # column of GPU -> NIC
    # link indices in 32 bits where they fit (half the bytes to write and compact), int64 in the result
    m = np.full((n, c + 4 + hops + int(last)), -1, dtype=np.int32 if net.n_links < 2**31 else np.int64)
    if has_intra:
        i = intra & (src != dst)
        m[i, 0] = net.gpu_link(src[i], dst[i])
    if first and off_a.any():
        m[rows, 0] = np.where(off_a, net.gpu_link(s, a), -1)
    nic_a, nic_b = net.nic_of_gpus[a], net.nic_of_gpus[b]
    m[rows, c] = net.gpu_to_nic_link(a)
    m[rows, c + 1] = net.nic_to_switch_link(nic_a)
    if hops:
        sw = slice(c + 2, c + 2 + hops)
        if mode == "minimal":
            m[rows, sw] = minimal(net, sa, sb)
        elif mode == "nonminimal":
            m[rows, sw] = valiant(net, sa, sb, seed)
        else:
            dem = None if demand is None else np.broadcast_to(np.asarray(demand, dtype=float), (n,))[rows]
            if isinstance(rows, slice):  # written in place
                adaptive(net, sa, sb, dem, seed, out=m[rows, sw])
            else:
                m[rows, sw] = adaptive(net, sa, sb, dem, seed)
    m[rows, c + 2 + hops] = net.switch_to_nic_link(nic_b)
    m[rows, c + 3 + hops] = net.nic_to_gpu_link(b)
    if last:
        m[rows, -1] = np.where(off_b, net.gpu_link(b, t), -1)
    if not (has_intra or hops) and (not first or off_a.all()) and (not last or off_b.all()):
        # every flow has every column: the matrix is the CSR layout
        return Routes(np.arange(0, n * m.shape[1] + 1, m.shape[1], dtype=np.int64), m.ravel().astype(np.int64))
    return Routes.from_matrix(m)
