"""In-training GEMM points on CPU: one grid's op spans, or on-CPU time x the rank count's stretch?

    python benchmarks/cpu_op_points.py /work/bv-work2/runs     # the runs of a CPU loop (bench_validate.py)

`backend bench` records a few training steps on a few grids per rank count, and calibration turns
each GEMM shape it saw into a point the twin uses for every grid with that many ranks. With more
ranks than cores, a rank descheduled inside an op leaves that op's span long, and each grid's steps
time-slice their own way. This takes the runs of the grids the loop benches (BENCH_GRIDS of
bench_validate.py) as the recorded steps, and predicts every GEMM of the other grids (same rank count,
the nearest point within a factor 2 in m, n and k and the same layout, as twin.kernels does) from
- spans: the point's wall span (median over ranks), what the fit took before bench recorded cpu_s;
- on-CPU x stretch: the point's on-CPU time x the stretch of all the benched runs with that many
  ranks (their compute ops' summed span over summed on-CPU time), calibration.fit._fluid_spans;
against the measured op as `twin validate` compares it (on-CPU time x its rank's stretch). Prints
the median |error| per grid and over the grids, for each. Offline, in seconds.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> int:
    from bench_validate import BENCH_GRIDS
    from calibration.validate import measured_ops
    from twin.grid import Grid
    from twin.trace import read_trace
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python benchmarks/cpu_op_points.py RUNS_DIR (the runs/ folder of bench_validate.py)")
    benched = {g for grids in BENCH_GRIDS.values() for g, _ in grids}
    runs = {}
    for d in sorted(Path(sys.argv[1]).iterdir()):
        if not (d / "trace").is_dir():
            continue
        grid = Grid.parse(d.name)
        spans = read_trace(d / "trace")
        got = measured_ops(spans, grid)
        if got["cpu_source"] != "recorded (cpu_us)":
            sys.exit(f"{d}: the trace has no on-CPU times (cpu_us): rerun the loop with a newer backend")
        gemms = {s.name: (s.args["m"], s.args["n"], s.args["k"], s.args.get("layout") or "NN")
                 for s in spans if s.kind == "gemm"}
        runs[d.name] = (grid.size, got, gemms)
    points: dict[int, list[tuple]] = {}
    sums: dict[int, list[float]] = {}
    for name, (ranks, got, gemms) in runs.items():
        if name not in benched:
            continue
        for op, (m, n, k, lay) in gemms.items():
            points.setdefault(ranks, []).append((m, n, k, lay, statistics.median(got["wall"][op]),
                                                 statistics.median(got["cpu"][op])))
        both = sums.setdefault(ranks, [0.0, 0.0])
        for op in got["cpu"]:
            both[0] += statistics.median(got["wall"][op])
            both[1] += statistics.median(got["cpu"][op])
    stretch = {r: max(1.0, w / c) for r, (w, c) in sums.items()}
    print("stretch of the benched runs per rank count: "
          + ", ".join(f"{r}: {s:.2f}" for r, s in sorted(stretch.items())))

    def nearest(ranks, m, n, k, lay):
        best, dist = None, math.inf
        for p in points.get(ranks, []):
            r = [abs(math.log2(a / b)) for a, b in ((m, p[0]), (n, p[1]), (k, p[2]))]
            if p[3] == lay and max(r) <= 1.0 and sum(r) < dist:
                best, dist = p, sum(r)
        return best

    print(f"{'grid':9s} {'GEMMs':>5s} {'spans':>7s} {'on-CPU x stretch':>17s}   (median |error| per GEMM)")
    per_grid = {"spans": [], "cpu": []}
    for name, (ranks, got, gemms) in sorted(runs.items()):
        if name in benched or ranks not in stretch:
            continue
        err = {"spans": [], "cpu": []}
        for op, (m, n, k, lay) in gemms.items():
            p = nearest(ranks, m, n, k, lay)
            if p is None:
                continue
            rate = 2.0 * p[0] * p[1] * p[2]
            measured = statistics.median(got["fluid"][op])
            err["spans"].append(abs(2.0 * m * n * k * p[4] / rate / measured - 1))
            err["cpu"].append(abs(2.0 * m * n * k * p[5] * stretch[ranks] / rate / measured - 1))
        if err["cpu"]:
            for key in err:
                per_grid[key].append(statistics.median(err[key]))
            print(f"{name:9s} {len(err['cpu']):5d} {100 * per_grid['spans'][-1]:6.0f} % "
                  f"{100 * per_grid['cpu'][-1]:15.0f} %")
    if per_grid["cpu"]:
        print(f"median over {len(per_grid['cpu'])} grids not benched: spans "
              f"{100 * statistics.median(per_grid['spans']):.0f} %, on-CPU x stretch "
              f"{100 * statistics.median(per_grid['cpu']):.0f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
