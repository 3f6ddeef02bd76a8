"""The collective model against AxoNN's ring bandwidth table, and how fast it is.

    python benchmarks/bench_collectives.py

1. Model (each system's "axonn-table" figures, fit to this table) vs measured ring bandwidth (GB/s)
   for Perlmutter and Frontier groups of size p = 2, 4, 8, 16 and rank stride s = 1, 2, 4, 8
   (docs/reference/collective-bandwidth.md; "p>8" read at 16),
   all groups of the axis running at once, with the ratio model/measured. The default figures are
   fit to measured collectives instead: benchmarks/bench_measured_collectives.py.
2. Alps: NCCL all-reduce bus bandwidth on 2 nodes (systems.md) against the model.
3. Speed on the default Frontier study (gpt-320b, 32,768 GCDs, grid 8x8x4x128): building the
   CollectiveModel, then every distinct (kind, axis, bytes) of the program, alone and with each
   subset of the other axes running concurrently; and the effective bandwidth of each axis by routing mode.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_collectives import MEASURED, model_bandwidth  # noqa: E402  (the table lives with its test)

from topologies.system import load_system  # noqa: E402
from twin.costs.collectives import CollectiveModel  # noqa: E402
from twin.program.grid import AXES, Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from twin.program.program import build_program  # noqa: E402


def table() -> None:
    print("ring bus bandwidth, model vs measured (GB/s), all groups of the axis at once")
    print(f"{'system':11s} {'stride':>6s} {'p':>3s} {'measured':>9s} {'model':>7s} {'ratio':>6s}")
    ratios = []
    for system, rows in MEASURED.items():
        for s, row in rows.items():
            for p, bw in row.items():
                m = model_bandwidth(system, s, p)
                ratios.append(m / bw)
                print(f"{system:11s} {s:6d} {p:3d} {bw:9.0f} {m:7.1f} {m / bw:6.2f}")
    r = sorted(ratios)
    print(f"ratio min {r[0]:.2f}, median {r[len(r) // 2]:.2f}, max {r[-1]:.2f}; "
          f"{sum(0.9 <= x <= 1.1 for x in r)} of {len(r)} within 10%")


def alps() -> None:
    """docs.cscs.ch (systems.md): NCCL all-reduce on 2 Alps nodes (8 GPUs), bus bandwidth by size."""
    m = CollectiveModel(load_system("alps"), Grid(8, 1, 1, 1))
    print("\nAlps, NCCL all-reduce on 2 nodes (8 GPUs), bus bandwidth 2(p-1)/p x size / time (GB/s)")
    for mib, measured in ((128, 122.6), (64, 107.7), (32, 85.5)):
        size = mib * 2**20
        bus = 2 * 7 / 8 * size / m.time("all_reduce", "x", size) / 1e9
        print(f"  {mib:4d} MiB: measured {measured:6.1f}, model {bus:6.1f}, ratio {bus / measured:.2f}")


def speed() -> None:
    system, grid = load_system("frontier"), Grid(8, 8, 4, 128)
    prog = build_program(load_model("gpt-320b"), grid)
    ops = sorted({(op.kind, op.axis, op.bytes) for op in prog.ops if op.is_collective})
    print(f"\ngpt-320b on {grid.size} Frontier GCDs, grid {grid}: {len(ops)} distinct collectives in the program")
    for routing in ("adaptive", "minimal"):
        t0 = time.perf_counter()
        m = CollectiveModel(system, grid, routing=routing)
        t1 = time.perf_counter()
        for kind, axis, nbytes in ops:
            m.time(kind, axis, nbytes)
        t2 = time.perf_counter()
        calls = 0
        for kind, axis, nbytes in ops:
            others = [a for a in AXES if a != axis]
            for r in range(1, len(others) + 1):
                for c in itertools.combinations(others, r):
                    m.time(kind, axis, nbytes, frozenset(c))
                    calls += 1
        t3 = time.perf_counter()
        bw = ", ".join(f"{a} {m.effective_bandwidth(a) / 1e9:.2f}" for a in AXES)
        print(f"  routing {routing:8s}: model {t1 - t0:.3f} s; {len(ops)} calls alone {t2 - t1:.3f} s; "
              f"{calls} calls with every concurrent subset (15 max-min solves) {t3 - t2:.3f} s")
        print(f"    effective bandwidth per axis (GB/s): {bw}")
        print(f"    e.g. all-reduce over data of 1 GiB: {m.time('all_reduce', 'data', 2**30):.3f} s alone, "
              f"{m.time('all_reduce', 'data', 2**30, frozenset({'x', 'y', 'z'})):.3f} s with x, y, z running")


if __name__ == "__main__":
    table()
    alps()
    speed()
