"""The CPU model's consistent per-grid errors: every loop revalidated offline, each against a profile
fitted from its own bench files, and each grid's error across the loops.

    python benchmarks/cpu_bias.py                       # the seven quiet loops, about 10 min
    python benchmarks/cpu_bias.py --json /tmp/after.json --compare /tmp/before.json

A single run per grid carries about +-15 % of per-process noise (the same grid run twice minutes
apart); it averages out across loops, while what the model gets wrong repeats in every loop. Prints,
per grid, the iteration error in each loop, its mean (the grid's bias) and spread (sd across loops),
the measured and predicted stretch (wall over on-CPU time of the compute ops) averaged over the loops;
per op kind, the error of its summed time (predicted over measured, summed over the ops of a run),
its mean over the grids in each loop; per grid and kind, the mean over loops of that error for the
grids with the largest biases; and per loop the issue's measures: iteration median |error|, grids
within 15 %, worst, per-op median (median over runs) and Spearman. --json writes all of it;
--compare prints an earlier --json's figures beside (the model before a change).
Loops: NAME=RUNS:BENCH (RUNS: the loop's runs/ folder; BENCH: the measurement folder whose
bench-*.json files the profile is fitted from; 01f was run against 01e's bench, 01h against 01g's).
A grid's folder holds one run (01b-01f) or repeats r1, r2, ... (01g, 01h: three interleaved runs),
pooled at their median as `twin validate` does (calibration.validate.pool_repeats).
Over the seven loops, before and after the host time per collective issued where the ranks do not
outnumber the cores (twin.costs.kernels.host_times, Profile.host_issue_s): median |bias| 3.5 -> 3.4 %,
grids beyond 8 %: 3 -> 2, worst 1x1x2x1 -11.4 % (now -4.7 %) -> 1x4x2x1 +9.8 % (unchanged).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from calibration.validate import validate_run  # noqa: E402
from calibration.validate_summary import pool_repeats, spearman  # noqa: E402

MEAS = ROOT / "calibration" / "measurements"
LOOPS = [f"01b=/work/bv-work/runs:{MEAS}/cpu-2026-12-01b",
         f"01c=/work/bv-work2/runs:{MEAS}/cpu-2026-12-01c",
         f"01d=/work/bv-work3/runs:{MEAS}/cpu-2026-12-01d",
         f"01e=/work/bv-work4/runs:{MEAS}/cpu-2026-12-01e",
         f"01f=/work/bv-work5/runs:{MEAS}/cpu-2026-12-01e",
         f"01g=/work/bv-work7/runs:{MEAS}/cpu-2026-12-01g",
         f"01h=/work/bv-work8/runs:{MEAS}/cpu-2026-12-01g"]


def _order(g: str) -> tuple:
    a = [int(v) for v in g.split("x")]
    return (a[0] * a[1] * a[2] * a[3], g)


def loop_rows(runs: Path, bench: Path) -> dict[str, dict]:
    """Per grid, what validate_run reports against the profile fitted from `bench`, boiled down."""
    from calibration.fit import fit_profile
    files = sorted(bench.glob("bench-*.json"))
    out = {}
    with tempfile.TemporaryDirectory() as d:
        prof = Path(d) / "cpu.toml"
        prof.write_text(fit_profile(files, "cpu").toml)
        for run in sorted(runs.iterdir(), key=lambda p: _order(p.name)):
            repeats = [run] if (run / "log.jsonl").exists() else sorted(
                d for d in run.iterdir() if d.is_dir() and (d / "log.jsonl").exists())
            if not repeats:
                continue
            r = pool_repeats([validate_run(d, profile=str(prof)) for d in repeats])
            kinds = {k: {"measured_s": v["measured_s"], "predicted_s": v["predicted_s"],
                         "median_abs_error": v["median_abs_error"]} for k, v in r["ops"]["by_kind"].items()}
            out[r["grid"]] = {"measured_s": r["iteration"]["measured_s"], "predicted_s": r["iteration"]["predicted_s"],
                              "error": r["iteration"]["error"], "op_median": r["ops"]["median_abs_error"],
                              "stretch": r["ops"]["stretch"],
                              # the grid's own stretch (twin.host.cores), else the profile's pooled one
                              "stretch_predicted": r["ops"]["stretch_predicted"] or r["ops"]["stretch_profile"] or 1.0,
                              "kinds": kinds}
    return out


def loop_summary(rows: dict[str, dict]) -> dict:
    errs = [abs(v["error"]) for v in rows.values()]
    return {"median": statistics.median(errs), "within": sum(e <= 0.15 for e in errs), "grids": len(errs),
            "worst": max(errs), "op_median": statistics.median(v["op_median"] for v in rows.values()),
            "spearman": spearman([v["predicted_s"] for v in rows.values()], [v["measured_s"] for v in rows.values()])}


def _mean_sd(v: list[float]) -> tuple[float, float]:
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


def report(data: dict, old: dict | None) -> dict:
    """Print the tables (module docstring); returns what --json writes."""
    names = list(data)
    grids = sorted(set.intersection(*(set(data[n]) for n in names)), key=_order)
    if old:  # the earlier figures over the same loops
        common = [n for n in names if n in old["loops"]]
        old = {"bias": {g: statistics.fmean(old["loops"][n][g]["error"] for n in common)
                        for g in grids if all(g in old["loops"][n] for n in common)},
               "summary": old["summary"]}
    print("iteration error per loop (predicted/measured - 1); bias = mean over loops, sd = spread across loops"
          + ("; old: the --compare file's bias" if old else ""))
    print(f"{'grid':9s}" + "".join(f"{n:>7s}" for n in names) + f"{'bias':>8s}{'sd':>6s}{'t':>6s}"
          + f"{'str.m':>7s}{'str.p':>7s}" + (f"{'old':>8s}" if old else ""))
    bias = {}
    for g in grids:
        e = [data[n][g]["error"] for n in names]
        m, sd = _mean_sd(e)
        bias[g] = m
        t = m / (sd / math.sqrt(len(e))) if sd > 0 else math.inf
        sm = statistics.fmean(data[n][g]["stretch"] or 1.0 for n in names)
        sp = statistics.fmean(data[n][g]["stretch_predicted"] for n in names)
        line = f"{g:9s}" + "".join(f"{x:+7.1%}" for x in e) + f"{m:+8.1%}{sd:6.1%}{t:+6.1f}{sm:7.2f}{sp:7.2f}"
        if old and g in old["bias"]:
            line += f"{old['bias'][g]:+8.1%}"
        print(line)
    b = list(bias.values())
    print(f"bias over the grids: median |bias| {statistics.median(map(abs, b)):.1%}, within 15 %: "
          f"{sum(abs(x) <= 0.15 for x in b)}/{len(b)}, beyond 8 %: {sum(abs(x) > 0.08 for x in b)}, worst "
          f"{max(b, key=abs):+.1%}; median spread "
          f"{statistics.median(_mean_sd([data[n][g]['error'] for n in names])[1] for g in grids):.1%}"
          + (f"  (old: median |bias| {statistics.median(map(abs, old['bias'].values())):.1%}, within 15 %: "
             f"{sum(abs(x) <= 0.15 for x in old['bias'].values())}, beyond 8 %: "
             f"{sum(abs(x) > 0.08 for x in old['bias'].values())}, worst {max(old['bias'].values(), key=abs):+.1%})"
             if old else ""))
    kinds = sorted({k for n in names for g in grids for k in data[n][g]["kinds"]})
    print("\nper op kind: summed predicted over summed measured - 1 of a run, mean over grids per loop; "
          "bias and sd across loops; median |error| of the kind's ops (median over runs and loops)")
    print(f"{'kind':15s}" + "".join(f"{n:>7s}" for n in names) + f"{'bias':>8s}{'sd':>6s}{'med|e|':>8s}")
    kind_bias = {}
    for k in kinds:
        per = []
        for n in names:
            v = [data[n][g]["kinds"][k] for g in grids if k in data[n][g]["kinds"]]
            per.append(statistics.fmean(x["predicted_s"] / x["measured_s"] - 1 for x in v if x["measured_s"] > 0))
        m, sd = _mean_sd(per)
        kind_bias[k] = m
        med = statistics.median(data[n][g]["kinds"][k]["median_abs_error"] for n in names for g in grids
                                if k in data[n][g]["kinds"])
        print(f"{k:15s}" + "".join(f"{x:+7.1%}" for x in per) + f"{m:+8.1%}{sd:6.1%}{med:8.1%}")
    top = sorted(grids, key=lambda g: -abs(bias[g]))[:12]
    print("\nthe largest biases by op kind: summed predicted/measured - 1 of the kind in the grid's run, "
          "mean over loops [the kind's measured share of the summed op time]")
    for g in top:
        parts = []
        tot = statistics.fmean(sum(x["measured_s"] for x in data[n][g]["kinds"].values()) for n in names)
        for k in kinds:
            v = [data[n][g]["kinds"][k] for n in names if k in data[n][g]["kinds"]]
            if v and all(x["measured_s"] > 0 for x in v):
                share = statistics.fmean(x["measured_s"] for x in v) / tot
                parts.append(f"{k} {statistics.fmean(x['predicted_s'] / x['measured_s'] - 1 for x in v):+.0%} [{share:.0%}]")
        print(f"  {g:9s}{bias[g]:+7.1%}: " + ", ".join(parts))
    print("\nper loop: iteration median |error|, within 15 %, worst, per-op median (median over runs), Spearman")
    summ = {}
    for n in names:
        s = summ[n] = loop_summary({g: data[n][g] for g in grids})
        line = (f"  {n}: {s['median']:5.1%}  {s['within']:2d}/{s['grids']}  worst {s['worst']:5.1%}  "
                f"per-op {s['op_median']:5.1%}  Spearman {s['spearman']:.3f}")
        if old and n in old["summary"]:
            o = old["summary"][n]
            line += (f"   (old: {o['median']:5.1%}  {o['within']:2d}  worst {o['worst']:5.1%}  per-op "
                     f"{o['op_median']:5.1%}  Spearman {o['spearman']:.3f})")
        print(line)
    return {"loops": data, "bias": bias, "kind_bias": kind_bias, "summary": summ}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", nargs="+", default=LOOPS, help="NAME=RUNS:BENCH ...")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--compare", type=Path, default=None, help="an earlier --json to print beside")
    a = ap.parse_args()
    data = {}
    for spec in a.loops:
        name, rest = spec.split("=", 1)
        runs, bench = rest.split(":", 1)
        if not Path(runs).is_dir() or not list(Path(bench).glob("bench-*.json")):
            print(f"skipping {name}: no runs at {runs} or no bench files at {bench}", file=sys.stderr)
            continue
        data[name] = loop_rows(Path(runs), Path(bench))
    if len(data) < 2:
        sys.exit("need two or more loops with runs and bench files")
    old = json.loads(a.compare.read_text()) if a.compare else None
    result = report(data, old)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
