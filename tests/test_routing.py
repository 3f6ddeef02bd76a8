"""Routes pinned to what routing computed at c4ff7fb (before this session's speed work): a checksum of
`Routes.ptr` and `Routes.links` (values, dtypes, shapes) for cases that reach every branch of
`topologies.routing` and `topologies.adaptive` (minimal, Valiant, adaptive with one or many demands,
flows inside a node, to themselves, through another GPU's NIC, inside one switch or group, two groups
only) and for the rings of Frontier's data axis. Faster routing must never mean other routes: a change
here is a model change and says so."""

import hashlib

import numpy as np

from topologies import caches
from topologies.network import Network, build_network
from topologies.routing import route
from topologies.system import load_system


def _cases():
    """(name, network, kwargs of route) covering every branch of routing."""
    rng = np.random.default_rng(2026)
    frontier, alps, perl = (build_network(load_system(n)) for n in ("frontier", "alps", "perlmutter"))
    two = Network(load_system("frontier"), 2)
    out = []
    for name, net in (("frontier", frontier), ("alps", alps), ("perlmutter", perl), ("frontier-2", two)):
        n = 6000
        src = rng.integers(0, net.n_gpus, n)
        dst = rng.integers(0, net.n_gpus, n)
        dst[:600] = src[:600] - src[:600] % net.gpn + rng.integers(0, net.gpn, 600)   # same node
        dst[600:700] = src[600:700]                                                     # to itself
        near = (src[700:1500] // net.gpn + rng.integers(0, 3, 800)) % (net.n_gpus // net.gpn)   # nearby nodes
        dst[700:1500] = near * net.gpn + dst[700:1500] % net.gpn
        sv = np.where(rng.random(n) < 0.3, src - src % net.gpn + rng.integers(0, net.gpn, n), src)
        dv = np.where(rng.random(n) < 0.3, dst - dst % net.gpn + rng.integers(0, net.gpn, n), dst)
        for mode in ("minimal", "nonminimal", "adaptive"):   # through other GPUs' NICs too
            out.append((f"{name}-{mode}", net,
                        dict(src=src, dst=dst, src_nic_gpu=sv, dst_nic_gpu=dv, mode=mode, seed=3)))
        demands = rng.choice([1.25e9, 3e9, 0.7e9], n)
        out.append((f"{name}-adaptive-demands", net, dict(src=src, dst=dst, mode="adaptive", seed=5, demand=demands)))
        out.append((f"{name}-adaptive-one-demand", net, dict(src=src, dst=dst, mode="adaptive", seed=7, demand=1.1e9)))
    # rings of Frontier's data axis as 2x32x64x8 places them (stride 4,096 GCDs, 8 per ring), 4 sub-flows each
    g = np.arange(32768).reshape(8, 4096).T
    src, dst = np.repeat(g.ravel(), 4), np.repeat(np.roll(g, -1, axis=1).ravel(), 4)
    out.append(("frontier-data-rings", frontier, dict(src=src, dst=dst, mode="adaptive", seed=0, demand=1.25e9)))
    out.append(("frontier-data-rings-minimal", frontier, dict(src=src, dst=dst, mode="minimal")))
    # rings inside nodes only: every flow on the node fabric, then some to themselves too
    src = np.arange(32768)
    dst = src - src % 8 + (src + 1) % 8
    out.append(("frontier-node-rings", frontier, dict(src=src, dst=dst, mode="adaptive", seed=0, demand=2.5e10)))
    out.append(("frontier-node-rings-and-self", frontier, dict(src=src, dst=np.where(src % 5 == 0, src, dst))))
    return out


def _checksum(r) -> str:
    h = hashlib.blake2b(digest_size=8)
    for a in (r.ptr, r.links):
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


PINNED = {  # computed at c4ff7fb by this file's cases
    "frontier-minimal": "6acfe19a980e3ae9",
    "frontier-nonminimal": "bd863be7dd077f55",
    "frontier-adaptive": "459bdac429787807",
    "frontier-adaptive-demands": "47afd3a5894e3a58",
    "frontier-adaptive-one-demand": "f46871a8794473e5",
    "alps-minimal": "70f01107d462af7e",
    "alps-nonminimal": "eff4a509ead32dfb",
    "alps-adaptive": "5dbd7ba71cdeb313",
    "alps-adaptive-demands": "67f67a6de44950d3",
    "alps-adaptive-one-demand": "93b82e3b887048cb",
    "perlmutter-minimal": "4f45c1312520a3df",
    "perlmutter-nonminimal": "e02209b7e903889f",
    "perlmutter-adaptive": "c5839d30a3b5638a",
    "perlmutter-adaptive-demands": "a23b8ba1f68a1920",
    "perlmutter-adaptive-one-demand": "6f4750b7cd311623",
    "frontier-2-minimal": "841a557ce395efee",
    "frontier-2-nonminimal": "017dcbd8d0951a1d",
    "frontier-2-adaptive": "e71242631a20c265",
    "frontier-2-adaptive-demands": "664fe584dd9b61dd",
    "frontier-2-adaptive-one-demand": "8567210b24836140",
    "frontier-data-rings": "636d2699ec316c86",
    "frontier-data-rings-minimal": "81c50e35a90d26ea",
    "frontier-node-rings": "11a337c9405843d2",
    "frontier-node-rings-and-self": "8a2ab1b12bc085b9",
}


def test_routes_are_those_computed_before_the_speed_work(fresh_caches):
    got = {}
    for name, net, kw in _cases():
        caches.clear()   # computed, not handed back from the memo of routes
        got[name] = _checksum(route(net, **kw))
    assert got == PINNED


def test_cumsum_adds_in_turn_as_loads_accumulate():
    """Adaptive routing looks a link's load up by how many flows cross it: the k-th entry of a cumsum
    of one demand must be that demand added k times in turn (as np.add.at placed it), not a pairwise sum."""
    for demand in (0.7e9, 1 / 3, 1.1e9, 5e9 / 3, 1.25e9 / 7):
        held, turn = np.cumsum(np.full(5000, demand)), 0.0
        for k in range(5000):
            turn += demand
            assert held[k] == turn
