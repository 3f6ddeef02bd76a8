"""Time and memory to build a whole machine's network and to route flows on it.

    python benchmarks/bench_topology.py [--system frontier] [--flows 32768] [--graph]

Prints: build time and peak traced memory of the link arrays for the whole machine (tracemalloc),
the process's peak RSS, routing time for `--flows` random GPU-to-GPU flows in each mode, the
max-min fair rates of those flows, and (with --graph) the networkx view of the whole machine.
"""

from __future__ import annotations

import argparse
import resource
import time
import tracemalloc

import numpy as np

from topologies.network import Network
from topologies.routing import MODES, route
from topologies.system import load_system
from twin.costs.flows import max_min_rates


def timed(fn):
    """(result, seconds) of fn(), without tracing (tracemalloc slows allocation-heavy code)."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def measure(fn):
    """(result, seconds, peak traced MB) of fn()."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    return out, dt, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", default="frontier")
    ap.add_argument("--flows", type=int, default=32768)
    ap.add_argument("--graph", action="store_true", help="also build the networkx view of the whole machine")
    a = ap.parse_args()
    s = load_system(a.system)
    Network(s, 1)  # warm up imports and numpy
    _, dt = timed(lambda: Network(s, s.groups))
    net, _, mb = measure(lambda: Network(s, s.groups))
    info = net.summary()
    print(f"{s.name}: {info['groups']} groups, {info['nodes']} nodes, {info['gpus']} GPUs, {info['nics']} NICs, "
          f"{info['switches']} switches, {info['links']:,} directed links")
    print(f"build link arrays (whole machine): {dt:.3f} s, peak traced memory {mb:.1f} MB")
    rng = np.random.default_rng(0)
    src = rng.integers(0, net.n_gpus, a.flows)
    dst = (src + rng.integers(1, net.n_gpus, a.flows)) % net.n_gpus
    for mode in MODES:
        route(net, src[:100], dst[:100], mode=mode)
        best = min(timed(lambda: route(net, src, dst, mode=mode))[1] for _ in range(3))
        r = route(net, src, dst, mode=mode)
        hops = np.diff(r.ptr)
        print(f"route {a.flows:,} random flows, {mode:10s}: {best * 1e3:7.1f} ms "
              f"({a.flows / best / 1e6:.2f} M flows/s), links per path {hops.mean():.1f} (max {hops.max()})")
        _, dt = timed(lambda: max_min_rates(r, net.capacity))
        rates, _, mb = measure(lambda: max_min_rates(r, net.capacity))
        print(f"   max-min fair rates of those flows: {dt * 1e3:7.1f} ms, {mb:.0f} MB; "
              f"rate min/median {rates.min() / 1e9:.2f}/{np.median(rates) / 1e9:.2f} GB/s")
    if a.graph:
        before = rss_mb()
        g, dt = timed(lambda: net.graph)
        print(f"networkx DiGraph of the whole machine: {dt:.1f} s, peak RSS grew by {rss_mb() - before:.0f} MB "
              f"({g.number_of_nodes():,} vertices, {g.number_of_edges():,} edges)")
    print(f"peak RSS of this process: {rss_mb():.0f} MB")


if __name__ == "__main__":
    main()
