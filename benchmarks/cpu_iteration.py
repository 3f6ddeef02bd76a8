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
  (measurement noise: the same grid measured twice, minutes apart); where bench also timed its steps
  whole (step_s, files from cpu-2026-12-01l on), the twin and the run against that time, which the
  replay of the mean ops falls short of by up to 20 % where ranks time-slice;
- how its ops summed inside the recorded steps compare with the same ops in its run.
Both bound what any model fitted to the bench can reach per grid.

    python benchmarks/cpu_iteration.py --loops RUNS:BENCH RUNS:BENCH ...   # two or more loops

With --loops (each loop's runs folder and measurement folder), no prediction: whether the gap
between a benched grid's recorded steps (replayed) and its run repeats from loop to loop (per grid,
the run over the replayed steps in each loop; the spread within a grid across loops against the
spread between grids, F; the loops' correlations over the grids), how far the same grid's measured
iteration moves from loop to loop (each loop's geometric mean taken out) and within a run (its
steps), what share of grids a model exact on average can hold within 15 % of one run at that spread,
and, op kind by op kind, the runs' summed spans over bench's recorded ones on the same grids.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration.validate import validate_run  # noqa: E402
from calibration.validate_measured import read_run  # noqa: E402
from calibration.validate_summary import spearman  # noqa: E402


def _order(g: str) -> tuple:
    a = [int(v) for v in g.split("x")]
    return (a[0] * a[1] * a[2] * a[3], g)


def grid_runs(root: Path) -> dict[str, list[Path]]:
    """grid -> its run folders under root: root/<grid>/, or root/<grid>/r<k>/ where the loop ran each
    grid several times (benchmarks/bench_validate.py --repeats)."""
    out: dict[str, list[Path]] = {}
    for f in sorted(root.rglob("log.jsonl")):
        d = f.parent
        out.setdefault(d.parent.name if d.name[:1] == "r" and d.name[1:].isdigit() else d.name, []).append(d)
    return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def table(runs: dict[str, list[Path]], profile: str) -> list[tuple[str, float, float]]:
    """(grid, measured s, predicted s) per grid: the median of its runs' iterations, the twin's."""
    out = []
    for g, dirs in runs.items():
        rs = [validate_run(d, profile=profile) for d in dirs]
        out.append((g, statistics.median(r["iteration"]["measured_s"] for r in rs), rs[0]["iteration"]["predicted_s"]))
    return out


def summary(rows: list[tuple[str, float, float]]) -> str:
    errs = [abs(p / m - 1) for _, m, p in rows]
    return (f"median |err| {statistics.median(errs):.1%}, within 15 %: {sum(e <= 0.15 for e in errs)}/{len(errs)}, "
            f"worst {max(errs):.1%}, Spearman {spearman([p for *_, p in rows], [m for _, m, _ in rows]):.3f}")


def replayed_steps(bench: dict) -> float | None:
    """Seconds per iteration that a measurement file's recorded training steps imply: the program (as
    the CPU executor issues it) through the twin's engine, every op at its measured span; None
    without recorded steps."""
    from calibration.sharing import recorded_program
    from twin.engine.engine import simulate_program
    host = next((r for r in bench.get("ops", []) if r["op"] == "host"), None)
    if not bench.get("steps") or host is None:
        return None
    gap = host.get("free_mean_s", host["seconds"])
    prog = recorded_program(bench["model"], bench["grid"])
    secs = {row["name"]: row["seconds"] for row in bench["steps"]}
    wake = {row["name"]: max(0.0, row.get("wake_s", 0.0) - gap) for row in bench["steps"]}
    compute = [0.0 if op.is_collective else secs.get(op.name, 0.0) + gap for op in prog.ops]
    res = simulate_program(prog, compute, lambda i, _: secs.get(prog.ops[i].name, 0.0) + wake.get(prog.ops[i].name, 0.0))
    return res.iteration_s


def add_bench_and_run(bench: dict, run_dirs: list[Path], key, agg: dict[str, list[float]]) -> None:
    """Add each op of bench's recorded steps that the runs also traced to agg[key(row)]: [bench
    seconds, the runs' mean span in seconds], summed over the ops of that key."""
    spans: dict[str, list[float]] = {}
    for d in run_dirs:
        for s in read_run(d)["spans"]:
            spans.setdefault(s.name, []).append(s.duration_s)
    for row in bench["steps"]:
        if row["name"] in spans:
            a = agg.setdefault(key(row), [0.0, 0.0])
            a[0] += row["seconds"]
            a[1] += statistics.fmean(spans[row["name"]])


def bench_vs_run(bench_dir: Path, runs: dict[str, list[Path]], rows: list[tuple[str, float, float]]) -> None:
    pred = {g: (m, p) for g, m, p in rows}
    files = sorted(bench_dir.glob("bench-*.json"), key=lambda p: (_order(p.stem[6:].split("-")[0]), p.name))  # bench-<grid>[-p<k>]
    benches = [json.loads(f.read_text()) for f in files]
    print("\nbenched grids: recorded steps replayed (s), the twin and the run against them; where bench timed\n"
          "its steps whole (step_s), that time (s) and the twin and the run against it")
    print(f"{'grid':9s}{'replayed':>9s}{'twin':>8s}{'run':>8s}{'step':>8s}{'twin':>8s}{'run':>8s}")
    for b in benches:
        t = replayed_steps(b)
        if t and b["grid"] in pred:
            m, p = pred[b["grid"]]
            step = next((r.get("step_s") for r in b["ops"] if r["op"] == "host"), None)
            whole = f"{step:8.3f}{p / step:8.2f}{m / step:8.2f}" if step else ""
            print(f"{b['grid']:9s}{t:9.3f}{p / t:8.2f}{m / t:8.2f}{whole}")
    print("\nsame grid, two measurements: ops summed in bench's recorded steps vs in the run (run/bench)")
    for b in benches:
        if b["grid"] not in runs or not b.get("steps"):
            continue
        agg: dict[str, list[float]] = {}
        add_bench_and_run(b, runs[b["grid"]], lambda row: row["kind"] + (f"/{row['axis']}" if row["axis"] else ""), agg)
        print(f"{b['grid']:9s}" + "  ".join(f"{k} {v[1] / v[0]:.2f}" for k, v in sorted(agg.items())
                                           if k in ("gemm", "attention", "elementwise") or "/" in k))


def _loop_steps(runs: Path) -> dict[str, list[float]]:
    """grid -> the step times of its runs (steps 3 on of each run, as validation takes them)."""
    return {g: [json.loads(line)["step_time_s"] for d in dirs
                for line in (d / "log.jsonl").read_text().splitlines()[2:] if line.strip()]
            for g, dirs in grid_runs(runs).items()}


def loops_report(loops: list[tuple[Path, Path]]) -> None:
    """The --loops report (module docstring)."""
    import math
    from statistics import NormalDist
    names = [str(b.name) for _, b in loops]
    ratio: dict[str, dict[str, float]] = {}
    for (runs, bench), name in zip(loops, names):
        steps = _loop_steps(runs)
        for f in bench.glob("bench-*.json"):
            b = json.loads(f.read_text())
            t = replayed_steps(b)
            if t and b["grid"] in steps:
                ratio.setdefault(b["grid"], {})[name] = statistics.median(steps[b["grid"]]) / t
    grids = sorted((g for g, v in ratio.items() if len(v) == len(loops)), key=_order)
    print("benched grids: the run's iteration over its recorded steps replayed, per loop")
    print(f"{'grid':9s}" + "".join(f"{n[-3:]:>7s}" for n in names))
    logs = []
    for g in grids:
        v = [ratio[g][n] for n in names]
        logs.append([math.log(x) for x in v])
        print(f"{g:9s}" + "".join(f"{x:7.2f}" for x in v))
    k = len(loops)
    within = statistics.fmean(statistics.variance(lg) for lg in logs)
    between = k * statistics.variance([statistics.fmean(lg) for lg in logs])
    print(f"sd of the log ratio: within a grid across loops {within ** .5:.3f}, between grids' means x sqrt({k}) "
          f"{between ** .5:.3f}; F = {between / within:.2f} on ({len(grids) - 1}, {len(grids) * (k - 1)}) degrees of freedom")
    for i in range(k):
        for j in range(i + 1, k):
            a, b = [lg[i] for lg in logs], [lg[j] for lg in logs]
            ma, mb = statistics.fmean(a), statistics.fmean(b)
            c = sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** .5
            print(f"  correlation over the grids, {names[i]} vs {names[j]}: {c:+.2f}")
    steps = [_loop_steps(r) for r, _ in loops]
    common = sorted(set.intersection(*(set(s) for s in steps)), key=_order)
    it = [{g: math.log(statistics.median(s[g])) for g in common} for s in steps]
    mu = [statistics.fmean(v.values()) for v in it]
    sd_runs = statistics.fmean(statistics.variance([it[i][g] - mu[i] for i in range(k)]) for g in common) ** .5
    dev = [math.log(t / statistics.fmean(s[g])) for s in steps for g in common for t in s[g]]
    print(f"\nthe same grid's measured iteration ({len(common)} grids): sd of its log across loops (each loop's mean out) "
          f"{sd_runs:.3f}; of a step within its grid's runs {statistics.stdev(dev):.3f}")
    for i in range(k):
        for j in range(i + 1, k):
            r = [math.exp((it[j][g] - mu[j]) - (it[i][g] - mu[i])) for g in common]
            print(f"  {names[j]} over {names[i]}: {min(r):.2f}-{max(r):.2f}, within 15 %: {sum(abs(x - 1) <= .15 for x in r)} of {len(r)}")
    one = sd_runs  # one run's own spread about the grid's mean
    p = NormalDist(0, one).cdf(math.log(1.15)) - NormalDist(0, one).cdf(-math.log(1.15))
    print(f"a model exact on each grid's mean, against one run of sd {one:.3f}: within 15 % with probability {p:.2f}, "
          f"{p * len(common):.1f} of {len(common)} grids expected")
    print("\nop kinds, the runs' spans summed over bench's recorded ones (same grids, same op names):")
    for (runs, bench), name in zip(loops, names):
        agg: dict[str, list[float]] = {}
        dirs = grid_runs(runs)
        for f in bench.glob("bench-*.json"):
            b = json.loads(f.read_text())
            if b["grid"] not in dirs or not b.get("steps"):
                continue
            add_bench_and_run(b, dirs[b["grid"]], lambda row: f"{row['kind']}/{row['axis']}" if row["axis"] else "compute", agg)
        print(f"  {name}: " + ", ".join(f"{k} {v[1] / v[0]:.2f}" for k, v in sorted(agg.items())))


def main() -> None:
    if "--loops" in sys.argv[1:2]:
        loops_report([(Path(a.split(":")[0]), Path(a.split(":")[1])) for a in sys.argv[2:]])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--profile", default="twin/profiles/cpu.toml")
    ap.add_argument("--baseline", default=None, help="a second profile to compare (e.g. the previous fit)")
    ap.add_argument("--bench", type=Path, default=None, help="the loop's measurement folder (bench-*.json)")
    args = ap.parse_args()
    runs = grid_runs(args.runs)
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
        bench_vs_run(args.bench, runs, new)


if __name__ == "__main__":
    main()
