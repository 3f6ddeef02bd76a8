"""How close to 15 % any model can come on this machine: the CPU loop's own measurement noise.

    python benchmarks/cpu_noise_floor.py                 # the committed loops with repeats
    python benchmarks/cpu_noise_floor.py calibration/measurements/cpu-2026-12-01j

Reads each loop's report.json (every run's iteration time, `measured_each_s`) and, where the loop
benched in two or more passes, its bench files, and prints per loop:
- the runs' noise: the standard deviation of log(run time) among the repeats of a grid (pooled over
  the grids: root mean square), so 0.10 is about 10 % per run;
- measured against measured: the median of half the repeats (odd passes) against the other half
  (even passes), and how many grids agree within 15 %; no model is involved;
- the bench's noise, where it ran in passes: the iteration the recorded steps of a grid imply
  (benchmarks/cpu_iteration.py replayed_steps), pass against pass;
- what a perfect model can expect: a model that predicts each grid's true mean exactly, judged
  against the median of R runs with the noise measured above (Monte Carlo, log-normal, grids
  independent): the expected count of 35 within 15 % and the chance that all are, for R = 3 to 12.
  That ignores the profile's own noise (it is fitted from bench passes that carry the same noise),
  so it is an upper bound on what the loop can show; and the same with the profile's noise added
  (the bench's pass-to-pass noise over the count of passes, as if each grid's prediction carried it
  independently).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from calibration.noise import TARGET, exact_model, halves, run_noise  # noqa: E402

MEAS = ROOT / "calibration" / "measurements"
LOOPS = ["cpu-2026-12-01g", "cpu-2026-12-01h", "cpu-2026-12-01i", "cpu-2026-12-01j", "cpu-2026-12-01k"]


def bench_noise(folder: Path) -> tuple[float, int] | None:
    """sd of log(replayed iteration) of one bench pass, from grids benched in two passes, and the count."""
    from cpu_iteration import replayed_steps
    diffs = []
    for f in sorted(folder.glob("bench-*.json")):
        if "-p" in f.stem:
            continue
        second = f.with_name(f.stem + "-p2.json")
        if second.exists():
            a, b = replayed_steps(json.loads(f.read_text())), replayed_steps(json.loads(second.read_text()))
            if a and b:
                diffs.append(math.log(a / b))
    if len(diffs) < 2:
        return None
    return math.sqrt(statistics.fmean(d * d for d in diffs) / 2), len(diffs)  # a difference holds two passes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("loops", nargs="*", help="measurement folders with report.json (default: the committed loops)")
    a = ap.parse_args()
    folders = [Path(p) for p in a.loops] or [MEAS / n for n in LOOPS if (MEAS / n / "report.json").exists()]
    sigmas, benches = [], []
    for folder in folders:
        rep = json.loads((folder / "report.json").read_text())
        runs = [r for r in rep["runs"] if len(r["iteration"].get("measured_each_s", [])) > 1]
        if not runs:
            print(f"{folder.name}: one run per grid, no noise to measure")
            continue
        times = [r["iteration"]["measured_each_s"] for r in runs]
        sigma = run_noise(times)
        sigmas.append(sigma)
        within = sum(abs(r["iteration"]["error"]) <= TARGET for r in rep["runs"])
        agree, n = halves(times)
        bench = bench_noise(folder)
        if bench:
            benches.append(bench[0])
        print(f"{folder.name}: {len(rep['runs'])} grids x {rep.get('repeats_per_grid', '?')} runs; the twin: "
              f"{within} within 15 %; runs' noise {sigma:.3f} (log sd per run); odd passes against even "
              f"passes: {agree} of {n} within 15 %"
              + (f"; bench pass against pass: {bench[0]:.3f} (log sd per pass, {bench[1]} grids)" if bench else ""))
    if not sigmas:
        return 1
    grids = 35
    print(f"\na model exact on every grid's mean, against the median of R runs ({grids} grids, 4,000 trials):")
    print(f"{'noise':>7s}" + "".join(f"{'R=' + str(r):>16s}" for r in (3, 4, 6, 8, 12)))
    for sigma in sorted({min(sigmas), statistics.median(sigmas), max(sigmas)}):
        cells = [exact_model(sigma, r, grids) for r in (3, 4, 6, 8, 12)]
        print(f"{sigma:7.3f}" + "".join(f"{e:6.1f}, all {p:4.0%}" for e, p in cells))
    print("(each cell: the expected count within 15 %, and the chance that all are)")
    if benches:
        b = statistics.median(benches)
        sigma = statistics.median(sigmas)
        print(f"\nthe same with the profile's noise too: a grid's prediction off by the bench's noise over B passes "
              f"({b:.3f} / sqrt(B), grids independent), runs' noise {sigma:.3f}:")
        print(f"{'B':>7s}" + "".join(f"{'R=' + str(r):>16s}" for r in (3, 4, 6, 8, 12)))
        for passes in (1, 2, 4):
            cells = [exact_model(sigma, r, grids, profile_sd=b / math.sqrt(passes)) for r in (3, 4, 6, 8, 12)]
            print(f"{passes:7d}" + "".join(f"{e:6.1f}, all {p:4.0%}" for e, p in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
