"""Collective algorithms as phases of point-to-point flows, timed on the flow network model.

A ring collective over p ranks runs p-1 steps (all-gather, reduce-scatter) or 2(p-1) steps
(all-reduce = reduce-scatter + all-gather); in each step every member sends one chunk to its ring
successor, so one step is a set of concurrent flows, the same in every step. Its time is therefore

    time = steps * max(floor, alpha + chunk / bus_rate)

with chunk = payload / p, the bytes each rank sends per step (steps * chunk = (p-1)/p * payload, x2
for all-reduce), and bus_rate the rate of the slowest member's step ("bus bandwidth" in NCCL's
terms). `floor` is the least time of a step that leaves the node (the system's
`inter_node_step_floor`, plus `step_floor_per_rank` per ring member; 0 inside a node): measured
rings on Frontier and Perlmutter take a nearly constant time per step over a range of small shards
before the time grows with the shard (docs/fidelity.md). We compute bus_rate once per
(axis, set of concurrently running axes) by max-min fairness over the flows of one step of EVERY
group of those axes (they contend for NICs and global links), and derive every payload size from it:
the steady-state model, exact for rings whose steps all look alike (NCCL pipelines a ring, so its
throughput is that of its slowest hop). It is pessimistic in two ways: the slowest group of the
axis sets the time, though in reality it speeds up once faster groups finish and free links; and
concurrent axes are taken to overlap for the whole duration. alpha = the software latency per step (system
file) + the largest path latency of the step's flows (sum of link latencies).

How the library lays a ring on the machine (NCCL/RCCL behaviour, as the measured table shows):
- a ring inside one node runs over the direct GPU-GPU links, which reach `intra_node_efficiency` of
  their rate, in both directions (two channels, each half the data) or in one
  (`node_ring_directions`: AxoNN's table fits 2, the 2025 RCCL measurements 1);
- a ring across nodes with m members per node runs m channels; channel c crosses from one node to
  the next through the NIC of the c-th member on each node (reached over the node fabric), and one
  channel reaches at most `inter_node_channel_efficiency` x the NIC rate. Node-internal hops of all
  channels are one flow (their channels share the direct link anyway).
- `inter_node_cap="nic"` reads the measured cross-node rate the other way the tables allow: as a cap
  per NIC (the efficiency x the GPUs behind a NIC, of its rate, shared by the channels through it)
  instead of per channel. Both reproduce the tables, where all GPUs of a node run one axis at once;
  they differ when axes overlap or a NIC carries one channel (docs/fidelity.md; a sensitivity
  alternative).
- with adaptive (or non-minimal) routing, each node-crossing flow travels as `spread` (4) sub-flows
  routed on their own, as Slingshot spreads a flow's packets over paths; the flow's rate is their
  sum (each sub-flow capped at 1/spread of the channel cap, so a sub-flow on a free path cannot take
  over what a congested sibling leaves: a slight underestimate). With one path per flow, unlucky
  choices leave a few flows far slower than packets would be (gpt-40b's data axis on 4,096
  Perlmutter GPUs, where rings cross 8 groups: 8.3 GB/s per channel with 1 path, 12.5 with 2, 16.7
  with 4, against a 20 GB/s channel cap; 4 costs about 2x the time of 2). Adaptive and non-minimal
  routing may use every group of the machine, so the whole machine's network is built (the rest
  of the machine is taken to be idle).
- `algorithm="hierarchical"` instead runs a ring inside each node, then m rings across nodes (one per
  local position, each over its own NIC, 1/m of the data). The phases are pipelined chunk by chunk,
  as NCCL's tree and RCCL's hierarchical algorithms stream their intra- and inter-node stages: the
  transfer takes as long as the slowest phase, the latencies of all phases add up. (Run one phase
  after the other, this model gave 99.6 GB/s of bus bandwidth for Alps' measured 2-node all-reduce at
  128 MiB, below the 122.6 GB/s measured and the 100 GB/s a flat ring over 4 NICs can reach; see
  tests/test_collectives.py.) The phases' rates are computed apart (they use mostly disjoint links).
- all-reduce may use a tree (double binary tree: 2 log2(p) steps, each rank sends the buffer twice)
  when that is faster, as NCCL's tuner does for small buffers; all-gather and reduce-scatter are
  ring-only (system file).

A step's routed flows, and what max-min asks of them, are twin.costs.flowsets' (flow sets kept per process).
"""

from __future__ import annotations

import math

import numpy as np

from topologies import caches
from topologies.network import GPU_GPU, NIC_SW, SW_NIC, build_network
from topologies.placement import place
from topologies.memo import array_key, digest, remember_key
from topologies.routing import MODES, Routes, network_key, route
from topologies.system import SystemSpec
from topologies.common import TwinError
from twin.costs.alltoall import EXPERT_AXES, expert_time
from twin.costs.flows import max_min_rates
from twin.costs.flowsets import FLOWS, FlowSet, link_counts, sharing_links
from twin.program.grid import AXES, Grid

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
ALGORITHMS = ("ring", "hierarchical")


def collective_timer(program, model):
    """collective_s(op index, concurrent axes) -> seconds, from `model.time` (which caches its answers):
    it depends on the op only through its (kind, axis, bytes) (the engine's by_size)."""
    ops = program.ops

    def timer(i: int, concurrent: frozenset) -> float:
        op = ops[i]
        return float(model.time(op.kind, op.axis, op.bytes, concurrent=concurrent))

    return timer


def ring_phases_time(kind: str, nbytes: float, rates, alphas, sizes, floors=None) -> float:
    """Seconds of a ring collective of `nbytes` run as phases of rings (one phase for a flat ring;
    inner then across-node for a hierarchical one): phase i has rings of sizes[i] members, bus rate
    rates[i] (bytes/s), per-step latency alphas[i] (s) and least time per step floors[i] (s; none
    by default). A step of phase i takes max(floors[i], alphas[i] + chunk / rates[i]), the chunk
    being 1/sizes[i] of the phase's data. An all-reduce makes two passes."""
    mult = 2.0 if kind == "all_reduce" else 1.0
    latency, transfer, data = 0.0, 0.0, float(nbytes)
    for i, (rate, alpha, q) in enumerate(zip(rates, alphas, sizes)):
        latency += mult * (q - 1) * alpha
        # a step never takes less than the floor: its transfer part is at least floor - alpha
        if floors is not None and floors[i] - alpha > data / q / rate:
            phase = mult * (q - 1) * (floors[i] - alpha)
        else:
            phase = mult * (q - 1) / q * data / rate
        # phases are pipelined chunk by chunk (the library's tree/hierarchical algorithms stream
        # the inner and outer stages concurrently): the slowest phase's transfer sets the pace
        transfer = max(transfer, phase)
        data /= q  # the next (across-node) phase carries 1/q of the data per ring
    return latency + transfer


def tree_time(nbytes: float, p: int, rate: float, alpha: float, floor: float = 0.0) -> float:
    """Seconds of an all-reduce of `nbytes` as a double binary tree over p ranks: 2 ceil(log2 p)
    steps of latency `alpha` (s, each at least `floor`), the buffer sent twice at `rate` (bytes/s)."""
    return 2 * math.ceil(math.log2(p)) * max(alpha, floor) + 2.0 * nbytes / rate


def phase_floor(system: SystemSpec, rings: np.ndarray) -> float:
    """The least time of one step (s) of flat rings over the rows of `rings` (machine-wide GPU ids):
    where a ring leaves its node, the system's `inter_node_step_floor` plus `step_floor_per_rank` for
    each member of the ring; else none."""
    node = rings // system.gpus_per_node
    if not bool((node != node[:, :1]).any()):
        return 0.0
    c = system.collectives
    return c.inter_node_step_floor + c.step_floor_per_rank * rings.shape[1]


# (id(net), inter_node_cap) -> (net, link capacities as collectives see them, channel cap): the last 8
_CAPACITY: dict[tuple, tuple] = caches.register("twin.costs.collectives.capacity", {})


def _link_capacity(net, system: SystemSpec, inter_node_cap: str) -> tuple[np.ndarray, float]:
    """(capacity of every link as collectives see it, bytes/s; one channel's cross-node cap, bytes/s).
    Kept per network (build_network caches networks per system object), so that every model of a
    search shares one capacity array and the max-min memo keys it by identity, not by content.
    Treat the array as read-only."""
    key = (id(net), inter_node_cap)
    hit = _CAPACITY.get(key)
    if hit is not None and hit[0] is net:
        return hit[1], hit[2]
    cap = net.capacity.copy()  # masks multiply in place (`where`): no gather and scatter of half a million links
    np.multiply(cap, system.collectives.intra_node_efficiency, out=cap, where=net.kind == GPU_GPU)
    channel_cap = system.collectives.inter_node_channel_efficiency * system.nic_bandwidth
    if inter_node_cap == "nic":  # the cap moves from each channel onto the NIC its channels share
        per_nic = min(1.0, channel_cap * system.gpus_per_node / system.nics_per_node / system.nic_bandwidth)
        np.multiply(cap, per_nic, out=cap, where=(net.kind == NIC_SW) | (net.kind == SW_NIC))
        channel_cap = system.nic_bandwidth
    cap.flags.writeable = False
    c = system.collectives
    remember_key(cap, digest(network_key(net), "collectives", inter_node_cap, c.intra_node_efficiency,
                             c.inter_node_channel_efficiency, system.nic_bandwidth, system.gpus_per_node,
                             system.nics_per_node))
    if len(_CAPACITY) >= 8:
        _CAPACITY.pop(next(iter(_CAPACITY)))
    _CAPACITY[key] = (net, cap, channel_cap)
    return cap, channel_cap


class CollectiveModel:
    """Times of collectives on a system for a grid, all groups of an axis running together.

    system: the machine; grid: the 4D grid; placement: "contiguous" or "scattered" (seed);
    routing: "minimal", "nonminimal" or "adaptive" (Slingshot's default); algorithm: "ring" (library
    behaviour) or "hierarchical"; spread: sub-flows per node-crossing flow when routing is not minimal.
    Results are cached: build one model per simulation and call `time` as often as needed.
    measured: a table of measured collective times (twin.costs.profile_types.CollectiveTable, from `twin
    calibrate`); where it has the kind and group size, its time replaces the flow model's.
    contention: whether axes whose collectives run at once share links (max-min fairness over all
    their flows; the default) or each is timed as if it ran alone (a sensitivity alternative: no
    measurement covers several groups sharing a node's NICs).
    """

    def __init__(self, system: SystemSpec, grid: Grid, placement: str = "contiguous", seed: int = 0,
                 routing: str = "adaptive", algorithm: str = "ring", spread: int = 4, measured=None,
                 inter_node_cap: str = "channel", contention: bool = True):
        if routing not in MODES:
            raise TwinError(f"unknown routing {routing!r}: choose one of {', '.join(MODES)}")
        if not isinstance(spread, int) or spread < 1:
            raise TwinError(f"spread must be a positive integer, got {spread!r}")
        if inter_node_cap not in ("channel", "nic"):
            raise TwinError(f"unknown inter-node cap {inter_node_cap!r}: choose channel or nic")
        if algorithm not in ALGORITHMS:
            raise TwinError(f"unknown collective algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        self.system, self.grid, self.routing, self.algorithm = system, grid, routing, algorithm
        self.placement = place(system, grid.size, placement, seed)
        nodes = None if placement == "scattered" or routing != "minimal" else int(self.placement.nodes.max()) + 1
        self.net = build_network(system, nodes)
        self.capacity, self.channel_cap = _link_capacity(self.net, system, inter_node_cap)
        self.seed = seed
        self.measured = measured
        self.contention = contention
        self.spread = 1 if routing == "minimal" else spread
        self._flows: dict[tuple, tuple] = {}
        self._flat: dict[str, bool] = {}  # per axis: is a hierarchical ring the flat ring?
        self._rates: dict[tuple, dict[str, list[float]]] = {}
        self._times: dict[tuple, float] = {}

    # -- flows of one step ------------------------------------------------------------------------
    def _axis_gpus(self, axis: str) -> np.ndarray:
        """(groups, p) machine-wide GPU ids of every group of `axis`, members in axis order."""
        g = self.grid
        r = np.arange(g.size).reshape(g.data, g.z, g.y, g.x)
        r = np.moveaxis(r, 3 - AXES.index(axis), -1).reshape(-1, g.axis_size(axis))
        return self.placement.gpu[r]

    def _flows_key(self, gpus: np.ndarray) -> bytes:
        return digest(network_key(self.net), self.routing, self.seed, self.spread, self.channel_cap,
                      self.system.nic_bandwidth, self.system.gpus_per_node,
                      self.system.collectives.node_ring_directions, gpus)

    def _ring_flows(self, gpus: np.ndarray) -> FlowSet:
        """Flows of one step of flat rings over the rows of `gpus` (rings, q), laid out in channels
        as the library does (see the module docstring). Kept for the process (FLOWS), keyed by what
        they depend on: a probe grid's rings are often an axis of a simulated grid."""
        key = self._flows_key(gpus)
        hit = FLOWS.get(key)
        if hit is None:
            hit = self._build_ring_flows(gpus, key)
            FLOWS.put(key, hit)
        return hit

    def _ring_channels(self, gpus: np.ndarray) -> list[np.ndarray]:
        """The flows of one step of flat rings over the rows of `gpus`, before routing, as columns:
        source GPU, destination GPU, the GPUs whose NICs the flow leaves and enters by, ring (row),
        weight (channels per ring where the flow carries all of them) and cap (bytes/s)."""
        R, q = gpus.shape
        g = gpus.ravel()                                # member i of ring r at r*q + i
        nxt = np.roll(gpus, -1, axis=1).ravel()         # its successor
        node = g // self.system.gpus_per_node
        cross = node != nxt // self.system.gpus_per_node  # hop i -> i+1 leaves the node
        # runs of consecutive members on one node (a run never spans two rings)
        new_run = np.empty(R * q, dtype=bool)
        new_run[1:] = node[1:] != node[:-1]
        new_run[::q] = True
        run0 = np.flatnonzero(new_run)                  # each run's first member
        first = np.flatnonzero(run0 % q == 0)           # each ring's first run
        single = np.diff(first, append=len(run0)) == 1
        both = q > 2 and self.system.collectives.node_ring_directions == 2
        K = np.where(single, 2 if both else 1,          # channels per ring: its shortest run
                     np.minimum.reduceat(np.diff(run0, append=R * q), first))
        hop = np.flatnonzero(~cross)                    # node-internal hops: one flow each
        rid = hop // q
        src, dst, ring, weight = [g[hop]], [nxt[hop]], [rid], [np.where(single[rid], K[rid], 1)]
        if both:                                        # single-node rings may run both directions
            back = single[rid]
            hop, rid = hop[back], rid[back]
            src.append(nxt[hop]), dst.append(g[hop]), ring.append(rid), weight.append(K[rid])
        n_in = sum(len(x) for x in src)
        src_nic, dst_nic = list(src), list(dst)
        hop = np.flatnonzero(cross)  # node-crossing hops: K channels through the c-th members' NICs
        if len(hop):
            rid = hop // q
            start = run0[np.searchsorted(run0, hop, side="right") - 1]  # the first member of the hop's run
            to = np.where((hop + 1) % q == 0, hop + 1 - q, hop + 1)     # the next member: a run's first
            # channel c of every hop whose ring has more than c channels, channel by channel
            c, h = np.nonzero(np.arange(int(K[rid].max()))[:, None] < K[rid])
            src.append(g[hop[h]]), dst.append(g[to[h]]), ring.append(rid[h]), weight.append(K[rid[h]])
            src_nic.append(g[start[h] + c]), dst_nic.append(g[to[h] + c])
        cols = [np.concatenate(x) for x in (src, dst, src_nic, dst_nic, ring, weight)]
        cap = np.full(len(cols[0]), self.channel_cap, dtype=float)
        cap[:n_in] = np.inf
        return cols + [cap]

    def _build_ring_flows(self, gpus: np.ndarray, key: bytes | None = None) -> FlowSet:
        cols = self._ring_channels(gpus)
        # node-crossing flows travel as `spread` sub-flows, each routed on its own (adaptive routing
        # moves packets, not whole flows; one path per flow would leave hash collisions that packets avoid)
        spread = np.where((cols[0] // self.system.gpus_per_node)
                          != cols[1] // self.system.gpus_per_node, self.spread, 1)
        parent = np.repeat(np.arange(len(spread)), spread)
        sub = [np.repeat(c, spread) for c in cols[:4]]
        caps = np.repeat(cols[6].astype(float) / spread, spread)
        demand = np.minimum(caps, self.system.nic_bandwidth / np.repeat(spread, spread))
        # `key` determines every argument: routing need not hash the arrays
        routes = route(self.net, *sub, mode=self.routing, seed=self.seed, demand=demand, key=key)
        return FlowSet(routes, parent, cols[4].astype(np.int64), cols[5].astype(float), caps, len(gpus))

    def _algorithm(self, axis: str, algorithm: str) -> str:
        """`algorithm`, or "ring" where a hierarchical ring would be the flat ring (1 or all members per node)."""
        if algorithm == "hierarchical":
            flat = self._flat.get(axis)
            if flat is None:  # asked for every collective time: worked out once per axis
                node = self._axis_gpus(axis) // self.system.gpus_per_node
                m, p = int((node == node[:, :1]).sum(1).min()), node.shape[1]
                flat = self._flat[axis] = m == 1 or m == p or p % m != 0
            if flat:
                return "ring"
        return algorithm

    def _phase_gpus(self, axis: str, algorithm: str) -> list[np.ndarray]:
        """The rings (rows of GPU ids) of each phase of an axis' collective with `algorithm`."""
        gpus = self._axis_gpus(axis)
        if algorithm == "ring":
            return [gpus]
        # hierarchical: rings of the m members of a node, then m rings across nodes
        node = gpus // self.system.gpus_per_node
        m, p = int((node == node[:, :1]).sum(1).min()), gpus.shape[1]
        local = gpus.reshape(-1, p // m, m)
        return [local.reshape(-1, m), np.swapaxes(local, 1, 2).reshape(-1, p // m)]

    def _phases(self, axis: str, algorithm: str) -> tuple[list[FlowSet], list[float], list[int], list[float]]:
        """(flow sets, alpha per step in s, ring size, least time per step in s) of each phase of an axis' collective: one phase
        (flat ring) or two (hierarchical: rings inside nodes, then m rings across nodes)."""
        key = (axis, algorithm)
        if key not in self._flows:
            phases = self._phase_gpus(axis, algorithm)
            flows = [self._ring_flows(g) for g in phases]
            alphas = [self.system.collectives.step_latency + f.path_latency(self.net.latency) for f in flows]
            self._flows[key] = (flows, alphas, [g.shape[1] for g in phases],
                                [phase_floor(self.system, g) for g in phases])
        return self._flows[key]

    def routed(self, axis: str) -> bool:
        """Whether asking `time` about `axis` alone routes nothing: the flow sets of every phase of
        the axis' collectives (flat and hierarchical rings) are laid out already in this process."""
        for algorithm in {self._algorithm(axis, self.algorithm), self._algorithm(axis, "hierarchical")}:
            if (axis, algorithm) not in self._flows and \
                    any(self._flows_key(g) not in FLOWS.items for g in self._phase_gpus(axis, algorithm)):
                return False
        return True

    def _bus_rates(self, axes: frozenset, algorithm: str) -> dict[str, list[float]]:
        """Per axis in `axes`, the bus rate (bytes/s) of each phase when all those axes run together
        with `algorithm`. Phase k of an axis overlaps the others' phase min(k, last).

        Axes whose flows share no link with the others' (rings inside nodes against rings whose
        members each use their own NIC, say) are separate max-min problems: their rates are those
        of each group alone (progressive filling never looks across a link that no flow shares;
        twin.costs.flows), so each group is asked on its own and the memo answers what was asked before."""
        key = (axes, algorithm)
        if key not in self._rates:
            sets = {a: self._phases(a, self._algorithm(a, algorithm))[0] for a in sorted(axes)}
            out: dict[str, list[float]] = {a: [] for a in sets}
            for k in range(max(len(v) for v in sets.values())):
                allf = [v[min(k, len(v) - 1)] for v in sets.values()]
                rates: list = [None] * len(allf)
                for group in sharing_links(allf, self.net.n_links):
                    fs = [allf[i] for i in group]
                    keys = [f.routes.key for f in fs]
                    # the routes' key (Routes.concat's, from the flow sets' keys) determines the caps
                    # too; the flows are laid out together only if the memo does not have the rates
                    qkey = None if None in keys else keys[0] if len(keys) == 1 else digest(*keys)
                    r = max_min_rates(lambda: Routes.concat([f.routes for f in fs]), self.capacity,
                                      lambda: np.concatenate([f.caps for f in fs]), key=qkey,
                                      link_counts=lambda: link_counts(fs, self.net.n_links))
                    rkey = None if qkey is None else digest(qkey, array_key(self.capacity))
                    off = 0
                    for i, f in zip(group, fs):
                        rates[i] = (r[off:off + len(f.routes)], None if rkey is None else digest(rkey, off))
                        off += len(f.routes)
                for (a, v), f, r in zip(sets.items(), allf, rates):
                    if k < len(v):
                        out[a].append(f.slowest(*r))
            self._rates[key] = out
        return self._rates[key]

    def _ring_time(self, kind: str, axis: str, nbytes: float, axes: frozenset, algorithm: str) -> float:
        algorithm = self._algorithm(axis, algorithm)
        rates = self._bus_rates(axes, algorithm)[axis]
        _, alphas, sizes, floors = self._phases(axis, algorithm)
        return ring_phases_time(kind, nbytes, rates, alphas, sizes, floors)

    def _sharing(self, axis: str, concurrent: frozenset) -> frozenset:
        """The axes whose flows share links with `axis`' while `concurrent` run too."""
        if not self.contention:
            return frozenset({axis})
        return frozenset({axis} | {a for a in concurrent if a in AXES and self.grid.axis_size(a) > 1})

    # -- public API -------------------------------------------------------------------------------
    def time(self, kind: str, axis: str, nbytes: int, concurrent: frozenset[str] = frozenset()) -> float:
        """Seconds for collective `kind` with payload `nbytes` (bytes; as twin.program.program.Op.bytes) over
        every group of `axis` at once, while the axes in `concurrent` run collectives too.

        All-gather and reduce-scatter use the model's algorithm (the library's ring by default); an
        all-reduce, unless the system file makes it ring-only, takes the fastest of that, the
        hierarchical ring and a tree (2 ceil(log2 p) steps, the buffer sent twice at the ring's rate),
        as NCCL's tuner picks among ring and tree by size."""
        if axis in EXPERT_AXES:  # an MoE block's all-to-alls, the experts' gradients (twin/costs/alltoall.py)
            return expert_time(self, kind, axis, nbytes)
        key = (kind, axis, nbytes, concurrent)
        t = self._times.get(key)
        if t is not None:
            return t
        if kind not in KINDS:
            raise TwinError(f"unknown collective {kind!r}: choose one of {', '.join(KINDS)}")
        if axis not in AXES:
            raise TwinError(f"unknown axis {axis!r}: choose one of {', '.join(AXES)}")
        p = self.grid.axis_size(axis)
        if p == 1 or nbytes <= 0:
            self._times[key] = 0.0
            return 0.0
        if self.measured is not None:  # measured on this machine (twin/profiles): use it
            t = self.measured.time(kind, axis, p, nbytes, self.grid.stride(axis))
            if t is not None:
                self._times[key] = t
                return t
        axes = self._sharing(axis, concurrent)
        t = self._ring_time(kind, axis, nbytes, axes, self.algorithm)
        if kind == "all_reduce" and "all_reduce" not in self.system.collectives.ring_only:
            if self._algorithm(axis, "hierarchical") == "hierarchical":
                t = min(t, self._ring_time(kind, axis, nbytes, axes, "hierarchical"))
            algorithm = self._algorithm(axis, self.algorithm)
            rates = self._bus_rates(axes, algorithm)[axis]
            _, alphas, _, floors = self._phases(axis, algorithm)
            t = min(t, tree_time(nbytes, p, min(rates), max(alphas), max(floors)))
        self._times[key] = t
        return t

    def effective_bandwidth(self, axis: str, concurrent: frozenset[str] = frozenset()) -> float:
        """Ring bus bandwidth (bytes/s) an axis' groups get, all of them running at once: the
        bytes each rank sends divided by the time, for a large all-gather (latency excluded)."""
        p = self.grid.axis_size(axis) if axis in AXES else 0
        if p == 1:
            return math.inf
        if axis not in AXES:
            raise TwinError(f"unknown axis {axis!r}: choose one of {', '.join(AXES)}")
        axes = self._sharing(axis, concurrent)
        algorithm = self._algorithm(axis, self.algorithm)
        rates = self._bus_rates(axes, algorithm)[axis]
        sizes = self._phases(axis, algorithm)[2]
        t, data = 0.0, 1.0   # time per byte of payload: the slowest of the pipelined phases
        for rate, q in zip(rates, sizes):
            t = max(t, (q - 1) / q * data / rate)
            data /= q
        return (p - 1) / p / t
