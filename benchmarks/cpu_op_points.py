"""In-training op times on CPU: each op's span, or its on-CPU time x the rank count's stretch?

    python benchmarks/cpu_op_points.py /work/bv-work2/runs \\
        --bench calibration/measurements/cpu-2026-12-01c          # the loop's runs and bench files

`backend bench` records a few training steps on a few grids per rank count, and calibration turns
every compute op it saw into the twin's cost of that op for every grid with as many ranks. With more
ranks than cores, a rank descheduled inside an op leaves that op's span long and the next one short,
and each grid time-slices its own way (8 ranks: a stretch, summed span over summed on-CPU time of a
rank's compute ops, of 1.9-3.1 over the 35 runs of cpu-2026-12-01c).

Bench files written before bench recorded on-CPU times (`cpu_s`) cannot tell the two apart, but the
loop's runs record both (the trace's cpu_us). This rewrites the bench files' compute step rows from
the runs of the same grids (their traced step, every rank: span and on-CPU time means over ranks,
`covered` as bench computes it; collectives, host gaps and microbenchmarks as measured), fits a
profile from them twice, with the spans alone and with the on-CPU times (calibration.training.fluid_spans),
and validates every run against each: the issue's measures, for the benched grids (in sample) and
the others (out of sample). Offline, about 20 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def rewrite(bench: dict, run_dir: Path, with_cpu: bool) -> dict:
    """`bench` with its compute step rows measured in the run at `run_dir` instead."""
    from calibration.validate_measured import COLLECTIVES
    from twin.present.trace import covered_share, read_trace
    spans = read_trace(run_dir / "trace")
    per: dict[str, list[tuple[float, float, float]]] = {}
    for rank in {s.rank for s in spans}:
        mine = [s for s in spans if s.rank == rank]
        colls = [s for s in mine if s.kind in COLLECTIVES]
        for s in mine:
            if s.kind not in COLLECTIVES:
                cpu = min(s.args.get("cpu_us", s.duration_s * 1e6) / 1e6, s.duration_s)
                per.setdefault(s.name, []).append((s.duration_s, cpu, covered_share(s, colls)))
    rows = []
    for row in bench["steps"]:
        row = {k: v for k, v in row.items() if k != "cpu_s"}
        got = per.get(row["name"])
        if row["stream"] == "compute" and got:
            row.update(seconds=statistics.mean(w for w, _, _ in got),
                       covered=statistics.median(c for _, _, c in got))
            if with_cpu:
                row["cpu_s"] = statistics.mean(c for _, c, _ in got)
        rows.append(row)
    return {**bench, "steps": rows}


def main() -> int:
    from bench_validate import BENCH_GRIDS, summary_line
    from calibration.fit import fit_profile
    from calibration.validate import validate_runs
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", help="the runs/ folder of a bench_validate.py loop")
    ap.add_argument("--bench", required=True, help="the loop's measurement files (bench-GRID.json)")
    a = ap.parse_args()
    runs = sorted(d for d in Path(a.runs).iterdir() if (d / "log.jsonl").exists())
    order = [g for grids in BENCH_GRIDS.values() for g, _ in grids]
    files = [Path(a.bench) / f"bench-{g}.json" for g in order if (Path(a.bench) / f"bench-{g}.json").exists()]
    missing = [f.stem[6:] for f in files if not (Path(a.runs) / f.stem[6:] / "trace").is_dir()]
    if not runs or not files or missing:
        sys.exit(f"need the loop's runs and bench files (runs of the benched grids missing: {missing})")
    benched = {f.stem[6:] for f in files}
    with tempfile.TemporaryDirectory() as d:
        for label, with_cpu in (("spans", False), ("on-CPU time x stretch", True)):
            paths = []
            for f in files:
                p = Path(d) / f"{label[:5]}-{f.name}"
                p.write_text(json.dumps(rewrite(json.loads(f.read_text()), Path(a.runs) / f.stem[6:], with_cpu)))
                paths.append(p)
            prof = Path(d) / f"cpu-{with_cpu}.toml"
            prof.write_text(fit_profile(paths, "cpu").toml)
            rep = validate_runs(runs, "cpu", str(prof))
            print(f"in-training op times from {label}:")
            for what, sel in (("all grids", rep["runs"]),
                              ("benched grids (in sample)", [r for r in rep["runs"] if r["grid"] in benched]),
                              ("other grids (out of sample)", [r for r in rep["runs"] if r["grid"] not in benched])):
                print("  " + summary_line(what, sel))
            kinds = sorted({k for r in rep["runs"] for k in r["ops"]["by_kind"]})
            print("  per kind, median over runs of |error|: " + ", ".join(
                f"{k} {100 * statistics.median(r['ops']['by_kind'][k]['median_abs_error'] for r in rep['runs'] if k in r['ops']['by_kind']):.0f} %"
                for k in kinds) + f"; Spearman {rep['spearman']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
