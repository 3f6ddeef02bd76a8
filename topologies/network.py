"""The machine as a graph of directed links: GPUs, NICs and switches (a Slingshot dragonfly or a fat tree).

Vertices are integers: GPUs first (id = node * gpus_per_node + local GPU), then NICs
(node * nics_per_node + nic), then switches (group * switches_per_group + switch). Links are directed
(a cable is two links, one per direction) and numbered in blocks, so that the index of any link
follows from a formula (vectorized in numpy; see the `*_link` methods):

    node fabric   GPU i -> GPU j of the same node (full mesh, bandwidth from the system file)
    GPU <-> NIC   each GPU's attachment to the NIC it uses
    NIC <-> switch
    local         switch -> switch of the same group (all-to-all)
    global        between two groups, `global_links_per_pair` cables for every pair of groups
    up, down      a fat tree's cables between levels (topologies.fattree; no local or global links
                  then), and with its "spread" rule one up and one down trunk per block after them

`capacity[link]` is in bytes/s (per direction), `latency[link]` in seconds. The networkx view
(`Network.graph`) is built on first use from the arrays: the routing and flow code never needs it.

Endpoint layout (assumed; the facts do not say it): NIC k of the i-th node of a group sits on
endpoint port k * nodes_per_group + i of the group, ports filling switch 0, 1, ... in order. So a
node's NICs are on different switches and NIC k of consecutive nodes shares a switch. The t-th
global port of a group (t = peer * links_per_pair + j, peers in group order) sits on switch
t mod switches_per_group.
"""

from __future__ import annotations

import pickle
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from topologies import caches
from topologies.fattree import FatTreeShape
from topologies.memo import digest, remember_key
from topologies.system import SystemSpec

if TYPE_CHECKING:
    import networkx as nx


def mod(x, k: int):
    """x % k for integer arrays, by a mask where k is a power of 2 (the same integers, negative ones
    too in two's complement; numpy's % by a scalar is several times slower than &)."""
    return x & (k - 1) if k > 0 and k & (k - 1) == 0 else x % k


def same_block(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """a // k == b // k for integer arrays; where k is a power of 2, by the bits above k's that a and
    b share (a ^ b read unsigned is below k exactly then, negative numbers too: 2-3x faster)."""
    if k > 0 and k & (k - 1) == 0 and a.dtype == b.dtype == np.int64:
        return (a ^ b).view(np.uint64) < k
    return a // k == b // k


GPU_GPU, GPU_NIC, NIC_GPU, NIC_SW, SW_NIC, LOCAL, GLOBAL, UP, DOWN, UP_TRUNK, DOWN_TRUNK, GPU_PORT, PORT_GPU = range(13)
LINK_KINDS = ("gpu-gpu", "gpu-nic", "nic-gpu", "nic-switch", "switch-nic", "local", "global", "up", "down",
              "up-trunk", "down-trunk", "gpu-nvswitch", "nvswitch-gpu")


class Network:
    """Directed links of `groups` dragonfly groups (all nodes in them) of a system.

    Arrays indexed by link: src, dst (vertex ids), kind (see LINK_KINDS), capacity (bytes/s),
    latency (s).
    """

    def __init__(self, system: SystemSpec, groups: int):
        self.system = s = system
        self.groups = groups
        df = s.dragonfly
        self.nodes = min(groups * s.nodes_per_group, s.nodes)
        self.gpn, self.nics_per_node = s.gpus_per_node, s.nics_per_node
        self.n_gpus = self.nodes * self.gpn
        # a fat tree (topologies.fattree): its leaves, spines, ... are the switches, its up and down
        # links follow the NIC links; the dragonfly's blocks are empty (S = E = L = 0)
        self.fattree = FatTreeShape(s.fattree, self.nodes, self.nics_per_node) if s.fattree else None
        self.n_nics = self.nodes * self.nics_per_node if df or self.fattree else 0
        self.S = df.switches_per_group if df else 0
        self.E = df.endpoints_per_switch if df else 0
        self.L = df.global_links_per_pair if df else 0
        self.n_switches = groups * self.S if not self.fattree else self.fattree.n_switches
        self.nic0 = self.n_gpus                  # first NIC vertex
        self.sw0 = self.n_gpus + self.n_nics     # first switch vertex
        self.n_vertices = self.sw0 + self.n_switches
        self.gpu_nic = np.asarray(s.gpu_nic, dtype=np.int64)
        g = self.gpn
        # block bases
        self.b_gpu = 0
        self.b_gn = self.nodes * g * (g - 1)
        self.b_ns = self.b_gn + (2 * self.n_gpus if self.n_nics else 0)
        self.b_loc = self.b_ns + 2 * self.n_nics
        self.b_glob = self.b_loc + groups * self.S * (self.S - 1)
        self.n_pairs = groups * (groups - 1) // 2
        self.b_up = self.b_glob + 2 * self.n_pairs * self.L   # a fat tree's up and down links
        self.n_links = self.b_up + (2 * (self.fattree.n_cables + self.fattree.n_trunks) if self.fattree else 0)
        # a node switch (NVSwitch, `nvswitch_gbs`): each GPU's port out and in, after everything else; a
        # GPU-GPU hop then crosses the sender's port and the receiver's (routing puts them in its place)
        self.ports = s.node_port_bandwidth > 0 and self.gpn > 1
        self.b_port = self.n_links
        self.nvs0 = self.n_vertices              # the node switches' vertices, one per node
        if self.ports:
            self.n_links += 2 * self.n_gpus
            self.n_vertices += self.nodes
        self._build_arrays(ends=False)
        # the arrays follow from the system and the group count: read-only, and keyed by those for
        # the process' memos (topologies.memo.array_key), so that nothing hashes megabytes of links
        spec = digest(pickle.dumps(system), groups)
        for name in ("kind", "capacity", "latency"):
            a = getattr(self, name)
            a.flags.writeable = False
            remember_key(a, digest(spec, name))

    @cached_property
    def src(self) -> np.ndarray:
        """Vertex each link leaves (built on first use: routing and the flow model use the formulas)."""
        self._build_arrays(ends=True)
        return self.__dict__["src"]

    @cached_property
    def dst(self) -> np.ndarray:
        """Vertex each link enters (built with `src`)."""
        self._build_arrays(ends=True)
        return self.__dict__["dst"]

    # -- link index formulas (vectorized) ---------------------------------------------------------
    def gpu_link(self, a, b):
        """Link GPU a -> GPU b (machine-wide GPU ids on the same node)."""
        a, b = np.asarray(a), np.asarray(b)
        la, lb = mod(a, self.gpn), mod(b, self.gpn)
        return self.b_gpu + a * (self.gpn - 1) + lb - (lb > la)   # a = node * gpn + la

    def gpu_to_nic_link(self, gpu):
        return self.b_gn + 2 * np.asarray(gpu)

    def nic_to_gpu_link(self, gpu):
        return self.b_gn + 2 * np.asarray(gpu) + 1

    def nic_of_gpu(self, gpu):
        """NIC index (0-based, not a vertex id) that a GPU uses."""
        gpu = np.asarray(gpu)
        return (gpu // self.gpn) * self.nics_per_node + self.gpu_nic[mod(gpu, self.gpn)]

    @cached_property
    def nic_of_gpus(self) -> np.ndarray:
        """(n_gpus,) nic_of_gpu of every GPU, as a table (one lookup instead of integer divisions)."""
        return self.nic_of_gpu(np.arange(self.n_gpus))

    @cached_property
    def switch_of_gpu(self) -> np.ndarray:
        """(n_gpus,) switch index of the NIC each GPU uses: switch_of_nic(nic_of_gpu(gpu)) as a table."""
        return self.switch_of_nic(self.nic_of_gpus)

    def nic_to_switch_link(self, nic):
        return self.b_ns + 2 * np.asarray(nic)

    def switch_to_nic_link(self, nic):
        return self.b_ns + 2 * np.asarray(nic) + 1

    def switch_of_nic(self, nic):
        """Switch index (0-based) a NIC is cabled to."""
        if self.fattree:
            return self.fattree.leaf(nic)
        nic = np.asarray(nic)
        node, k = nic // self.nics_per_node, mod(nic, self.nics_per_node)
        npg = self.system.nodes_per_group
        grp, i = node // npg, mod(node, npg)
        return grp * self.S + (k * npg + i) // self.E

    def local_link(self, a, b):
        """Link switch a -> switch b (switch indices of the same group, a != b)."""
        a, b = np.asarray(a), np.asarray(b)
        la, lb = mod(a, self.S), mod(b, self.S)
        return self.b_loc + a * (self.S - 1) + lb - (lb > la)

    def global_link(self, g1, g2, j):
        """j-th global link from group g1 to group g2 (g1 != g2)."""
        g1, g2, j = np.asarray(g1), np.asarray(g2), np.asarray(j)
        lo, hi = np.minimum(g1, g2), np.maximum(g1, g2)
        pair = lo * self.groups - lo * (lo + 1) // 2 + (hi - lo - 1)
        return self.b_glob + 2 * (pair * self.L + j) + (g1 > g2)

    def global_switch(self, g, h, j):
        """Switch index in group g that carries g's j-th global link to group h."""
        g, h, j = np.asarray(g), np.asarray(h), np.asarray(j)
        return g * self.S + mod((h - (h > g)) * self.L + j, self.S)

    def through_ports(self, gg):
        """(port out of the sender, port into the receiver) of GPU-GPU links `gg` (node switches)."""
        i = np.asarray(gg, dtype=np.int64) - self.b_gpu
        a, j = i // (self.gpn - 1), i % (self.gpn - 1)
        lb = j + (j >= mod(a, self.gpn))
        b = a - mod(a, self.gpn) + lb
        return self.b_port + 2 * a, self.b_port + 2 * b + 1

    @cached_property
    def endpoint_of_gpus(self) -> np.ndarray:
        """(n_gpus,) fat trees: the leaf port (topologies.fattree endpoint) of the NIC each GPU uses."""
        return self.fattree.endpoint(self.nic_of_gpus)

    @cached_property
    def cable_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The link formulas of switch-to-switch paths as lookup tables (the same integers, fewer numpy
        passes; int32 where every link index fits): (G*G, L) position, inside group g, of the switch
        holding g's cable j to group h, at row g*G + h; (G*G, L) that global link (rows g = h unused);
        (switches*S,) local link from switch a to the switch at position p of a's group, at a*S + p,
        -1 for a itself."""
        G, S, L = self.groups, self.S, max(self.L, 1)
        g, h, j = np.meshgrid(np.arange(G), np.arange(G), np.arange(L), indexing="ij")
        port = self.global_switch(g, h, j) - g * S
        cable = np.where(g != h, self.global_link(g, h, j), -1)
        a, p = np.divmod(np.arange(self.n_switches * S), max(S, 1))
        pos = mod(a, max(S, 1))
        local = np.where(pos != p, self.local_link(a, a - pos + p), -1)
        small = np.int32 if self.n_links < 2**31 else np.int64
        return port.reshape(G * G, L).astype(small), cable.reshape(G * G, L).astype(small), local.astype(small)

    @cached_property
    def cable_landing(self) -> np.ndarray:
        """(G*G*L,) switch index where group g's cable j to group h lands in h, at (g*G + h)*L + j
        (cable_tables' integer type): the switch in h holding h's cable j to g."""
        G, S, L = self.groups, self.S, max(self.L, 1)
        port = self.cable_tables[0].reshape(G, G, L)
        h = np.arange(G, dtype=port.dtype)
        return (port.transpose(1, 0, 2) + (h * S)[None, :, None]).ravel()

    @cached_property
    def cable_tables_by_cable(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """cable_tables' switch positions and global links and cable_landing as (L, G*G) tables:
        cable j of the group pair at row g*G + h is at [j, g*G + h]."""
        G, L = self.groups, max(self.L, 1)
        port, cable, _ = self.cable_tables
        return tuple(np.ascontiguousarray(x.T) for x in (port, cable, self.cable_landing.reshape(G * G, L)))

    # -- arrays ---------------------------------------------------------------------------------
    def _build_arrays(self, ends: bool) -> None:
        """kind, capacity and latency of every link; with `ends`, src and dst instead."""
        s, df, g = self.system, self.system.dragonfly, self.gpn
        n = self.n_links
        if ends:
            src, dst = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        else:
            self.kind = np.empty(n, dtype=np.int8)
            self.capacity = np.empty(n)
            self.latency = np.empty(n)

        def put(base, k, a, b, kind, cap, lat):
            sl = slice(base, base + k)
            if ends:
                src[sl], dst[sl] = a(), b()
            else:
                self.kind[sl], self.capacity[sl], self.latency[sl] = kind, cap, lat

        # node fabric: for each node, every ordered pair (la, lb), la != lb, in formula order
        la, lb = np.nonzero(~np.eye(g, dtype=bool))
        node = np.repeat(np.arange(self.nodes, dtype=np.int64), len(la)) if ends else None
        put(self.b_gpu, self.nodes * len(la), lambda: node * g + np.tile(la, self.nodes),
            lambda: node * g + np.tile(lb, self.nodes), GPU_GPU, np.tile(s.node_links[la, lb], self.nodes),
            s.link_latency)
        if self.fattree is not None:
            self._build_fat_tree(put, ends)
        if self.ports:
            gpu = np.arange(self.n_gpus, dtype=np.int64)
            nvs = self.nvs0 + gpu // g if ends else None
            put(self.b_port, 2 * self.n_gpus, lambda: np.stack([gpu, nvs], 1).ravel(),
                lambda: np.stack([nvs, gpu], 1).ravel(), np.tile([GPU_PORT, PORT_GPU], self.n_gpus),
                s.node_port_bandwidth, s.link_latency / 2)
        if df is not None:
            self._put_nics(put, ends, self.switch_of_nic, df.link_bandwidth, df.nic_latency, df.switch_latency)
            # local: for each switch a, every other switch b of its group, in formula order
            S = self.S
            la, lb = np.nonzero(~np.eye(S, dtype=bool))
            grp = np.repeat(np.arange(self.groups, dtype=np.int64), len(la)) if ends else None
            put(self.b_loc, self.groups * len(la), lambda: self.sw0 + grp * S + np.tile(la, self.groups),
                lambda: self.sw0 + grp * S + np.tile(lb, self.groups), LOCAL, df.link_bandwidth,
                df.switch_latency + df.local_cable_latency)
            if self.n_pairs and self.L:
                lo, hi = np.triu_indices(self.groups, 1)   # pair order matches global_link's formula
                lo, hi = np.repeat(lo, self.L), np.repeat(hi, self.L)
                j = np.tile(np.arange(self.L), self.n_pairs)
                if ends:
                    s_lo, s_hi = self.sw0 + self.global_switch(lo, hi, j), self.sw0 + self.global_switch(hi, lo, j)
                put(self.b_glob, 2 * self.n_pairs * self.L, lambda: np.stack([s_lo, s_hi], 1).ravel(),
                    lambda: np.stack([s_hi, s_lo], 1).ravel(), GLOBAL, df.link_bandwidth,
                    df.switch_latency + df.global_cable_latency)
        if ends:
            src.flags.writeable = dst.flags.writeable = False
            self.__dict__["src"], self.__dict__["dst"] = src, dst

    def _put_nics(self, put, ends: bool, switch_of_nic, switch_rate: float, nic_latency: float,
                  switch_latency: float) -> None:
        """The GPU-NIC links and the NIC-switch links (to the switch `switch_of_nic(nic)`: a dragonfly
        switch or a fat tree's leaf), by `put`; rates bytes/s, latencies s."""
        s = self.system
        gpu = np.arange(self.n_gpus, dtype=np.int64)
        nic_v = self.nic0 + self.nic_of_gpu(gpu) if ends else None
        put(self.b_gn, 2 * self.n_gpus, lambda: np.stack([gpu, nic_v], 1).ravel(),
            lambda: np.stack([nic_v, gpu], 1).ravel(), np.tile([GPU_NIC, NIC_GPU], self.n_gpus),
            s.gpu_nic_bandwidth, s.link_latency)
        nic = np.arange(self.n_nics, dtype=np.int64)
        sw_v = self.sw0 + switch_of_nic(nic) if ends else None
        put(self.b_ns, 2 * self.n_nics, lambda: np.stack([self.nic0 + nic, sw_v], 1).ravel(),
            lambda: np.stack([sw_v, self.nic0 + nic], 1).ravel(), np.tile([NIC_SW, SW_NIC], self.n_nics),
            min(s.nic_bandwidth, switch_rate), np.tile([nic_latency, switch_latency + nic_latency], self.n_nics))

    def _build_fat_tree(self, put, ends: bool) -> None:
        """The GPU-NIC, NIC-leaf, up and down links of a fat tree (topologies.fattree), by `put`."""
        s, ft = self.system, self.fattree
        spec, lv = s.fattree, s.fattree.levels
        self._put_nics(put, ends, ft.leaf, lv[0].link_bandwidth, spec.nic_latency, lv[0].switch_latency)
        for l in range(ft.h - 1):
            n = ft.switches[l] * ft.up[l]
            if not n:
                continue
            if ends:  # cable c of level l: from switch (b, r) up to replica r * up + p of level l+1
                c = np.arange(n, dtype=np.int64)
                b, ra = c // ft.W[l + 1], c % ft.W[l + 1]
                lo = self.sw0 + ft.first[l] + b * ft.W[l] + ra // ft.up[l]
                hi = self.sw0 + ft.first[l + 1] + (b // ft.down[l + 1] if l + 1 < ft.h - 1 else 0) * ft.W[l + 1] + ra
            put(self.b_up + ft.cable_base[l], 2 * n, lambda: np.stack([lo, hi], 1).ravel(),
                lambda: np.stack([hi, lo], 1).ravel(), np.tile([UP, DOWN], n), lv[l + 1].link_bandwidth,
                np.tile([lv[l].switch_latency + spec.cable_latency, lv[l + 1].switch_latency + spec.cable_latency], n))
        for l in range(ft.h - 1):  # "spread": a trunk up and down per block, the rate of the block's cables
            n = ft.trunk_first[l + 1] - ft.trunk_first[l]
            if not n:
                continue
            if ends:  # from the block's first switch to its parent block's first
                b = np.arange(n, dtype=np.int64)
                lo = self.sw0 + ft.first[l] + b * ft.W[l]
                hi = self.sw0 + ft.first[l + 1] + (b // ft.down[l + 1] if l + 1 < ft.h - 1 else 0 * b) * ft.W[l + 1]
            put(self.b_up + 2 * ft.n_cables + 2 * ft.trunk_first[l], 2 * n, lambda: np.stack([lo, hi], 1).ravel(),
                lambda: np.stack([hi, lo], 1).ravel(), np.tile([UP_TRUNK, DOWN_TRUNK], n),
                ft.W[l + 1] * lv[l + 1].link_bandwidth,
                np.tile([lv[l].switch_latency + spec.cable_latency, lv[l + 1].switch_latency + spec.cable_latency], n))

    # -- lookup and views -------------------------------------------------------------------------
    @cached_property
    def _keys(self) -> tuple[np.ndarray, np.ndarray]:
        key = self.src * self.n_vertices + self.dst
        order = np.argsort(key, kind="stable")
        return key[order], order

    def link_index(self, u, v):
        """Index of the link u -> v (vertex ids; arrays allowed). Raises KeyError if there is none.
        With several parallel links (global cables of one switch pair) the first is returned."""
        keys, order = self._keys
        k = np.asarray(u, dtype=np.int64) * self.n_vertices + np.asarray(v, dtype=np.int64)
        pos = np.searchsorted(keys, k)
        ok = (pos < len(keys)) & (keys[np.minimum(pos, len(keys) - 1)] == k)
        if not np.all(ok):
            raise KeyError(f"no link {u} -> {v}")
        return order[pos]

    def vertex_name(self, v: int) -> str:
        """gpu<node>.<local>, nic<node>.<k>, sw<group>.<switch>."""
        if v < self.nic0:
            return f"gpu{v // self.gpn}.{v % self.gpn}"
        if v < self.sw0:
            n = v - self.nic0
            return f"nic{n // self.nics_per_node}.{n % self.nics_per_node}"
        if v >= self.nvs0:
            return f"nvswitch{v - self.nvs0}"
        w = v - self.sw0
        if self.fattree:  # <level name><index in the level>
            ft = self.fattree
            l = int(np.searchsorted(ft.first, w, side="right")) - 1
            return f"{self.system.fattree.levels[l].name}{w - ft.first[l]}"
        return f"sw{w // self.S}.{w % self.S}"

    @cached_property
    def graph(self) -> nx.DiGraph:
        """networkx view: vertices carry `kind` (gpu, nic, switch); each edge carries `link` (its index
        into the arrays), `capacity` (bytes/s) and `latency` (s); `kind` is LINK_KINDS[self.kind[link]].
        Built on first use: the full Frontier takes about 2 s and 400 MB (benchmarks/bench_topology.py),
        so routing and the flow model use the arrays instead. A DiGraph suffices: no two links join the same pair of vertices (the
        cables between two groups sit on distinct switches while global_links_per_pair <= switches)."""
        import networkx as nx  # imported here: the twin's commands never need it (about 0.1 s)

        G = nx.DiGraph(system=self.system.name)
        G.add_nodes_from(range(self.nic0), kind="gpu")
        G.add_nodes_from(range(self.nic0, self.sw0), kind="nic")
        G.add_nodes_from(range(self.sw0, self.n_vertices), kind="switch")
        cap, lat = self.capacity.tolist(), self.latency.tolist()
        real = np.flatnonzero(self.kind < UP_TRUNK)   # a fat tree's trunks are a routing device, not cables
        G.add_edges_from(zip(self.src[real].tolist(), self.dst[real].tolist(),
                             ({"link": i, "capacity": cap[i], "latency": lat[i]} for i in real.tolist())))
        return G

    def switch_graph(self) -> nx.Graph:
        """The dragonfly alone: switches (named sw<group>.<switch>, with `group`) and undirected
        local and global cables (`kind`, `bandwidth` in bytes/s per direction). Small enough to draw."""
        import networkx as nx

        G = nx.Graph(system=self.system.name)
        for v in range(self.sw0, self.n_vertices):
            G.add_node(self.vertex_name(v), group=(v - self.sw0) // max(self.S, 1))
        sel = np.flatnonzero(((self.kind == LOCAL) | (self.kind == GLOBAL) | (self.kind == UP)) & (self.src < self.dst))
        for i in sel.tolist():
            G.add_edge(self.vertex_name(int(self.src[i])), self.vertex_name(int(self.dst[i])),
                       kind=LINK_KINDS[self.kind[i]], bandwidth=float(self.capacity[i]))
        return G

    def summary(self) -> dict:
        counts = np.bincount(self.kind, minlength=len(LINK_KINDS))
        return {"groups": self.groups, "nodes": self.nodes, "gpus": self.n_gpus, "nics": self.n_nics,
                "switches": self.n_switches, "links": self.n_links,
                "links_by_kind": {k: int(c) for k, c in zip(LINK_KINDS, counts)}}


# (id(system), groups) -> (system, its network): the last _CACHE_SIZE networks built (build_network)
_CACHE: dict[tuple[int, int], tuple[SystemSpec, Network]] = caches.register("topologies.network.networks", {})
_CACHE_SIZE = 4


def build_network(system: SystemSpec, nodes: int | None = None) -> Network:
    """The network of the dragonfly groups a job of `nodes` nodes (the first ones, as contiguous
    placement takes them) touches; `nodes=None` builds the whole machine.

    The last few networks are cached by system object (a configuration search builds the same one
    for every grid it probes); treat a Network as read-only."""
    if nodes is None or system.dragonfly is None:
        groups = system.groups
    else:
        groups = min(system.groups, max(1, -(-int(nodes) // system.nodes_per_group)))
    key = (id(system), groups)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is system:
        return hit[1]
    net = Network(system, groups)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (system, net)
    return net
