"""What the collectives of the expert axes cost (twin/program/moe.py): the all-to-alls of an MoE block
over the expert group, and the all-reduces over the expert group or the edata group, as flows on the
network. `CollectiveModel.time` (twin/costs/collectives.py) hands the axes "expert" and "edata" here.

All-to-all over groups of p = E_p ranks, every group of the job at once (as the engine takes every
group of an axis to run together): a rank's send buffer of `nbytes` holds p equal blocks; it keeps
one and sends one to each other member, so every ordered pair (i, j), i != j, of every group is a flow
of nbytes / p bytes, all at once (NCCL and RCCL post every send and receive of an all-to-all together).
A flow inside a node takes the node's GPU links; across nodes it leaves through its own GPU's NIC and
enters through the destination's, capped at one channel's share of the NIC as a ring's channel is, and
travels as `spread` sub-flows under adaptive routing, routed on the job's placement (so whether the
members share a node, a switch or a dragonfly group, and the global links between groups, decide
the rates). The rates are max-min fair over all those flows (twin.costs.flows), and

    time = step latency + the largest path latency + the time until the last flow of nbytes / p ends,

the flows' rates max-min fair among those still running, worked out again whenever some complete
(flows inside a node often finish first, and those across nodes then speed up: `seconds_per_byte`).
Where the flows are alike (one node's symmetric links, one flow per NIC) that is (nbytes / p) / their
rate. The all-to-all is timed alone: flows of other axes in flight at
the same time do not slow it (the expert group's collectives run on the data stream, which is idle
during the blocks' passes but for them).

Where the profile carries measured collectives (a CPU profile), those are read instead
(`measured_time`). All-reduce over the expert or edata groups: a flat ring over each group's members, laid out as the
collective model lays out a ring (its channels and caps), every group at once:
2 (p - 1) steps of max(floor, alpha + chunk / bus rate).
"""

from __future__ import annotations

import numpy as np

from topologies.routing import Routes, route
from twin.costs.flows import max_min_rates

EXPERT_AXES = ("expert", "edata")


def expert_gpus(cm, axis: str) -> np.ndarray:
    """(groups, p) machine-wide GPU ids of every group of `axis` ("expert" or "edata"), in group order."""
    return cm.placement.gpu[np.asarray(cm.grid.groups(axis), dtype=np.int64)]


def _store(cm) -> dict:
    s = cm.__dict__.get("_expert_times")
    if s is None:
        s = cm.__dict__["_expert_times"] = {}
    return s


def pair_flows(cm, gpus: np.ndarray):
    """(routes, parent, caps, n_flows) of every ordered pair of every row of `gpus`, as the module
    docstring lays them out."""
    R, p = gpus.shape
    i, j = np.nonzero(~np.eye(p, dtype=bool))
    src, dst = gpus[:, i].ravel(), gpus[:, j].ravel()
    gpn = cm.system.gpus_per_node
    cross = src // gpn != dst // gpn
    spread = np.where(cross, cm.spread, 1)
    parent = np.repeat(np.arange(len(src)), spread)
    cap = np.where(cross, cm.channel_cap, np.inf) / spread
    caps = np.repeat(cap, spread)
    s, d = np.repeat(src, spread), np.repeat(dst, spread)
    demand = np.minimum(caps, cm.system.nic_bandwidth / np.repeat(spread, spread))
    routes = route(cm.net, s, d, s, d, mode=cm.routing, seed=cm.seed, demand=demand)
    return routes, parent, caps, len(src)


def _path_latency(routes, latency: np.ndarray) -> float:
    """The largest sum of link latencies over the routes' paths (s; 0 if none)."""
    if not len(routes.links):
        return 0.0
    return float(np.add.reduceat(latency[routes.links], routes.ptr[:-1][np.diff(routes.ptr) > 0]).max())


MAX_ROUNDS = 32  # rounds of completions followed; the flows left then finish at their rates of that round


def _subset(routes: Routes, mask: np.ndarray) -> Routes:
    """The routes of the flows where `mask` is set, in order (CSR rows gathered)."""
    lens = np.diff(routes.ptr)
    sel = np.flatnonzero(mask)
    n = lens[sel]
    ptr = np.zeros(len(sel) + 1, dtype=np.int64)
    np.cumsum(n, out=ptr[1:])
    idx = np.repeat(routes.ptr[:-1][sel] - ptr[:-1], n) + np.arange(ptr[-1], dtype=np.int64)
    return Routes(ptr, routes.links[idx])


def seconds_per_byte(cm, routes: Routes, parent: np.ndarray, caps: np.ndarray, n: int) -> float:
    """Seconds until the last of n equal flows (each of one byte, carried by its sub-flows: `parent`)
    completes, the rates max-min fair among the flows still running and worked out again each time
    some complete. Flows of equal size finish in the same order whatever their size, so the time of
    a transfer of c bytes per flow is c times this."""
    remaining = np.ones(n)
    active = np.ones(n, dtype=bool)
    t = 0.0
    for _ in range(MAX_ROUNDS):
        sub = active[parent]
        part = routes if sub.all() else _subset(routes, sub)
        rates = max_min_rates(part, cm.capacity, caps[sub])
        flow = np.bincount(parent[sub], weights=rates, minlength=n)
        run = np.flatnonzero(active)
        step = float((remaining[run] / flow[run]).min())
        t += step
        remaining[run] -= step * flow[run]
        active[run[remaining[run] <= 1e-9]] = False
        if not active.any():
            return t
    run = np.flatnonzero(active)
    return t + float((remaining[run] / flow[run]).max())


def all_to_all_rate(cm, axis: str = "expert") -> tuple[float, float]:
    """(latency s, effective rate bytes/s: one flow's bytes over the time until the last flow ends) of
    an all-to-all over every group of `axis` at once."""
    store = _store(cm)
    key = ("a2a", axis)
    hit = store.get(key)
    if hit is None:
        gpus = expert_gpus(cm, axis)
        routes, parent, caps, n = pair_flows(cm, gpus)
        latency = cm.system.collectives.step_latency + _path_latency(routes, cm.net.latency)
        hit = store[key] = (latency, 1.0 / seconds_per_byte(cm, routes, parent, caps, n))
    return hit


def all_to_all_time(cm, nbytes: float, axis: str = "expert") -> float:
    """Seconds of an all-to-all of a `nbytes` send buffer per rank over every group of `axis`."""
    p = cm.grid.axis_size(axis)
    if p == 1 or nbytes <= 0:
        return 0.0
    latency, rate = all_to_all_rate(cm, axis)
    return latency + nbytes / p / rate


def _ring(cm, axis: str) -> tuple[float, float, float]:
    """(bus rate bytes/s, alpha s, floor s) of one step of flat rings over every group of `axis`."""
    store = _store(cm)
    key = ("ring", axis)
    hit = store.get(key)
    if hit is None:
        gpus = expert_gpus(cm, axis)
        flows = cm._ring_flows(gpus)
        rate = flows.slowest(max_min_rates(flows.routes, cm.capacity, flows.caps))
        alpha = cm.system.collectives.step_latency + flows.path_latency(cm.net.latency)
        node = gpus // cm.system.gpus_per_node
        c = cm.system.collectives
        floor = c.inter_node_step_floor + c.step_floor_per_rank * gpus.shape[1] \
            if bool((node != node[:, :1]).any()) else 0.0
        hit = store[key] = (rate, alpha, floor)
    return hit


def ring_time(cm, kind: str, axis: str, nbytes: float) -> float:
    """Seconds of a ring all-reduce (or all-gather, reduce-scatter) of `nbytes` over every group of `axis`."""
    p = cm.grid.axis_size(axis)
    if p == 1 or nbytes <= 0:
        return 0.0
    rate, alpha, floor = _ring(cm, axis)
    steps = (2 if kind == "all_reduce" else 1) * (p - 1)
    return steps * max(floor, alpha + nbytes / p / rate)


def laid_out(cm, kind: str, axis: str) -> bool:
    """Whether `expert_time` of this kind and axis routes nothing on `cm` (its flows are laid out and
    rated already, or a measured table answers): lower bounds use the exact time only then."""
    store = cm.__dict__.get("_expert_times") or {}
    return cm.measured is not None or (("a2a" if kind == "all_to_all" else "ring"), axis) in store


def expert_time(cm, kind: str, axis: str, nbytes: float) -> float:
    """Seconds of collective `kind` of `nbytes` over the expert axis `axis` (memoised on `cm`)."""
    store = _store(cm)
    key = (kind, axis, nbytes)
    t = store.get(key)
    if t is None:
        t = measured_time(cm, kind, axis, nbytes)
        if t is None:
            t = all_to_all_time(cm, nbytes, axis) if kind == "all_to_all" else ring_time(cm, kind, axis, nbytes)
        store[key] = t
    return t


def measured_time(cm, kind: str, axis: str, nbytes: float) -> float | None:
    """Where the profile has measured collectives (cm.measured, a CPU profile's): an all-to-all as
    measured inside training (`twin calibrate` of MoE runs), else read as the measured all-gather of
    its group size and stride (the same bytes leave each rank) of a tensor axis (it blocks the op after
    it); an edata all-reduce by its own line inside training where recorded steps gave one (it runs
    on a process group of its own, beside the data all-reduces it leaves with: on gloo most of its
    spans end with the data one before them), else as a data-axis all-reduce (it leaves with the
    others at the end of the step); None where nothing applies (docs/moe-backend.md)."""
    if cm.measured is None:
        return None
    p = cm.grid.axis_size(axis)
    if p == 1 or nbytes <= 0:
        return 0.0
    where = "data" if axis == "edata" and not cm.measured.trained(kind, axis, p) else axis
    t = cm.measured.time(kind, where, p, nbytes, cm.grid.stride(axis))
    if t is None and kind == "all_to_all":  # not measured: the all-gather of its group size and stride
        t = cm.measured.time("all_gather", where, p, nbytes, cm.grid.stride(axis))
    return t
