"""The collective model against 560 measured RCCL/NCCL all-gathers and reduce-scatters.

    python benchmarks/bench_measured_collectives.py            # every row, then the summaries
    python benchmarks/bench_measured_collectives.py --summary  # the summaries only

The rows are docs/reference/measured-collectives.csv (Singh et al. 2025, Frontier RCCL and Perlmutter
NCCL; docs/reference/measured-collectives.md): one group of `gpus` consecutive ranks on whole nodes,
nothing else running. The twin predicts each with its collective model on the same group (grid
Gx1x1x1, the x axis, contiguous nodes, adaptive routing) and prints bus bandwidth, (g - 1) x the
per-rank shard / time, predicted against measured.

Each set of rows is compared with the system's collective figures that describe its software
("matched"): Frontier's newest set (fr_reduce_scatter) and Perlmutter's sets with the default
figures, Frontier's four older sets with the "rccl-2025-early" variant. The summaries also give the
default figures against every row, and AxoNN's table ("axonn-table") against every row.

Targets (rows with at least 1 MB per rank): median |error| within 15%, and the median error of every
(system, collective, group size) within 25%.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections import defaultdict
from pathlib import Path

from topologies.system import load_system
from twin.costs.collectives import CollectiveModel
from twin.program.grid import Grid

DATA = Path(__file__).resolve().parents[1] / "docs" / "reference" / "measured-collectives.csv"
# the collective figures that describe each set's software (the system files say why)
MATCHED = {("frontier", "fr_reduce_scatter"): "frontier",
           **{("frontier", s): "frontier:rccl-2025-early"
              for s in ("all_gather", "all_gather_2", "reduce_scatter", "reduce_scatter_2")},
           ("perlmutter", "pm_all_gather"): "perlmutter", ("perlmutter", "pm_all_gather_2"): "perlmutter"}
MIN_SHARD = 1e6  # bytes per rank of the target rows


def load_rows(path: Path = DATA) -> list[dict]:
    """The measured rows: system, run_set, collective, gpus, shard (bytes per rank), payload (bytes,
    as twin ops count them: the gathered buffer, or the reduce-scatter's input) and busbw (bytes/s)."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            g, mb = int(r["gpus"]), float(r["output_mb"]) * 1e6
            payload = mb if r["collective"] == "all_gather" else mb * g
            out.append(dict(system=r["system"], run_set=r["run_set"], collective=r["collective"], gpus=g,
                            shard=payload / g, payload=payload, busbw=float(r["busbw_gb_s"]) * 1e9))
    return out


def predicted_busbw(system_name: str, collective: str, gpus: int, payload: float, models: dict) -> float:
    """Bus bandwidth (bytes/s) the twin predicts for one group of `gpus` consecutive ranks."""
    key = (system_name, gpus)
    if key not in models:
        models[key] = CollectiveModel(load_system(system_name), Grid(gpus, 1, 1, 1))
    t = models[key].time(collective, "x", int(payload))
    return (gpus - 1) * payload / gpus / t


def summary(label: str, errors: dict) -> bool:
    """Print the median and worst |error| and each group's median; True when both targets are met."""
    flat = [e for v in errors.values() for e in v]
    med = statistics.median(abs(e) for e in flat)
    worst = max(flat, key=abs)
    groups = {k: statistics.median(v) for k, v in errors.items()}
    bad = {k: g for k, g in groups.items() if abs(g) > 0.25}
    ok = med <= 0.15 and not bad
    print(f"\n{label}: {len(flat)} rows with >= 1 MB per rank; median |error| {100 * med:.1f}%, "
          f"worst {100 * worst:+.1f}%; {'targets met' if ok else 'TARGETS MISSED'}")
    by_collective = defaultdict(list)
    for (s, c, g), m in sorted(groups.items()):
        by_collective[s, c].append(f"{g} {100 * m:+.0f}%")
    for (s, c), items in by_collective.items():
        print(f"  median by group size, {s} {c}: " + ", ".join(items))
    if bad:
        print("  over 25%: " + ", ".join(f"{s} {c} {g} ({100 * m:+.0f}%)" for (s, c, g), m in sorted(bad.items())))
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summary", action="store_true", help="print the summaries only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows, models = load_rows(), {}
    matched, default, table = defaultdict(list), defaultdict(list), defaultdict(list)
    if not args.summary:
        print(f"{'system':10s} {'set':17s} {'collective':14s} {'gpus':>5s} {'shard MB':>9s} "
              f"{'measured':>9s} {'twin':>7s} {'error':>7s}  (GB/s; figures)")
    for r in rows:
        name = MATCHED[r["system"], r["run_set"]]
        bw = predicted_busbw(name, r["collective"], r["gpus"], r["payload"], models)
        err = bw / r["busbw"] - 1 if r["busbw"] > 0 else float("inf")
        target = r["shard"] >= MIN_SHARD * (1 - 1e-3)
        if not args.summary:
            print(f"{r['system']:10s} {r['run_set']:17s} {r['collective']:14s} {r['gpus']:5d} "
                  f"{r['shard'] / 1e6:9.3f} {r['busbw'] / 1e9:9.1f} {bw / 1e9:7.1f} "
                  f"{100 * err:+6.0f}%{'' if target else '  (< 1 MB)'}  {name}")
        if target:
            key = (r["system"], r["collective"], r["gpus"])
            matched[key].append(err)
            d = predicted_busbw(r["system"], r["collective"], r["gpus"], r["payload"], models)
            default[key].append(d / r["busbw"] - 1)
            a = predicted_busbw(f"{r['system']}:axonn-table", r["collective"], r["gpus"], r["payload"], models)
            table[key].append(a / r["busbw"] - 1)
    summary("each set against the figures that describe it (matched)", matched)
    summary("the default figures against every row", default)
    summary("AxoNN's table (axonn-table) against every row", table)
    print(f"\n({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
