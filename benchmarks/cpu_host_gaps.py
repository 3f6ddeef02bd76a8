"""The executor's host time between compute ops on CPU, measured against what the twin charges.

    python benchmarks/cpu_host_gaps.py RUNS_DIR --profile P
    python benchmarks/cpu_host_gaps.py --bench calibration/measurements/cpu-2026-12-02g/bench-*.json

RUNS_DIR holds one folder per grid with its runs (bench_validate's --work/runs; the committed loops'
runs unpack from runs.tar.xz, see calibration/README.md), P the profile fitted from the same loop's
bench. The twin charges every compute op `host_op_s` before it (the profile's, for the grid's rank
count: the mean free gap of bench's recorded steps, median over its files with that many ranks), plus
the issue time of a collective issued just before it (twin.costs.kernels.host_times).

Per grid, from each run's traced step, each rank's gaps between consecutive compute ops
(twin.present.trace.host_gaps), pooled over the ranks and the runs:
- `free`: the gaps with no collective of the rank in flight, their median and mean (ms), and the
  mean over host_op_s;
- `AG`, `RS`: the mean (ms) of the gaps with only all-gathers (reduce-scatters) in flight and none
  issued or completed in them (blank under 20 such gaps);
- `short`: what the twin's host time misses of these gaps, (their sum - their count x host_op_s) per
  rank over the traced step: the share of the step the twin's host time leaves out.
With --bench, per bench file the same from its recorded steps' host row, beside each file's stretch
(summed span over summed on-CPU time of the compute ops) and the time per step a rank spent
descheduled inside its compute ops (span - on-CPU) against inside its free gaps (count x (mean -
median); the median gap is the host's own work).

Measured (2026-12-02):
- bench of cpu-2026-12-02g: the free gaps' median is 0.03-0.11 ms on every grid of 1-8 ranks (the
  host's own work); their mean with 8 ranks runs 2.08-2.24 ms on 1x1x1x8, 1.76-2.13 on 1x1x8x1,
  1.53-1.73 on 8x1x1x1, 0.79-0.88 on 2x2x2x1 and 0.83-0.87 on 4x2x1x1 (host_op_s 1.63 ms): set by the
  gaps in which the rank was descheduled. Per ms of the rank's own work the gaps take far more of it
  than the compute ops do: on 1x1x1x8 a step's gaps hold 241-259 ms of descheduling on about 12 ms of
  host work, its compute ops 142-145 ms on 125 ms of on-CPU time; on 8x1x1x1 89-101 against 511-528
  ms (on about 310 ms).
- runs of cpu-2026-12-02g (02f in brackets): the twin's host time leaves out 8.5 % (7.1 %) of
  1x1x1x8's step, whose iteration it predicts 8 % (11 %) short; on the other grids from -3.8 % to
  +4.6 % (-4.6 % to +3.3 %). The free mean per grid with 8 ranks
  runs 0.48-1.36 times host_op_s (0.44-1.27). Beside an all-gather in flight, the z = 4 grids' gaps
  take 2.61 ms (1x1x4x2), 2.78 (1x2x4x1) and 2.73 (4x1x2x1) with 8 ranks, 1x1x8x1's 2.30 (2.40, 2.84,
  2.17 in 02f), where bench's 1x1x8x1 took 2.01-2.04 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration.measurements import COLLECTIVES  # noqa: E402
from calibration.validate_measured import read_run  # noqa: E402
from twin.present.trace import host_gaps  # noqa: E402

MIN_BUSY = 20  # gaps of one kind in flight, pooled over a grid's ranks and runs, to print their mean
BENCH_STEPS = 4  # training steps a bench file records (backend/bench/bench.py's default, as bench_validate runs it)


def _ms(seconds: float | None) -> str:
    """A gap's mean in ms for the tables, blank where too few gaps were seen (None)."""
    return " " * 6 if seconds is None else f"{seconds * 1e3:6.2f}"


def run_gaps(run_dir: Path) -> tuple[int, list, float]:
    """(ranks, every rank's host gaps, mean traced step s) of one run."""
    spans = read_run(run_dir)["spans"]
    by_rank: dict[int, list] = {}
    for s in spans:
        by_rank.setdefault(s.rank, []).append(s)
    gaps, steps = [], []
    for mine in by_rank.values():
        comp = sorted((s for s in mine if s.stream == "compute" and s.kind not in COLLECTIVES), key=lambda s: s.start_s)
        colls = [s for s in mine if s.kind in COLLECTIVES]
        gaps += host_gaps(comp, colls)
        steps.append(max(s.start_s + s.duration_s for s in mine) - min(s.start_s for s in mine))
    return len(by_rank), gaps, statistics.fmean(steps)


def grid_row(runs: list[Path], host_of) -> str:
    ranks, gaps, steps = 0, [], []
    for d in runs:
        ranks, g, step = run_gaps(d)
        gaps += g
        steps.append(step)
    host = host_of(ranks)
    free = [g.seconds for g in gaps if g.seconds > 0 and not g.in_flight]
    kind = {k: [g.seconds for g in gaps if g.seconds > 0 and g.quiet and g.in_flight == {k}]
            for k in ("all_gather", "reduce_scatter")}
    counted = free + kind["all_gather"] + kind["reduce_scatter"]
    short = (sum(counted) - len(counted) * host) / (ranks * len(runs)) / statistics.fmean(steps)
    mean = {k: statistics.fmean(v) if len(v) >= MIN_BUSY else None for k, v in kind.items()}
    return (f"{runs[0].parent.name:9} {ranks:5} {host * 1e3:8.2f} {statistics.median(free) * 1e3:7.2f} "
            f"{statistics.fmean(free) * 1e3:7.2f} {statistics.fmean(free) / host:6.2f}  {_ms(mean['all_gather'])} "
            f"{_ms(mean['reduce_scatter'])} {short:+7.1%}")


def bench_row(path: str) -> str:
    r = json.loads(Path(path).read_text())
    host = next(row for row in r["ops"] if row["op"] == "host")
    comp = [row for row in r.get("steps", []) if row["stream"] == "compute" and row["kind"] not in COLLECTIVES]
    span, cpu = sum(row["seconds"] for row in comp), sum(row.get("cpu_s", 0.0) for row in comp)
    in_gaps = host["ops"] * (host["free_mean_s"] - host["seconds"]) / BENCH_STEPS  # per rank, per step
    busy = host.get("busy_by_kind_s", {})
    n = host.get("busy_by_kind_gaps", {})
    mean = {k: busy[k] if n.get(k, 0) >= 5 else None for k in ("all_gather", "reduce_scatter")}
    return (f"{Path(path).name:24} {r['ranks']:5} {span / cpu if cpu else 0:7.2f} {host['seconds'] * 1e3:7.2f} "
            f"{host['free_mean_s'] * 1e3:7.2f}  {_ms(mean['all_gather'])} {_ms(mean['reduce_scatter'])} "
            f"{(span - cpu) * 1e3:8.0f} {in_gaps * 1e3:8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="?", help="folder of run folders, one per grid (bench_validate's --work/runs)")
    ap.add_argument("--profile", help="the loop's fitted profile (its host_op_s per rank count)")
    ap.add_argument("--bench", nargs="+", default=[], help="bench files (backend bench --out) to read instead")
    a = ap.parse_args()
    if a.bench:
        print(f"{'bench file':24} {'ranks':>5} {'stretch':>7} {'median':>7} {'mean':>7}  {'AG':>6} {'RS':>6} "
              f"{'in ops':>8} {'in gaps':>8}   (gaps in ms; descheduled per step, ms)")
        for path in a.bench:
            print(bench_row(path))
        return
    if not (a.runs and a.profile):
        ap.error("give RUNS_DIR and --profile, or --bench FILES")
    from twin.costs.profile import load_profile
    prof = load_profile(a.profile)
    print(f"{'grid':9} {'ranks':>5} {'host_op':>8} {'median':>7} {'mean':>7} {'/host':>6}  {'AG':>6} {'RS':>6} "
          f"{'short':>7}   (gaps in ms)")
    for grid in sorted(Path(a.runs).iterdir(), key=lambda p: (p.name.count("x"), p.name)):
        runs = sorted(f.parent for f in grid.rglob("log.jsonl"))
        if runs:
            print(grid_row(runs, lambda r: prof.for_ranks(r).host_op_s))


if __name__ == "__main__":
    main()
