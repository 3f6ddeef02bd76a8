"""Routing on a Network: minimal and non-minimal (Valiant) paths, and `route`, the routes of flows
between GPUs in any mode (minimal, non-minimal, adaptive: topologies.adaptive), kept in a memo.

All functions are vectorized over flows: they take arrays of endpoints and return `Routes`, a CSR
layout of link indices (the links of flow f are `links[ptr[f]:ptr[f+1]]`, in path order).

Between switches:
- minimal: local hop to the switch holding a global link to the destination group, the global link,
  local hop to the destination switch: at most 3 switch-to-switch hops. Among the
  `global_links_per_pair` cables of a group pair, a flow takes cable (src switch + dst switch) mod L,
  like a hash on the addresses.
- non-minimal (Valiant): a global link to an intermediate group (drawn per flow from `seed`), then a
  minimal path from where it lands: at most 5 hops. Inside one group, via a random third switch.
- adaptive: each flow picks the cheapest of its minimal paths and a few Valiant paths, given the
  flows already placed (topologies.adaptive).
A fat tree routes every mode by its ECMP rule (topologies.fattree): one shortest path per flow.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from topologies import caches
from topologies.adaptive import HOPS, adaptive
from topologies.memo import Memo, array_key, digest
from topologies.network import GPU_GPU, Network, same_block
from topologies.common import InputError

MODES = ("minimal", "nonminimal", "adaptive")
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


def _valiant_paths(net: Network, s: np.ndarray, d: np.ndarray, gi: np.ndarray, j: np.ndarray,
                   mid: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(flows, 5) Valiant paths from switch s to switch d given the draws of `_valiant_draws`
    (written into `out`, a (flows, 5) array or view filled with -1, if given)."""
    n, G, S = len(s), net.groups, net.S
    if out is None:
        out = np.full((n, HOPS), -1, dtype=np.int64)
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


# routes already computed in this process, by a digest of the network and the flows: at most 512 MiB
ROUTES = caches.register("topologies.routing.routes", Memo(512 * 2**20, lambda r: r.nbytes))
# network -> network_key(network), for as long as the network lives
_NET_KEYS: "weakref.WeakKeyDictionary[Network, bytes]" = caches.register("topologies.routing.network_keys",
                                                                          weakref.WeakKeyDictionary())


def network_key(net: Network) -> bytes:
    """Digest of what routing reads from a network: its shape and its link capacities."""
    key = _NET_KEYS.get(net)
    if key is None:
        key = _NET_KEYS[net] = digest(net.groups, net.nodes, net.gpn, net.nics_per_node, net.S, net.E, net.L,
                                      net.system.nodes_per_group, net.gpu_nic, array_key(net.capacity),
                                      net.system.fattree)
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
    if net.ports:
        out = _through_ports(net, out)
    out.key = key
    ROUTES.put(key, out)
    return out


def _through_ports(net: Network, r: Routes) -> Routes:
    """`r` with each GPU-GPU link replaced by the sender's port into the node switch and the
    receiver's port out of it (a node switch: Network.ports)."""
    links = r.links
    gg = net.kind[links] == GPU_GPU
    if not gg.any():
        return r
    before = np.concatenate([[0], np.cumsum(gg)])   # GPU-GPU links before each position
    at = np.arange(len(links)) + before[:-1]        # where each old link starts in the new array
    out = np.empty(len(links) + int(before[-1]), dtype=np.int64)
    out[at] = links
    port_out, port_in = net.through_ports(links[gg])
    out[at[gg]], out[at[gg] + 1] = port_out, port_in
    return Routes(r.ptr + before[r.ptr], out)


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
    ft = net.fattree
    hops = 0 if not (sa != sb).any() else 2 * (ft.h - 1) if ft else 3 if mode == "minimal" else HOPS
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
        if ft:  # every mode by the fat tree's ECMP rule (topologies.fattree)
            e = net.endpoint_of_gpus
            p = ft.paths(e[a], e[b])
            m[rows, sw] = np.where(p >= 0, p + net.b_up, -1)
        elif mode == "minimal":
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
