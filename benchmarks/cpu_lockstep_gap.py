"""Why the twin's lockstep timeline overlaps compute with collectives more than CPU ranks do, offline.

    python benchmarks/cpu_lockstep_gap.py RUNS_DIR --profile P [--draws 8] [GRID ...]

RUNS_DIR holds one folder per grid with its runs (bench_validate's --work/runs; the runs of loop
cpu-2026-12-02a, the first whose traces carry each collective's issue_us, are committed:
`tar -xJf calibration/measurements/cpu-2026-12-02a/runs.tar.xz -C /tmp/02a`), P the profile fitted
from the same loop's bench (its host_op_s and collective_core_load). Per grid, the median over its
runs of the traced step (a rank's first start to last end, median over the ranks) replayed through
the twin's engine in lockstep, every op at its mean span over the ranks (as benchmarks/cpu_stretch.py):
- `plain`: as the twin times it, host_op_s before each compute op;
- `issue`: plus the run's own mean issue time (the trace's issue_us) for each collective issued
  since the compute op before that this op does not wait for, as the twin charges it
  (twin.costs.kernels.host_times; the host is the device: the compute op after an issue starts that much
  later);
- `noisy`: `issue` with each op's span drawn, per draw, from a log-normal of mean 1 and the run's own
  spread (the coefficient of variation of an op's span over the ranks, median over the compute ops
  and over the collectives; 0.6 for compute with 8 ranks on 2 cores, 0.3 with 4), mean over seeded
  draws: time-slicing makes spans vary, and the exposed part of a collective overlapped with compute
  grows with the variation (E[max(0, X - w)] > max(0, E[X] - w)).
Printed: each replay's step over the traced one, the busy shares (twin.host.cores.busy_shares: the compute
share less the host time charged, and the collective share) of the trace and of each replay, and the
stretch twin.host.cores gives each at the profile's load.

Measured on cpu-2026-12-02a (2026-12-02, its profile, 8 draws, the 30 grids of 4 and 8 ranks): the
step over the traced one 0.83-0.99 plain, 0.86-0.99 with the issue times, 0.92-1.02 noisy. On the
grids with z = 4 (1x1x4x2, 1x2x4x1, 2x1x4x1) the shares (compute/collectives) go from 0.44/0.90,
0.43/0.85, 0.43/0.85 plain to 0.40/0.79, 0.38/0.78, 0.38/0.80 noisy, against 0.36/0.74, 0.37/0.77,
0.37/0.76 traced; the grids without z split move little (8x1x1x1: 0.97, 0.97, 0.98 of the step).
The next loop, cpu-2026-12-02b (its own profile), the same: 0.84-0.99, 0.87-0.99, 0.94-1.02.
So the lockstep timeline's excess overlap is the issue time and the convexity of exposure, not a
wrong stretch formula. The twin charges the issue times bench measures, and draws the spans at the
spread bench measures per class of op, collectives only where they run beside compute (twin.host.spread;
one spread for every op, as here, was tried in it first and not kept).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration.sharing import recorded_program, replay as sharing_replay  # noqa: E402
from calibration.validate_measured import COLLECTIVES, read_run  # noqa: E402
from cpu_iteration import grid_runs  # noqa: E402
from twin.host.cores import busy_shares, core_stretch  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.costs.kernels import host_times  # noqa: E402
from twin.costs.profile import load_profile  # noqa: E402
from twin.program.program import Options  # noqa: E402


def spread(values: list[float]) -> float:
    """Coefficient of variation of an op's spans (0 for fewer than 2)."""
    m = statistics.fmean(values)
    return statistics.pstdev(values) / m if len(values) > 1 and m > 0 else 0.0


def factors(prog, cv_compute: float, cv_collective: float, rng: random.Random) -> dict[str, float]:
    """One draw: a log-normal factor of mean 1 per op (by name), of the spread of its class."""
    out = {}
    for op in prog.ops:
        cv = cv_collective if op.is_collective else cv_compute
        s2 = math.log(1.0 + cv * cv)
        out[op.name] = math.exp(rng.gauss(-s2 / 2, math.sqrt(s2))) if cv > 0 else 1.0
    return out


def lockstep(meta: dict, options: Options, secs: dict[str, float], host_s: float, issue_s: float):
    """(iteration s, busy shares) of the run's program in lockstep, each op taking secs[name], as
    calibration.sharing.replay times a bench file's steps (host_s and issue_s as the twin charges
    them, twin.costs.kernels.host_times, and left out of the compute share)."""
    steps = [{"name": n, "seconds": t} for n, t in secs.items()]
    prog, res = sharing_replay({"model": meta["model"], "grid": meta["grid"], "steps": steps}, host_s, issue_s,
                               options=options)
    return res.iteration_s, busy_shares(res.spans, lambda i: prog.ops[i].is_collective,
                                        host_times(prog.ops, host_s, issue_s).__getitem__)


def one_run(d: Path, host_s: float, draws: int) -> dict:
    """The replays of one run folder (module docstring)."""
    run = read_run(d)
    meta, spans = run["meta"], run["spans"]
    grid = Grid.parse(meta["grid"])
    options = Options(**{k: v for k, v in meta["options"].items() if k in Options.__dataclass_fields__})
    prog = recorded_program(meta["model"], meta["grid"], options)
    by_name: dict[str, list[float]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s.duration_s)
    secs = {n: statistics.fmean(v) for n, v in by_name.items()}
    kinds = {s.name: s.kind for s in spans}
    cv_compute = statistics.median([spread(v) for n, v in by_name.items() if kinds[n] not in COLLECTIVES])
    cv_collective = statistics.median([spread(v) for n, v in by_name.items() if kinds[n] in COLLECTIVES] or [0.0])
    issues = [s.args["issue_us"] / 1e6 for s in spans if s.kind in COLLECTIVES and "issue_us" in s.args]
    issue_s = statistics.fmean(issues) if issues else 0.0
    ranks = {s.rank for s in spans}
    traced = statistics.median(max(s.start_s + s.duration_s for s in spans if s.rank == r)
                               - min(s.start_s for s in spans if s.rank == r) for r in ranks)
    trace_shares = busy_shares([(s.rank, s.name, s.start_s, s.duration_s) for s in spans],
                               lambda n: kinds[n] in COLLECTIVES)
    plain = lockstep(meta, options, secs, host_s, 0.0)
    issued = lockstep(meta, options, secs, host_s, issue_s)
    rng = random.Random(1)
    noisy = []
    for _ in range(draws):
        f = factors(prog, cv_compute, cv_collective, rng)
        noisy.append(lockstep(meta, options, {n: t * f.get(n, 1.0) for n, t in secs.items()}, host_s, issue_s))
    noisy_it = statistics.fmean(it for it, _ in noisy)
    noisy_sh = tuple(statistics.fmean(sh[k] for _, sh in noisy) for k in (0, 1))
    return {"ranks": grid.size, "issue_ms": issue_s * 1e3, "cv": (cv_compute, cv_collective),
            "step": (plain[0] / traced, issued[0] / traced, noisy_it / traced),
            "shares": (trace_shares, plain[1], issued[1], noisy_sh)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", help="folder of run folders, one per grid (bench_validate's --work/runs)")
    ap.add_argument("grids", nargs="*", help="grids to replay (default: every grid of 4 or more ranks)")
    ap.add_argument("--profile", required=True, help="the loop's fitted profile (its host_op_s and load)")
    ap.add_argument("--draws", type=int, default=8, help="seeded draws of the noisy replay (default 8)")
    a = ap.parse_intermixed_args()  # RUNS --profile P GRID...: grids after the option
    runs = grid_runs(Path(a.runs))
    grids = a.grids or [g for g in runs if Grid.parse(g).size >= 4]
    missing = [g for g in grids if g not in runs]
    if missing or not grids:
        print(f"{a.runs} holds no runs of {', '.join(missing) or 'a grid of 4 or more ranks'}")
        return 1
    print("grid      issue ms  cv comp/coll | step over traced: plain issue noisy | shares c/comm: "
          "traced  plain  issue  noisy | stretch: traced noisy")
    for g in grids:
        prof = load_profile(a.profile).for_ranks(Grid.parse(g).size)
        rows = [one_run(d, prof.host_op_s, a.draws) for d in runs[g]]

        def med(f):
            return statistics.median(f(r) for r in rows)
        sh = [(med(lambda r, k=k: r["shares"][k][0]), med(lambda r, k=k: r["shares"][k][1])) for k in range(4)]
        stretch = [core_stretch(rows[0]["ranks"], prof.node_cores, prof.collective_core_load, *s) for s in (sh[0], sh[3])]
        print(f"{g:9} {med(lambda r: r['issue_ms']):7.2f}  {med(lambda r: r['cv'][0]):4.2f}/{med(lambda r: r['cv'][1]):4.2f}  | "
              + " ".join(f"{med(lambda r, k=k: r['step'][k]):5.2f}" for k in range(3)) + "       | "
              + " ".join(f"{c:.2f}/{m:.2f}" for c, m in sh) + f" | {stretch[0]:5.2f} {stretch[1]:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
