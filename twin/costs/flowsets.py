"""The flows of one step of a set of rings, as max-min sees them (twin.costs.collectives lays them out).

A `FlowSet` holds the routed (sub-)flows of one ring step and turns their max-min rates into each
ring's bus rate; it keeps per set what every max-min question asks of it again (the links its flows
cross and how many cross each, its largest path latency, its slowest ring's rate per question).
`sharing_links` splits concurrent flow sets into groups that share no link (separate max-min
problems), `link_counts` adds the sets' link counts up for one problem, and FLOWS keeps the flow
sets laid out in this process.
"""

from __future__ import annotations

import math

import numpy as np

from topologies import caches
from topologies.memo import Memo, array_key
from topologies.routing import Routes


class FlowSet:
    """Flows of one step of a set of rings, with how to turn flow rates into each ring's bus rate.
    A flow may be carried by several sub-flows (`parent` maps sub-flow -> flow) on different paths."""

    def __init__(self, routes: Routes, parent: np.ndarray, ring: np.ndarray, weight: np.ndarray,
                 caps: np.ndarray, n_rings: int):
        self.routes, self.parent, self.ring, self.weight = routes, parent, ring, weight
        self.caps, self.n_rings = caps, n_rings
        self._counts = None
        self._latency: dict[bytes, float] = {}
        self._slowest: dict[bytes, float] = {}

    @property
    def nbytes(self) -> int:
        return self.routes.nbytes + sum(a.nbytes for a in (self.parent, self.ring, self.weight, self.caps))

    def link_counts(self, n_links: int) -> tuple[np.ndarray, np.ndarray]:
        """(the links any of these flows cross, sorted; how many of the flows cross each of them),
        n_links: the network's link count. Worked out once per flow set: max-min asks for them
        every time the set is rated, alone or beside others."""
        if self._counts is None:
            per_link = np.bincount(self.routes.links, minlength=n_links)
            used = np.flatnonzero(per_link > 0)
            count = per_link[used]
            used.flags.writeable = count.flags.writeable = False   # shared by every problem of the set
            self._counts = (used, count)
        return self._counts

    def links_used(self, n_links: int) -> np.ndarray:
        """The links any of these flows cross (sorted; n_links: the network's link count)."""
        return self.link_counts(n_links)[0]

    def path_latency(self, latency: np.ndarray) -> float:
        """The largest sum of link latencies (s) over these flows' paths (0 if none), given every
        link's latency (s); kept per latency array, as flow sets are shared between models."""
        key = array_key(latency)
        hit = self._latency.get(key)
        if hit is None:
            r, hit = self.routes, 0.0
            if len(r.links):
                hit = float(np.add.reduceat(latency[r.links], r.ptr[:-1][np.diff(r.ptr) > 0]).max())
            self._latency[key] = hit
        return hit

    def slowest(self, rates: np.ndarray, key: bytes | None = None) -> float:
        """The smallest bus rate of these rings (bytes/s; bus_rates(rates).min(), without the
        per-ring minima: a min is the same taken in any grouping). `key`, a digest that determines
        `rates` (the max-min question's), keeps the answer: the models of a search ask again."""
        hit = self._slowest.get(key) if key is not None else None
        if hit is None:
            hit = math.inf
            if len(self.ring):
                flow_rate = np.bincount(self.parent, weights=rates, minlength=len(self.ring))
                hit = float((self.weight * flow_rate).min())
            if key is not None:
                self._slowest[key] = hit
        return hit

    def bus_rates(self, rates: np.ndarray) -> np.ndarray:
        """Bus rate of each ring (bytes/s): min over its flows of weight x rate (sum of sub-flows)."""
        flow_rate = np.bincount(self.parent, weights=rates, minlength=len(self.ring))
        out = np.full(self.n_rings, np.inf)
        np.minimum.at(out, self.ring, self.weight * flow_rate)
        return out


# flow sets' route keys -> their groups that share no link (a search asks again): the last 1,024
_SHARING: dict[tuple, list[list[int]]] = caches.register("twin.costs.flowsets.sharing", {})


def sharing_links(sets: list["FlowSet"], n_links: int) -> list[list[int]]:
    """The flow sets split into groups that share no link with each other (indices, in order)."""
    key = tuple(f.routes.key for f in sets)
    hit = _SHARING.get(key) if None not in key else None
    if hit is None:
        hit = _split_sharing(sets, n_links)
        if None not in key:
            if len(_SHARING) >= 1024:
                _SHARING.pop(next(iter(_SHARING)))
            _SHARING[key] = hit
    return hit


def _split_sharing(sets: list["FlowSet"], n_links: int) -> list[list[int]]:
    group = list(range(len(sets)))
    for i in range(len(sets)):
        mask = np.zeros(n_links, dtype=bool)
        mask[sets[i].links_used(n_links)] = True
        for j in range(i + 1, len(sets)):
            if group[j] != group[i] and mask[sets[j].links_used(n_links)].any():
                old = group[j]
                group = [group[i] if g == old else g for g in group]
    return [[i for i in range(len(sets)) if group[i] == g] for g in dict.fromkeys(group)]


def link_counts(sets: list["FlowSet"], n_links: int) -> tuple[np.ndarray, np.ndarray]:
    """(the links the flow sets' flows cross, sorted; how many flows cross each) of the flow sets
    together, as twin.costs.flows.max_min_rates takes them (from each set's counts: no pass over the entries)."""
    if len(sets) == 1:
        return sets[0].link_counts(n_links)
    per_link = np.zeros(n_links, dtype=np.int32)  # (half the fresh memory of int64: counts are small)
    for f in sets:
        used, count = f.link_counts(n_links)
        per_link[used] += count
    used = np.flatnonzero(per_link > 0)
    return used, per_link[used]


# flow sets of rings already laid out in this process, by their routes' key: at most 256 MiB
FLOWS = caches.register("twin.costs.flowsets.flows", Memo(256 * 2**20, lambda f: f.nbytes))
