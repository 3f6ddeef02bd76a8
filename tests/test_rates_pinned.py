"""Max-min rates and collective times pinned to the bit: a checksum of what the flow model computed at
c4ff7fb (before twin.costs.flows and the flow sets of twin.costs.collectives were made faster) for problems that take
every path of twin.costs.flows (the all-capped shortcut, the first round's split with mixed links, later rounds,
renumbering). Faster must never mean different: a change that moves one bit fails here. Frontier and
Perlmutter take their "axonn-table" collective figures, the figures of c4ff7fb."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from topologies.routing import Routes
from topologies.system import load_system
from twin.costs.collectives import CollectiveModel
from twin.costs.flows import _max_min, max_min_rates
from twin.program.grid import AXES, Grid

PINNED = {
    ("frontier:axonn-table", (2, 32, 64, 8)): "83c86c0b9fa4992d1d8bae6f3d225fdc",
    ("frontier:axonn-table", (2, 8, 16, 32)): "765306a45b893c1d020e6f4d41bbf036",
    ("perlmutter:axonn-table", (4, 2, 8, 8)): "c2e1937c65582291df22153b216040d3",
    ("alps", (4, 4, 4, 4)): "6c9de92528f53cdf9fd988fe0f991182",
}


def rates_digest(name: str, dims: tuple[int, int, int, int]) -> str:
    """blake2b of every max-min rate (all flows of each set of concurrent axes together, and per group of
    axes sharing links) and every collective time of a few sizes, for each axis set and algorithm."""
    grid = Grid(*dims)
    cm = CollectiveModel(load_system(name), grid)
    h = hashlib.blake2b(digest_size=16)
    axes = frozenset(a for a in AXES if grid.axis_size(a) > 1)
    subsets = [frozenset({a}) for a in sorted(axes)] + [axes, axes - {"y"}, axes - {"z"}, frozenset({"x", "data"})]
    for sub in subsets:
        for algorithm in ("ring", "hierarchical"):
            sets = {a: cm._phases(a, cm._algorithm(a, algorithm))[0] for a in sorted(sub)}
            for k in range(max(len(v) for v in sets.values())):
                allf = [v[min(k, len(v) - 1)] for v in sets.values()]
                routes = Routes.concat([f.routes for f in allf])
                caps = np.concatenate([f.caps for f in allf])
                h.update(_max_min(routes.ptr, routes.links, cm.capacity, caps, 1e-9).tobytes())
                h.update(max_min_rates(routes, cm.capacity, caps).tobytes())
            h.update(np.array([r for a in sorted(sub) for r in cm._bus_rates(sub, algorithm)[a]]).tobytes())
        for a in sorted(sub):
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                for nbytes in (1 << 10, 3 << 20, 1 << 30):
                    h.update(np.float64(cm.time(kind, a, nbytes, sub - {a})).tobytes())
            h.update(np.float64(cm.effective_bandwidth(a, sub - {a})).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("name, dims", list(PINNED))
def test_rates_are_the_pinned_ones(name, dims):
    assert rates_digest(name, dims) == PINNED[name, dims]


if __name__ == "__main__":  # print the digests (to pin them at a known-good commit)
    for name, dims in PINNED:
        print(f"    ({name!r}, {dims}): {rates_digest(name, dims)!r},")
