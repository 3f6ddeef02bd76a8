"""Collectives inside CPU training: how long a rank waits for its group's last member, and what predicts it.

    python benchmarks/cpu_collective_wait.py /work/bv-work/runs /work/bv-work2/runs /work/bv-work3/runs

Each argument is the runs/ folder of one calibration loop (benchmarks/bench_validate.py), every grid's
traced step with every rank's spans on one clock. Offline, about a minute for three loops.

The twin runs a group's members in lockstep: they arrive at a collective together, and what a
collective costs inside training beyond its line measured alone is one excess per op, fitted per
kind, axis and group size (calibration/fit.py). Measured, ranks time-sliced on shared cores arrive
apart and the early ones wait. Per class (rank count, group size, axis, kind) and loop this prints
- the share of the collectives' summed span that is the wait for the last member (mean over ranks,
  as validation takes it), and its correlation over the ops with the compute the rank ran between
  the group's previous collective on that axis and this one (`compute before`, what the twin knows);
and then, over all classes, the per-op error of the collectives' spans when their measured wait is
replaced by a prediction and the rest kept as measured (which isolates the wait): the class' mean
wait (the twin's form) against a line in the compute before (a + b x compute, b >= 0), each fitted on
one loop and tested on every loop (median over grids of the median |error| over a grid's collectives).

What it showed on cpu-2026-12-01b, -01c and -01d: the line beats the mean on every pair of loops
(14.2-18.8 % against 16.0-20.7 %). Put into the twin (each class' excess fitted from bench's recorded
steps as a part per op plus a part per second of compute before, the engine adding it per op), the
collectives' per-op median improved on all three loops (30.7 -> 30.4, 38.1 -> 34.1, 38.0 -> 36.3 %)
but the whole per-op median (+0.3, -0.5, -0.1 points) and the grid ranking (01b: Spearman 0.926 ->
0.912) did not: the wait is half of a collective's error, the rest its time after the last arrival.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration.validate_measured import COLLECTIVES, _group  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.present.trace import read_trace  # noqa: E402


def collective_rows(run_dir: Path) -> list[dict]:
    """Per collective of a run's traced step (means over its ranks): span, wait for the last member,
    and the compute before it (wall seconds of the rank's compute ops since the previous collective
    of its axis completed, or since the step's start)."""
    grid = Grid.parse(run_dir.name)
    spans = read_trace(run_dir / "trace")
    start = {(s.name, s.rank): s.start_s for s in spans if s.kind in COLLECTIVES}
    per: dict[str, list[tuple]] = {}
    for rank in {s.rank for s in spans}:
        mine = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start_s)
        t0 = mine[0].start_s
        comp = [s for s in mine if s.kind not in COLLECTIVES]
        done: dict[str, float] = {}
        for s in mine:
            axis = s.args.get("axis")
            if s.kind not in COLLECTIVES or axis not in ("x", "y", "z", "data"):
                continue
            prev = done.get(axis, t0)
            before = sum(min(c.start_s + c.duration_s, s.start_s) - max(c.start_s, prev) for c in comp
                         if c.start_s < s.start_s and c.start_s + c.duration_s > prev)
            last = max(start.get((s.name, q), s.start_s) for q in _group(grid, rank, axis))
            wait = min(max(last - s.start_s, 0.0), s.duration_s)
            per.setdefault(s.name, []).append((s.kind, axis, s.duration_s, wait, before))
            done[axis] = max(prev, s.start_s + s.duration_s)
    return [{"grid": run_dir.name, "ranks": grid.size, "p": grid.axis_size(v[0][1]), "kind": v[0][0], "axis": v[0][1],
             "span": statistics.fmean(x[2] for x in v), "wait": statistics.fmean(x[3] for x in v),
             "before": statistics.fmean(x[4] for x in v)} for v in per.values()]


def _cls(r: dict) -> tuple:
    return (r["ranks"], r["p"], r["axis"], r["kind"])


def _corr(a: list[float], b: list[float]) -> float:
    if len(a) < 3:
        return float("nan")
    c = np.corrcoef(a, b)[0, 1]
    return float(c)


def fit_waits(rows: list[dict]) -> dict[tuple, dict[str, tuple[float, float]]]:
    """Per class: {"mean": (mean wait, 0), "line": (a, b)} with wait ~ a + b x compute before (least
    squares, b >= 0; both keep the class' summed wait)."""
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        by.setdefault(_cls(r), []).append(r)
    out = {}
    for k, sel in by.items():
        w = np.array([r["wait"] for r in sel])
        c = np.array([r["before"] for r in sel])
        a, b = float(w.mean()), 0.0
        if len(sel) >= 3 and np.ptp(c) > 0:
            (a2, b2), *_ = np.linalg.lstsq(np.stack([np.ones_like(c), c], axis=1), w, rcond=None)
            if b2 > 0:
                a, b = float(a2), float(b2)
        out[k] = {"mean": (float(w.mean()), 0.0), "line": (a, b)}
    return out


def wait_error(rows: list[dict], models: dict, which: str) -> float | None:
    """Median over grids of the median |error| of the collectives' spans, the measured wait replaced by
    the model's (the rest of the span as measured)."""
    per: dict[str, list[float]] = {}
    for r in rows:
        m = models.get(_cls(r))
        if m is None or r["span"] <= 0:
            continue
        a, b = m[which]
        pred = r["span"] - r["wait"] + max(a + b * r["before"], 0.0)
        per.setdefault(r["grid"], []).append(abs(pred / r["span"] - 1))
    return statistics.median(statistics.median(v) for v in per.values()) if per else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="runs/ folders of calibration loops")
    a = ap.parse_args()
    loops = {}
    for d in a.runs:
        runs = sorted(p for p in Path(d).iterdir() if (p / "trace").is_dir())
        loops[d] = [r for run in runs for r in collective_rows(run)]
    print(f"{'class (ranks p axis kind)':32s}" + "".join(f"{'wait share':>12s}{'corr':>6s}" for _ in loops))
    for k in sorted({_cls(r) for rows in loops.values() for r in rows}):
        line = f"{k[0]:3d} {k[1]:2d} {k[2]:5s} {k[3]:18s}"
        for rows in loops.values():
            sel = [r for r in rows if _cls(r) == k]
            share = sum(r["wait"] for r in sel) / max(sum(r["span"] for r in sel), 1e-12) if sel else float("nan")
            line += f"{share:12.2f}{_corr([r['wait'] for r in sel], [r['before'] for r in sel]):6.2f}"
        print(line)
    print("\nthe collectives' span error with the wait predicted (rest as measured): fitted on a loop, tested on each")
    names = list(loops)
    for fit_on in names:
        models = fit_waits(loops[fit_on])
        print(f"fit on {fit_on}:")
        for test in names:
            m, ln = wait_error(loops[test], models, "mean"), wait_error(loops[test], models, "line")
            print(f"   {test}: class mean wait {m:.1%}, line in the compute before {ln:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
