"""Iteration time and grid ranking of CPU runs, offline: predicted vs measured per grid, for one or two
profiles, from run folders `backend run --out` wrote (no new measurement).

    python benchmarks/cpu_iteration.py RUNS_DIR [--profile P] [--baseline OLD.toml] [--bench BENCH_DIR]

RUNS_DIR holds one folder per grid (what benchmarks/bench_validate.py leaves under --work/runs).
Prints, per grid, measured and predicted iteration time and the error (for --baseline too), then the
median |error|, the count within 15 %, the worst, and Spearman's rank correlation of the grids.
With --bench (the measurement folder of the same loop), it also prints for each benched grid how its
ops summed inside `backend bench`'s recorded steps compare with the same ops in its run: the noise
between two measurements of one grid, which bounds what any fitted model can reach per grid.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration.validate import read_run, spearman, validate_run  # noqa: E402


def _order(g: str) -> tuple:
    a = [int(v) for v in g.split("x")]
    return (a[0] * a[1] * a[2] * a[3], g)


def table(runs: list[Path], profile: str) -> list[tuple[str, float, float]]:
    out = []
    for d in runs:
        r = validate_run(d, profile=profile)
        out.append((r["grid"], r["iteration"]["measured_s"], r["iteration"]["predicted_s"]))
    return out


def summary(rows: list[tuple[str, float, float]]) -> str:
    errs = [abs(p / m - 1) for _, m, p in rows]
    return (f"median |err| {statistics.median(errs):.1%}, within 15 %: {sum(e <= 0.15 for e in errs)}/{len(errs)}, "
            f"worst {max(errs):.1%}, Spearman {spearman([p for *_, p in rows], [m for _, m, _ in rows]):.3f}")


def bench_vs_run(bench_dir: Path, runs_dir: Path) -> None:
    print("\nsame grid, two measurements: ops summed in bench's recorded steps vs in the run (run/bench)")
    for f in sorted(bench_dir.glob("bench-*.json"), key=lambda p: _order(p.stem[6:])):
        b = json.loads(f.read_text())
        d = runs_dir / b["grid"]
        if not d.exists() or not b.get("steps"):
            continue
        spans: dict[str, list[float]] = {}
        for s in read_run(d)["spans"]:
            spans.setdefault(s.name, []).append(s.duration_s)
        agg: dict[str, list[float]] = {}
        for row in b["steps"]:
            if row["name"] in spans:
                key = row["kind"] + (f"/{row['axis']}" if row["axis"] else "")
                a = agg.setdefault(key, [0.0, 0.0])
                a[0] += row["seconds"]
                a[1] += statistics.fmean(spans[row["name"]])
        print(f"{b['grid']:9s}" + "  ".join(f"{k} {v[1] / v[0]:.2f}" for k, v in sorted(agg.items())
                                           if k in ("gemm", "attention", "elementwise") or "/" in k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--profile", default="calibration/profiles/cpu.toml")
    ap.add_argument("--baseline", default=None, help="a second profile to compare (e.g. the previous fit)")
    ap.add_argument("--bench", type=Path, default=None, help="the loop's measurement folder (bench-*.json)")
    args = ap.parse_args()
    runs = sorted((d for d in args.runs.iterdir() if (d / "log.jsonl").exists()), key=lambda d: _order(d.name))
    new = table(runs, args.profile)
    old = table(runs, args.baseline) if args.baseline else None
    head = f"{'grid':9s}{'measured':>9s}{'predicted':>10s}{'error':>8s}"
    print(head + (f"{'baseline':>10s}{'error':>8s}" if old else ""))
    for i, (g, m, p) in enumerate(new):
        line = f"{g:9s}{m:9.3f}{p:10.3f}{p / m - 1:+8.1%}"
        if old:
            line += f"{old[i][2]:10.3f}{old[i][2] / m - 1:+8.1%}"
        print(line)
    print(f"{args.profile}: {summary(new)}")
    if old:
        print(f"{args.baseline}: {summary(old)}")
    if args.bench:
        bench_vs_run(args.bench, args.runs)


if __name__ == "__main__":
    main()
