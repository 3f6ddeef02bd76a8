"""Iteration time and grid ranking of CPU runs, offline: predicted vs measured per grid, for one or two
profiles, from run folders `backend run --out` wrote (no new measurement).

    python benchmarks/cpu_iteration.py RUNS_DIR [--profile P] [--baseline OLD.toml] [--bench BENCH_DIR]

RUNS_DIR holds one folder per grid (what benchmarks/bench_validate.py leaves under --work/runs).
Prints, per grid, measured and predicted iteration time and the error (for --baseline too), then the
median |error|, the count within 15 %, the worst, and Spearman's rank correlation of the grids.
With --bench (the measurement folder of the same loop), it also prints for each benched grid
- its recorded steps replayed: `backend bench`'s recorded training steps put through the twin's engine
  with every op at its measured span (compute ops plus the mean host gap; collectives plus the wake-up
  of the op that waited), the iteration those steps imply; against it, the twin's prediction (model
  error: how well the fitted profile reproduces what it was fitted to) and the run's measured time
  (measurement noise: the same grid measured twice, minutes apart);
- how its ops summed inside the recorded steps compare with the same ops in its run.
Both bound what any model fitted to the bench can reach per grid.
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


def replayed_steps(bench: dict) -> float | None:
    """Seconds per iteration that a measurement file's recorded training steps imply: the program (as
    the CPU executor issues it) through the twin's engine, every op at its measured span; None
    without recorded steps."""
    from twin.engine import simulate_program
    from twin.grid import Grid
    from twin.model import load_model
    from twin.program import Options, build_program, host_ordered
    host = next((r for r in bench.get("ops", []) if r["op"] == "host"), None)
    if not bench.get("steps") or host is None:
        return None
    gap = host.get("free_mean_s", host["seconds"])
    prog = host_ordered(build_program(load_model(bench["model"]), Grid.parse(bench["grid"]), Options()))
    secs = {row["name"]: row["seconds"] for row in bench["steps"]}
    wake = {row["name"]: max(0.0, row.get("wake_s", 0.0) - gap) for row in bench["steps"]}
    compute = [0.0 if op.is_collective else secs.get(op.name, 0.0) + gap for op in prog.ops]
    res = simulate_program(prog, compute, lambda i, _: secs.get(prog.ops[i].name, 0.0) + wake.get(prog.ops[i].name, 0.0))
    return res.iteration_s


def bench_vs_run(bench_dir: Path, runs_dir: Path, rows: list[tuple[str, float, float]]) -> None:
    pred = {g: (m, p) for g, m, p in rows}
    files = sorted(bench_dir.glob("bench-*.json"), key=lambda p: _order(p.stem[6:]))
    print("\nbenched grids: recorded steps replayed (s), the twin and the run against them")
    print(f"{'grid':9s}{'replayed':>9s}{'twin':>8s}{'run':>8s}")
    for f in files:
        b = json.loads(f.read_text())
        t = replayed_steps(b)
        if t and b["grid"] in pred:
            m, p = pred[b["grid"]]
            print(f"{b['grid']:9s}{t:9.3f}{p / t:8.2f}{m / t:8.2f}")
    print("\nsame grid, two measurements: ops summed in bench's recorded steps vs in the run (run/bench)")
    for f in files:
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
        bench_vs_run(args.bench, args.runs, new)


if __name__ == "__main__":
    main()
