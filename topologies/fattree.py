"""Fat trees (folded Clos networks) as data: the `[fattree]` table of a system file, its shape, and
its routing by ECMP.

A fat tree has `levels` of switches, bottom (leaf) to top (core). Each level but the top splits its
`radix` ports into down ports and up ports in the ratio `oversubscription` (down : up; 1 is a
non-blocking tree); the top level points all its ports down. Links are built as an extended
generalized fat tree (XGFT; Ohring et al., 1995): a switch of level l has `up[l]` parents and
`down[l+1]` children at the level above it, so the switches of level l that serve one block of
endpoints are `W[l] = up[0] x ... x up[l-1]` replicas of each other. The tree is built as large as
the machine needs: the blocks under the top level ("pods", `down[0] x ... x down[top-1]` NIC ports
each) are as many as the NICs fill, and every top switch has one link to every pod (so the top
radix bounds the pods).

Endpoints. Every NIC has one port on a leaf. Not rail-optimized, a node's NICs take consecutive
leaf ports (NIC k of node n on port n x nics + k). Rail-optimized (NVIDIA's DGX SuperPOD design),
NIC k of every node is on rail k: the pods of rail k hold NIC k of consecutive nodes and nothing
else, so traffic between GPUs of the same local index on two nodes stays in its rail's leaves and
spines, and only traffic between rails climbs to the top level.

Routing (ECMP). Between two leaves the shortest paths climb to the lowest level whose block holds
both ends (their nearest common ancestors) and come straight down: `W[that level]` equal-cost paths,
one per replica reached at the top of the climb, which also fixes the way down. Which one a flow
takes is the file's `ecmp`:
- "destination": the up port at level l is (destination endpoint // W[l]) mod up[l], the
  destination-mod-k rule of InfiniBand's static fat-tree routing (OpenSM's ftree and up/down
  engines fill each switch's table by destination this way): flows to different NICs of one leaf
  leave a source leaf on different up-links, so shifts and rings do not collide;
- "hash": a deterministic hash of (source endpoint, destination endpoint), as Ethernet ECMP hashes
  a flow's addresses: flows collide on an up-link as chance has it;
- "spread": every flow split evenly over all its equal-cost paths, as adaptive routing or packet
  spraying spreads a flow's packets (InfiniBand switches' adaptive routing, which NCCL's
  NCCL_IB_AR_THRESHOLD is there to use). Split evenly, the flows leaving a block of level l load
  each of its up-links alike, so the block's up-links act as one "trunk" link of their summed rate
  (and likewise its down-links): a spread flow's path is the trunks of the blocks it climbs out of
  and down into. The trunks are extra links of the network (kinds "up-trunk", "down-trunk"),
  routed on instead of the cables; a fluid model, exact for an even split.
With "destination" and "hash" a flow takes one path; contention is the flow model's max-min
fairness on the links, as on the dragonfly. The routing modes of topologies.routing (minimal, non-minimal, adaptive)
are the dragonfly's: a fat tree routes every mode by its ECMP rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from topologies.common import InputError

ECMP_RULES = ("destination", "hash", "spread")
MAX_PARTS = 20_000_000  # switches and cables a tree may have (Selene: 1,040 and 12,800)


@dataclass(frozen=True)
class LevelSpec:
    """One level of switches. `link_bandwidth` is the rate (bytes/s per direction) of the links that
    come up into this level (at the leaf: the NIC cables); `switch_latency` (s) is paid on every
    link that leaves a switch of this level."""

    name: str
    radix: int             # ports per switch
    down: int              # ports facing down (children)
    up: int                # ports facing up (parents); 0 at the top
    link_bandwidth: float  # bytes/s per direction
    switch_latency: float  # s


@dataclass(frozen=True)
class FatTreeSpec:
    """A fat tree's levels (leaf first), its endpoint layout and ECMP rule, and latencies (s)."""

    levels: tuple[LevelSpec, ...]
    rail_optimized: bool
    ecmp: str
    nic_latency: float     # s per NIC injection or ejection
    cable_latency: float   # s per switch-to-switch cable


def parse_fat_tree(t: dict, w: str, nodes: int, nics: int) -> FatTreeSpec:
    """The [fattree] table of a system file (already checked by the schema for types and ranges),
    with the relations between its keys checked; InputError naming the level and the fix otherwise."""
    levels = []
    raw = t["levels"]
    for i, lv in enumerate(raw):
        name, radix = lv["name"], int(lv["radix"])
        top = i == len(raw) - 1
        where = f"{w} level {name!r}"
        if top:
            if "oversubscription" in lv:
                raise InputError(f"system file {where}: the top level (the last [[fattree.levels]]) has no up-links, "
                                 "so no oversubscription: remove the key, or add the level above it")
            down, up = radix, 0
        else:
            if "oversubscription" not in lv:
                raise InputError(f"system file {where}: oversubscription is missing: give down ports : up ports "
                                 "(1 for a non-blocking tree)")
            o = float(lv["oversubscription"])
            down = radix * o / (1 + o)
            if abs(down - round(down)) > 1e-9 or round(down) in (0, radix):
                raise InputError(f"system file {where}: {radix} ports do not split into whole down and up ports "
                                 f"at oversubscription {o:g} (down = radix x o / (1 + o) = {down:g}); choose a "
                                 "radix or ratio that divides")
            down = int(round(down))
            up = radix - down
        levels.append(LevelSpec(name, radix, down, up, float(lv["link_bandwidth"]), float(lv["switch_latency"])))
    names = [lv.name for lv in levels]
    if len(set(names)) != len(names):
        raise InputError(f"system file {w}: two levels share a name ({', '.join(names)}): name each level once")
    spec = FatTreeSpec(tuple(levels), bool(t.get("rail_optimized", False)), str(t.get("ecmp", "destination")),
                       float(t["nic_latency"]), float(t["cable_latency"]))
    if nodes * nics > 0:
        shape = FatTreeShape(spec, nodes, nics)
        top = levels[-1]
        if shape.pods > top.radix:
            what = "NICs" if len(levels) == 1 else f"pods of {shape.pod_size} NIC ports"
            raise InputError(f"system file {w}: {nodes} nodes x {nics} NICs need {shape.pods} {what} "
                             f"but a {top.name} switch has {top.radix} ports: add a level or use a larger radix")
        if shape.n_switches + shape.n_cables > MAX_PARTS:  # pods are built whole: a huge pod for a few NICs
            raise InputError(f"system file {w}: the tree would have {shape.n_switches:,} switches and "
                             f"{shape.n_cables:,} cables for {nodes * nics:,} NICs (pods of {shape.pod_size:,} "
                             "NIC ports are built whole): use fewer levels or a smaller radix")
    return spec


class FatTreeShape:
    """The integers of a fat tree built for `nodes` nodes of `nics` NICs each (module docstring).

    Level l (0 = leaf): `blocks[l]` blocks of `span[l]` endpoints, each served by `W[l]` switches;
    switch (block b, replica r) of level l has index `first[l] + b * W[l] + r` among the switches.
    Its up port p leads to switch (b // down[l+1], r * up[l] + p) of level l+1 (block 0 at the top),
    as cable number `b * W[l+1] + r * up[l] + p` of level l: directed links `2 * cable` (up) and
    `2 * cable + 1` (down) after the level's base `cable_base[l]`, relative to the network's block."""

    def __init__(self, spec: FatTreeSpec, nodes: int, nics: int):
        self.spec, self.nodes, self.nics = spec, nodes, nics
        lv = spec.levels
        self.h = h = len(lv)
        self.down = [x.down for x in lv]
        self.up = [x.up for x in lv]
        self.pod_size = math.prod(self.down[:h - 1])
        if spec.rail_optimized:
            self.pods_per_rail = -(-nodes // self.pod_size)
            self.pods = nics * self.pods_per_rail
        else:
            self.pods_per_rail = 0
            self.pods = -(-(nodes * nics) // self.pod_size)
        self.endpoints = self.pods * self.pod_size
        self.W = [math.prod(self.up[:l]) for l in range(h)]
        self.span = [math.prod(self.down[:l + 1]) for l in range(h - 1)] + [self.endpoints]
        self.blocks = [self.endpoints // s for s in self.span]
        self.switches = [b * w for b, w in zip(self.blocks, self.W)]
        self.first = np.concatenate([[0], np.cumsum(self.switches)]).astype(np.int64).tolist()
        cables = [self.switches[l] * self.up[l] for l in range(h)]   # up-links leaving level l
        self.cable_base = np.concatenate([[0], 2 * np.cumsum(cables)]).astype(np.int64).tolist()
        self.n_switches = int(sum(self.switches))
        self.n_cables = int(sum(cables))
        # "spread": one up and one down trunk per block below the top (module docstring), after the cables
        self.spread = spec.ecmp == "spread"
        trunks = [self.blocks[l] if l < h - 1 and self.spread else 0 for l in range(h)]
        self.trunk_first = np.concatenate([[0], np.cumsum(trunks)]).astype(np.int64).tolist()
        self.n_trunks = int(sum(trunks))

    def endpoint(self, nic):
        """Leaf port index (0..endpoints-1) of NIC indices (node * nics + k); vectorized."""
        nic = np.asarray(nic, dtype=np.int64)
        if not self.spec.rail_optimized:
            return nic
        node, k = nic // self.nics, nic % self.nics
        return (k * self.pods_per_rail + node // self.pod_size) * self.pod_size + node % self.pod_size

    def leaf(self, nic):
        """Leaf switch index of NIC indices (a leaf has one replica: its index is its block)."""
        return self.endpoint(nic) // self.down[0]

    def cable(self, level: int, block, replica_above):
        """Cable of level `level` from block `block`'s switch to the switch of replica `replica_above`
        at level + 1 (the replica fixes both ends): its index within the level (0-based)."""
        return np.asarray(block, dtype=np.int64) * self.W[level + 1] + replica_above

    def nca_level(self, ea, eb) -> np.ndarray:
        """Lowest level whose block holds both endpoints (0: the same leaf)."""
        ea, eb = np.asarray(ea, dtype=np.int64), np.asarray(eb, dtype=np.int64)
        lvl = np.full(ea.shape, self.h - 1, dtype=np.int64)
        for l in range(self.h - 2, -1, -1):
            lvl[ea // self.span[l] == eb // self.span[l]] = l
        return lvl

    def top_replica(self, ea, eb, lvl) -> np.ndarray:
        """The replica reached at the top of each flow's climb (level `lvl`), by the ECMP rule."""
        ea, eb = np.asarray(ea, dtype=np.int64), np.asarray(eb, dtype=np.int64)
        WL = np.asarray(self.W, dtype=np.int64)[lvl]
        if self.spec.ecmp == "hash":
            return (_mix(ea * 1_000_003 + eb) % WL.astype(np.uint64)).astype(np.int64)
        r = np.zeros(ea.shape, dtype=np.int64)
        for l in range(self.h - 1):  # destination-mod-k: the up port at level l from the destination
            on = l < lvl
            r = np.where(on, r * self.up[l] + (eb // self.W[l]) % self.up[l], r)
        return r

    def paths(self, ea, eb, replica=None) -> np.ndarray:
        """(flows, 2 (h-1)) switch-to-switch links (relative to the up/down block; -1 = no hop) from
        the leaf of endpoint ea to that of eb: the climb level 0, 1, ..., then the way down. The
        replica reached at the top of the climb is the ECMP rule's unless `replica` is given; with
        the "spread" rule (and no `replica`) the links are the blocks' trunks."""
        ea, eb = np.asarray(ea, dtype=np.int64), np.asarray(eb, dtype=np.int64)
        lvl = self.nca_level(ea, eb)
        if self.spread and replica is None:
            return self.trunk_paths(ea, eb, lvl)
        r = self.top_replica(ea, eb, lvl) if replica is None else np.broadcast_to(np.asarray(replica), ea.shape)
        h = self.h
        out = np.full((len(ea), max(2 * (h - 1), 0)), -1, dtype=np.int64)
        WL = np.asarray(self.W, dtype=np.int64)[lvl]
        for l in range(h - 1):
            on = l < lvl
            if not on.any():
                continue
            above = r[on] // (WL[on] // self.W[l + 1])   # replica of the level l+1 switch on the path
            base = self.cable_base[l]
            out[on, l] = base + 2 * self.cable(l, ea[on] // self.span[l], above)
            out[on, 2 * (h - 1) - 1 - l] = base + 2 * self.cable(l, eb[on] // self.span[l], above) + 1
        return out

    def trunk_paths(self, ea, eb, lvl) -> np.ndarray:
        """`paths` of the "spread" rule: up trunk 2 t and down trunk 2 t + 1 of block t (numbered by
        level, then block), after the cables' 2 n_cables links."""
        h = self.h
        out = np.full((len(ea), max(2 * (h - 1), 0)), -1, dtype=np.int64)
        base = 2 * self.n_cables
        for l in range(h - 1):
            on = l < lvl
            out[on, l] = base + 2 * (self.trunk_first[l] + ea[on] // self.span[l])
            out[on, 2 * (h - 1) - 1 - l] = base + 2 * (self.trunk_first[l] + eb[on] // self.span[l]) + 1
        return out

    def path_count(self, ea, eb) -> np.ndarray:
        """Equal-cost paths between the leaves of two endpoints."""
        return np.asarray(self.W, dtype=np.int64)[self.nca_level(ea, eb)]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on int64s, as uint64 (a fixed, well-spread hash)."""
    z = np.asarray(x, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
