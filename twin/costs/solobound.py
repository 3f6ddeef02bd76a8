"""A lower bound on the time of a collective with no other axis running, found without routing.

`CollectiveModel.time(kind, axis, nbytes)` (twin.costs.collectives) routes every ring of the axis over the
whole machine and solves max-min rates: most of what a grid search costs. `SoloBound(model).time`
bounds it from below from what no routing choice changes, so the search can rule a grid out before
routing its axes (twin.predict.bounds.quick_bound):

- Rate. A ring's bus rate is the smallest, over its flows, of weight x flow rate (twin.costs.collectives).
  A flow's rate is at most its cap (a channel's cross-node cap: the sum of its sub-flows' caps). And
  every path of a flow crosses the same links at its ends: the direct GPU-GPU link of a flow inside
  a node; the node-fabric link to the GPU whose NIC it leaves by, that GPU's GPU-NIC link and its
  NIC-switch link, and the same at the arrival. The flows F crossing such a link L share its
  capacity c: sum of their rates <= c, so min over F of w_f r_f <= c / sum over F of 1/w_f.
  The bound is the smallest of these over flows and links (times 1 + 1e-9 against rounding).
- Latency per step. The system's step latency plus the largest, over flows, of the latencies of those
  same links, plus the quickest switch-to-switch link where the two NICs sit on different switches
  (the quickest global link where they are in different groups).

`time` then follows `CollectiveModel.time` term by term (the ring, the hierarchical ring, the tree for
all-reduces; measured tables as they are), each term monotone in these figures, so it is a lower
bound whatever adaptive routing chooses. On Frontier's axes the rate bound equals the routed rate
except where rings cross dragonfly groups (global links; the data axes of gpt-320b on 32,768 GCDs:
5.0 GB/s against 4.0-4.5), and the latency bound is within 15 %.
"""

from __future__ import annotations


import numpy as np

from topologies import caches
from topologies.network import GLOBAL, LOCAL
from twin.costs.collectives import phase_floor, ring_phases_time, tree_time

RATE_ROUNDING = 1 + 1e-9  # the rate bound is raised by this much, so that float rounding keeps it above the routed rate


def phase_bounds(model, rings: np.ndarray) -> tuple[float, float]:
    """(upper bound on the bus rate in bytes/s, lower bound on the step latency alpha in s) of flat
    rings over the rows of `rings` (machine-wide GPU ids) on `model`'s machine, all rings at once."""
    net, gpn = model.net, model.system.gpus_per_node
    # Only the rings through the first node they use: any subset of the flows gives a bound (on a
    # link, a subset's rates sum to at most its capacity too; a max over fewer flows is smaller), and
    # these are exact where the rings repeat node by node (contiguous placement: the rings through
    # one node fill its NICs as the rings through any other node fill theirs).
    node = rings // gpn
    rings = rings[(node == node.min()).any(axis=1)]
    src, dst, sv, dv, _, weight, cap = model._ring_channels(rings)
    w = np.asarray(weight, dtype=float)
    n = len(src)
    cross = (src // gpn) != (dst // gpn)
    links, flows = [], []

    def add(rows, link) -> None:
        links.append(np.asarray(link, dtype=np.int64))
        flows.append(rows)

    inside = np.flatnonzero(~cross & (src != dst))
    add(inside, net.gpu_link(src[inside], dst[inside]))
    x = np.flatnonzero(cross)
    if len(x):
        s, t, a, b = src[x], dst[x], sv[x], dv[x]
        nic_a, nic_b = net.nic_of_gpu(a), net.nic_of_gpu(b)
        hop = a != s
        add(x[hop], net.gpu_link(s[hop], a[hop]))
        add(x, net.gpu_to_nic_link(a))
        add(x, net.nic_to_switch_link(nic_a))
        add(x, net.switch_to_nic_link(nic_b))
        add(x, net.nic_to_gpu_link(b))
        hop = b != t
        add(x[hop], net.gpu_link(b[hop], t[hop]))
    link, flow = np.concatenate(links), np.concatenate(flows)
    used, on = np.unique(link, return_inverse=True)  # the links used (a machine has ~1e6: no array that long)
    share = np.bincount(on, weights=1.0 / w[flow])
    rate = min(float((w * np.asarray(cap, dtype=float)).min()), float((model.capacity[used] / share).min()))
    lat = np.bincount(flow, weights=net.latency[link], minlength=n)
    if len(x) and net.S:
        sa, sb = net.switch_of_nic(nic_a), net.switch_of_nic(nic_b)
        hop, global_hop = _quickest_hops(net)
        far = sa // net.S != sb // net.S  # another group: a global link at least; another switch: a hop at least
        lat[x[far]] += global_hop
        lat[x[(sa != sb) & ~far]] += hop
    alpha = model.system.collectives.step_latency + (float(lat.max()) if n else 0.0)
    return rate * RATE_ROUNDING, alpha


# id(net) -> (net, quickest switch-to-switch hop, quickest global hop) (_quickest_hops), per network
HOPS: dict[int, tuple] = caches.register("twin.costs.solobound.hops", {})


def _quickest_hops(net) -> tuple[float, float]:
    """(quickest switch-to-switch link, quickest global link) of a network: latencies in s."""
    hit = HOPS.get(id(net))
    if hit is None or hit[0] is not net:
        lat = net.latency
        hit = HOPS[id(net)] = (net, float(lat[(net.kind == LOCAL) | (net.kind == GLOBAL)].min(initial=np.inf)),
                                float(lat[net.kind == GLOBAL].min(initial=np.inf)))
    return hit[1], hit[2]


class SoloBound:
    """`time(kind, axis, nbytes, concurrent)`: a lower bound (seconds) on `model.time(kind, axis,
    nbytes)` (a CollectiveModel, no other axis running; `concurrent` is ignored). `cache` keeps the
    figures of each phase's rings, keyed by `key` (what else the model depends on: system, placement)
    and the rings' size and stride, which fix the rings on a placement of a given GPU count."""

    def __init__(self, model, cache: dict | None = None, key=None):
        self.model, self.key = model, key
        self.cache = {} if cache is None else cache
        self._times: dict[tuple, float] = {}
        self._figures: dict[tuple[str, str], tuple] = {}

    def _phases(self, axis: str, algorithm: str) -> tuple[list[float], list[float], list[int], list[float]]:
        """(rate bounds, alpha bounds, ring sizes, least step times) of each phase of an axis' collective."""
        hit = self._figures.get((axis, algorithm))
        if hit is None:
            m = self.model
            used = m._algorithm(axis, algorithm)
            key = (self.key, m.grid.size, m.grid.axis_size(axis), m.grid.stride(axis), used)
            hit = self.cache.get(key)
            if hit is None:
                phases = m._phase_gpus(axis, used)
                figures = [phase_bounds(m, rings) for rings in phases]
                hit = self.cache[key] = ([f[0] for f in figures], [f[1] for f in figures],
                                         [r.shape[1] for r in phases], [phase_floor(m.system, r) for r in phases])
            self._figures[axis, algorithm] = hit
        return hit

    def _ring_time(self, kind: str, axis: str, nbytes: float, algorithm: str) -> float:
        return ring_phases_time(kind, nbytes, *self._phases(axis, algorithm))

    def time(self, kind: str, axis: str, nbytes: int, concurrent: frozenset = frozenset()) -> float:
        key = (kind, axis, nbytes)
        t = self._times.get(key)
        if t is None:
            t = self._times[key] = self._time(kind, axis, nbytes)
        return t

    def _time(self, kind: str, axis: str, nbytes: int) -> float:
        m = self.model
        if axis in ("expert", "edata"):  # an MoE block's collectives (twin/costs/alltoall.py): 0 bounds them
            return 0.0
        p = m.grid.axis_size(axis)
        if p == 1 or nbytes <= 0:
            return 0.0
        if m.measured is not None:
            t = m.measured.time(kind, axis, p, nbytes, m.grid.stride(axis))
            if t is not None:
                return t
        t = self._ring_time(kind, axis, nbytes, m.algorithm)
        if kind == "all_reduce" and "all_reduce" not in m.system.collectives.ring_only:
            if self._phases(axis, "hierarchical")[2] != self._phases(axis, "ring")[2]:  # a hierarchical ring
                t = min(t, self._ring_time(kind, axis, nbytes, "hierarchical"))
            rates, alphas, _, floors = self._phases(axis, m.algorithm)
            t = min(t, tree_time(nbytes, p, min(rates), max(alphas), max(floors)))
        return t
