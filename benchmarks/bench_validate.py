"""The calibration loop on this machine: bench, calibrate, then run and validate every grid.

    python benchmarks/bench_validate.py --out loops/NAME --work WORK --profile twin/profiles/cpu.toml
                        # the whole loop: gpt-small, 1-8 ranks, 35 grids x 4 repeats, 2 bench passes
    (measured: 2,227 s on the quiet 2-core VM for cpu-2026-12-01j, of which bench 435 s; a pass of
    the 35 runs about 6-7 minutes; 1,488 s for cpu-2026-12-01g with 3 repeats and one bench pass)
    python benchmarks/bench_validate.py --quick --out /tmp/loop   # gpt-tiny, 1 and 2 ranks, 2 repeats, about a minute
    python benchmarks/bench_validate.py --runs WORK/runs --out loops/again \
        --profile twin/profiles/cpu.toml   # step 3 only, on runs already made (offline, seconds)

1. bench and run passes, interleaved (loop_plan: R1 B1 R2 R3 B2 R4 with the defaults, --repeats 4
   --bench-passes 2; R1 B1 R2 R3 with 3 and 1, the loops before cpu-2026-12-01j):
   - a bench pass: `backend bench` on a few grids per rank count (1, 2, 4, 8): the model's GEMM
     shapes of every valid grid with that many ranks, small ops, each collective over group sizes 2,
     4 and 8, and a few recorded training steps of the model on each of those grids (every op's cost
     inside training); one measurement file per grid and pass under OUT/ (bench-<grid>.json, then
     bench-<grid>-p<k>.json; each stamped with machine, date, versions, commit, load average);
   - a run pass: `backend run` of every valid grid of the model with those rank counts (STEPS steps
     each) into WORK/runs/<grid>/r<pass>/, each pass in another order (rotated, every other one
     reversed), so that a drift of the machine spreads over the grids instead of falling on one: a
     single run per grid carries +-15 % per-process noise on this machine (the same grid minutes
     apart; steps within a run agree within a few %), as large as the 15 % target. The bench passes
     sit among the run passes for the same reason: the profile then comes from the same stretch of
     the machine's time as the runs;
2. `twin calibrate OUT/bench-*.json --out PROFILE`, every pass pooled, printing the fit's residuals;
3. `twin validate` of all runs against PROFILE, the repeats of a grid pooled (calibration.validate.
   pool_repeats: the median over them): per grid, predicted vs measured iteration time beside the
   spread of its repeats (max/min - 1: noise and error side by side), per-op median error, memory
   peak; the grid ranking (Spearman). The table goes to stdout, the
   report without per-op rows to OUT/report.json; the runs, the full report and the per-op scatter
   (HTML) to WORK (default out/validate, not committed).
Targets (issue 10): iteration within 15 %, per-op median within 20 %, Spearman >= 0.9, memory within 10 %.
Timings depend on the machine's load: the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from calibration.loop import issue_line, kinds_line, loop_plan, pass_orders, summary_line  # noqa: E402 (shared with `twin calibrate --run`)

# (grid, what to measure) per rank count: the first of each count measures GEMMs (of every grid with
# that many ranks) and small ops; the others add collectives over the remaining group sizes and
# strides. Every one records a few training steps (what ops and collectives cost inside training):
# the data-parallel grid holds the largest per-rank ops, the others each collective kind over each
# group size alone (all-gathers and reduce-scatters run on z only). Inside training, z is recorded at
# group size 4 with 4 ranks and 2 and 8 with 8; the others take the nearest line. Recording the rest
# too (1x1x2x2 and 1x1x4x2 added, loop cpu-2026-12-02a, 15 grids benched) changed nothing measurable:
# against the same runs, a profile from the 13 grids' files gave iteration 25 within 15 %, per-op 28
# within 20 % (worst 55 %), Spearman 0.94; from all 15, 26, 28 (worst 52 %), 0.92. 1x4x2x1 is benched
# too (2026-12-02), the one 8-rank grid that splits y by 4: without it the twin took those GEMM
# shapes' in-training rate from the y = 2 shapes and ran them 17-19 % long in on-CPU time (1x4x2x1,
# 1x4x1x2 in loop 02h); 02h's bench files plus a 1x4x2x1 bench an hour later gave, against 02h's
# runs, iteration 35 within 15 % (worst 13.8 -> 11 %) and per-op 34 -> 35 within 20 %.
BENCH_GRIDS = {
    1: [("1x1x1x1", True)],
    2: [("2x1x1x1", True), ("1x1x1x2", False), ("1x1x2x1", False)],
    4: [("2x2x1x1", True), ("4x1x1x1", False), ("1x1x1x4", False), ("1x1x4x1", False)],
    8: [("2x2x2x1", True), ("4x2x1x1", False), ("8x1x1x1", False), ("1x1x1x8", False), ("1x1x8x1", False),
        ("1x4x2x1", False)],
}
SIZES_MIB = "0.004,0.03,0.25,1,4"


def sh(cmd: list[str], timeout: float) -> str:
    """Run a command from the repository root; its output, or exit with its last lines."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "COLUMNS": os.environ.get("COLUMNS", "160")})  # tables unwrapped
    if r.returncode:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{tail}")
    print(f"  {time.perf_counter() - t0:6.1f} s  {' '.join(cmd[3:9])} ...", flush=True)
    return r.stdout


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the measurement files, runs and report")
    ap.add_argument("--profile", help="profile to fit and validate against (default: OUT/cpu.toml)")
    ap.add_argument("--work", default=str(ROOT / "out" / "validate"),
                    help="folder for the runs, the full report and its HTML scatter (default: out/validate)")
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--ranks", default="1,2,4,8", help="rank counts, comma-separated")
    ap.add_argument("--steps", type=int, default=6, help="training steps per run (the first two are left out)")
    ap.add_argument("--repeats", type=int, default=4, help="runs per grid, in interleaved passes (their median counts)")
    ap.add_argument("--min-time", type=float, default=0.1, help="seconds per benchmark entry")
    ap.add_argument("--bench-passes", type=int, default=2,
                    help="bench passes, spread among the run passes; the fit pools them (medians, joint lines)")
    ap.add_argument("--train-steps", type=int, default=4, help="recorded training steps per bench grid")
    ap.add_argument("--grids", help="validate only these grids (comma-separated; default: every valid grid)")
    ap.add_argument("--skip-bench", action="store_true", help="reuse the measurement files already in OUT")
    ap.add_argument("--calibrate-only", action="store_true", help="stop after step 2 (bench and calibrate)")
    ap.add_argument("--quick", action="store_true", help="gpt-tiny on 1 and 2 ranks, 4 steps")
    ap.add_argument("--ci", action="store_true", help="gpt-tiny, two grids of 2 ranks, 4 steps (the test's size)")
    ap.add_argument("--runs", help="validate the run directories in this folder (step 3 only; needs --profile)")
    a = ap.parse_args()
    if a.quick:
        a.model, a.ranks, a.steps, a.min_time, a.repeats, a.bench_passes = "gpt-tiny", "1,2", 4, 0.02, 2, 1
    if a.ci:
        a.model, a.ranks, a.steps, a.min_time, a.grids = "gpt-tiny", "2", 4, 0.01, a.grids or "2x1x1x1,1x1x1x2"
        a.train_steps, a.repeats, a.bench_passes = 2, 2, 1
    if a.repeats < 1 or a.bench_passes < 1:
        sys.exit(f"--repeats and --bench-passes must be at least 1, got {a.repeats} and {a.bench_passes}")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    profile = Path(a.profile).resolve() if a.profile else out / "cpu.toml"
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ranks = [int(r) for r in a.ranks.split(",")]
    py = sys.executable
    t_start = time.perf_counter()
    print(f"load average at the start: {load()} ({os.cpu_count()} cores)", flush=True)
    if a.runs:
        if not profile.exists():
            sys.exit(f"--runs needs a profile to validate against: {profile} does not exist (give --profile)")
        runs = sorted(f.parent for f in Path(a.runs).rglob("log.jsonl"))  # runs/<grid>/ or runs/<grid>/r<k>/
        return validate(runs, profile, out, work, a, t_start, 0.0, ranks)

    from backend.bench.shapes import grids_of
    grids = [str(g) for r in ranks for g in grids_of(a.model, r)]
    if a.grids:
        grids = [g for g in grids if g in a.grids.split(",")]
    bench_grids = [(g, first) for r in ranks for g, first in BENCH_GRIDS[r]
                   if not a.ci or g in a.grids.split(",")]  # the test's size: bench only the grids it validates
    plan = loop_plan(0 if a.calibrate_only else a.repeats, a.bench_passes)
    files, runs, orders, t_bench = [], [], pass_orders(grids, a.repeats), 0.0
    print(f"1. backend bench ({a.bench_passes} pass(es)) and backend run, every grid "
          f"({0 if a.calibrate_only else a.repeats} pass(es)): {' '.join(plan)}", flush=True)
    for step in plan:
        k = int(step[1:])
        if step[0] == "B":
            print(f"  bench pass {k}", flush=True)
            t0 = time.perf_counter()
            for grid, first in bench_grids:
                f = out / (f"bench-{grid}.json" if k == 1 else f"bench-{grid}-p{k}.json")
                files.append(f)
                if a.skip_bench and f.exists():
                    continue
                cmd = [py, "-m", "backend.cli", "bench", "--model", a.model, "--grid", grid, "--layouts", "program",
                       "--all-grids", "--sizes-mib", SIZES_MIB, "--min-time", str(a.min_time),
                       "--train-steps", str(a.train_steps), "--out", str(f)]
                cmd += ["--squares", "256"] if first else ["--no-gemm", "--no-ops"]
                sh(cmd, 600)
            t_bench += time.perf_counter() - t0
        else:
            print(f"  run pass {k} of {a.repeats}", flush=True)
            for g in orders[k - 1]:
                d = work / "runs" / g / f"r{k}"
                sh([py, "-m", "backend.cli", "run", "--model", a.model, "--grid", g, "--steps", str(a.steps),
                    "--warmup", "1", "--out", str(d)], 600)
                runs.append(d)

    print("2. twin calibrate", flush=True)
    print(sh([py, "-m", "twin.cli", "calibrate", *map(str, files), "--out", str(profile)], 300), flush=True)
    if a.calibrate_only:
        return 0
    return validate(runs, profile, out, work, a, t_start, t_bench, ranks)


def validate(runs: list[Path], profile: Path, out: Path, work: Path, a, t_start: float, t_bench: float,
             ranks: list[int]) -> int:
    """Step 3: `twin validate` of the runs; the report and the summary lines."""
    py = sys.executable
    print("3. twin validate", flush=True)
    report, html = work / "report.json", work / "report.html"
    print(sh([py, "-m", "twin.cli", "validate", *map(str, runs), "--profile", str(profile),
              "--json", str(report), "--html", str(html)], 900), flush=True)
    rep = json.loads(report.read_text())
    summary = {**rep, "runs": [{k: v for k, v in r.items() if k != "per_op"} for r in rep["runs"]],
               "load_average_end": os.getloadavg(), "cores": os.cpu_count(), "steps": a.steps,
               "repeats_per_grid": a.repeats}
    (out / "report.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out / 'report.json'} (per-op rows and the scatter: {work})")
    benched = {g for r in ranks for g, _ in BENCH_GRIDS.get(r, [])}
    for label, sel in (("all grids", rep["runs"]), ("benched grids (their training steps were fitted)",
                       [r for r in rep["runs"] if r["grid"] in benched]),
                       ("other grids (out of sample)", [r for r in rep["runs"] if r["grid"] not in benched])):
        if sel:
            print(summary_line(label, sel))
    print(kinds_line(rep["runs"]))
    print(issue_line(rep["runs"]))
    if rep.get("noise"):
        from calibration.noise import noise_line
        print(noise_line(rep["noise"]))
    its = [abs(r["iteration"]["error"]) for r in rep["runs"]]
    ops = [r["ops"]["median_abs_error"] for r in rep["runs"]]
    mem = [abs(r["memory"]["error"]) for r in rep["runs"] if r["memory"]["error"] is not None]
    print(f"worst iteration error {100 * max(its):.0f} % (target 15 %), worst per-op median error "
          f"{100 * max(ops):.0f} % (target 20 %), worst memory error "
          f"{100 * max(mem) if mem else float('nan'):.0f} % (target 10 %), Spearman "
          f"{rep['spearman'] if rep['spearman'] is not None else float('nan'):.2f} (target 0.9)")
    print(f"bench {t_bench:.0f} s, whole loop {time.perf_counter() - t_start:.0f} s; "
          f"load average at the end: {load()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
