"""Whether the twin's per-op misses on CPU are noise or model: per grid, the runs' own per-op noise
beside the twin's per-op error, offline.

    python benchmarks/cpu_op_noise.py RUNS_DIR --profile P [GRID ...]

RUNS_DIR holds one folder per grid with its runs (bench_validate's --work/runs; the committed loops'
runs unpack from runs.tar.xz, see calibration/README.md), P the profile fitted from the same loop's
bench. Per grid with 4 or more runs, each op's measured time is taken as `twin validate` takes it
(calibration.validate.validate_run: a compute op at its on-CPU time times its rank's stretch, a
collective at its span) and pooled over runs as the report pools repeats (median per op). Printed:
- `halves`: measured against measured, no model involved: the median over ops of |A / B - 1|, A and
  B each op's median over one half of the runs, for the three ways to split four runs in two pairs
  (runs 1+3 / 2+4, 1+2 / 3+4, 1+4 / 2+3); the worst of the three;
- `twin`: the twin's per-op median |error| against all the runs (what the report prints);
- `stretch`: each run's measured stretch, and the twin's.
A pair's median carries more noise than the median of four that the twin is judged against (the
difference of two halves has about twice the spread of one median of four), so `halves` bounds the
noise from above: where `twin` stands well past it, the miss is the model's.

Measured (2026-12-02, each loop against a profile fitted from its own bench):
- cpu-2026-12-02d: halves (the worst split) at most 0.25 (2x1x4x1), median over the grids 0.12; the
  twin past 20 % on 1x1x4x2 (0.38, halves at most 0.12), 1x2x4x1 and 1x4x2x1 (0.21, halves 0.13),
  2x2x2x1 (0.20, halves 0.08) and 2x1x4x1 (0.24, halves 0.25: within the noise);
- cpu-2026-12-02e (a noisier loop: repeats' spread median 29 %): halves up to 0.44 (2x4x1x1),
  median 0.19; the twin past 20 % on 1x1x4x2 alone (0.21, halves at most 0.10; its stretch 3.40
  predicted against 2.74-2.94 in the four runs).
The z = 4 grids of 8 ranks miss by the model (their predicted stretch), not by the runs' scatter.

`--bench DIR` (the loop's bench files) adds, per benched grid, the GEMMs' on-CPU time of each bench
file's recorded steps and of each run over the runs' median: the profile's in-training GEMM times come
from bench, minutes away from the runs. Measured (2026-12-02) on 02g, 02h and 02i: no method in it, the
machine's drift. The bench files' ratios, median over the grids, 1.00 and 1.00 (02g), 0.98 and 1.06
(02h: its first pass below the runs' median on 12 of 13 grids, its second above on all 13), 1.04 and
0.99 (02i); each bench file 0.94-1.18, the runs themselves 0.89-1.24 and single runs at 1.5-1.9 (02g
1x1x8x1; 02i 1x1x1x2, 1x1x1x4, 1x1x2x1). On 1x1x4x1 in 02i (the GEMM shapes of 1x1x1x4) the two
grids' second passes, at 1.16 and 1.13, put the twin's GEMM on-CPU time 10 % over the runs' (median
over the ops): half of its 20 % per op there, its stretch 8 % over the measured the other half.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration.validate import validate_run  # noqa: E402

SPLITS = (((0, 2), (1, 3)), ((0, 1), (2, 3)), ((0, 3), (1, 2)))


def op_medians(runs: list[dict]) -> dict[str, float]:
    """Each op's measured time (s), the median over `runs` (validate_run results) as the report pools."""
    by_name: dict[str, list[float]] = {}
    for r in runs:
        for o in r["per_op"]:
            by_name.setdefault(o["name"], []).append(o["measured_s"])
    return {name: statistics.median(times) for name, times in by_name.items()}


def median_gap(a: dict[str, float], b: dict[str, float]) -> float:
    """Median over the ops of both of |a / b - 1|."""
    return statistics.median(abs(a[k] / b[k] - 1) for k in a if b.get(k, 0.0) > 0)


def grid_noise(runs: list[dict]) -> dict:
    """Per-op noise of one grid's runs (4 or more) and the twin's per-op error against them."""
    every = op_medians(runs)
    halves = [median_gap(op_medians([runs[i] for i in a]), op_medians([runs[i] for i in b])) for a, b in SPLITS]
    twin = statistics.median(abs(o["predicted_s"] / every[o["name"]] - 1) for o in runs[0]["per_op"]
                             if every.get(o["name"], 0.0) > 0)
    return {"halves": halves, "twin": twin, "stretch": [r["ops"]["stretch"] for r in runs],
            "stretch_predicted": runs[0]["ops"].get("stretch_predicted")}


def gemm_cpu_drift(runs: list[dict], benches: list[dict]) -> tuple[list[float], list[float]]:
    """The GEMMs' on-CPU time, summed over the ops every run and bench file has, of each bench file's
    recorded training steps and of each run, over the runs' median: whether the profile's in-training
    GEMM times (fitted from bench) sit apart from the runs' by method or by the machine's drift."""
    per_run = [{o["name"]: o["cpu_s"] for o in r["per_op"] if o["kind"] == "gemm" and "cpu_s" in o} for r in runs]
    per_bench = [{row["name"]: row["cpu_s"] for row in b["steps"] if row["kind"] == "gemm" and row.get("cpu_s")}
                 for b in benches]
    names = set.intersection(*(set(d) for d in per_run + per_bench))
    ref = statistics.median(sum(d[n] for n in names) for d in per_run)
    if ref <= 0:
        return [], []
    return [sum(d[n] for n in names) / ref for d in per_bench], [sum(d[n] for n in names) / ref for d in per_run]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", type=Path, help="one folder per grid, each with its runs")
    ap.add_argument("--profile", required=True, help="the profile fitted from the same loop's bench")
    ap.add_argument("grids", nargs="*", help="only these grids (default: all)")
    ap.add_argument("--bench", type=Path, help="the loop's folder of bench files: print, per benched grid, its "
                                               "GEMMs' on-CPU time in each bench file and each run over the runs' median")
    a = ap.parse_intermixed_args()
    drift = []
    print(f"{'grid':9s} {'halves (3 splits)':>18s}  {'worst':>5s}  {'twin':>5s}  stretch: runs -> twin")
    for folder in sorted(p for p in a.runs.iterdir() if p.is_dir() and (not a.grids or p.name in a.grids)):
        runs = [validate_run(d, profile=a.profile) for d in sorted(folder.iterdir()) if d.is_dir()]
        if len(runs) < 4:
            continue
        g = grid_noise(runs)
        flag = "  <- the model's" if g["twin"] > 0.2 and g["twin"] > max(g["halves"]) else ""
        predicted = f"{g['stretch_predicted']:.2f}" if g["stretch_predicted"] else "-"
        print(f"{folder.name:9s} {' '.join(f'{h:5.2f}' for h in g['halves']):>18s}  {max(g['halves']):5.2f}  "
              f"{g['twin']:5.2f}  {' '.join(f'{s:.2f}' for s in g['stretch'])} -> {predicted}{flag}")
        files = sorted(a.bench.glob(f"bench-{folder.name}.json")) + sorted(a.bench.glob(f"bench-{folder.name}-*.json")) \
            if a.bench else []
        if files:
            drift.append((folder.name, *gemm_cpu_drift(runs, [json.loads(f.read_text()) for f in files])))
    if drift:
        print("GEMMs' on-CPU time over the runs' median: bench files (in order) | runs")
        for grid, bench, each in drift:
            print(f"{grid:9s} {' '.join(f'{x:.3f}' for x in bench)} | {' '.join(f'{x:.3f}' for x in each)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
