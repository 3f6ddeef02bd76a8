"""Can a reference measurement taken around a CPU run tell how fast the machine was during it?

    python benchmarks/cpu_speed_probe.py                       # 1x1x1x1 and 2x1x1x1, 8 runs each, ~3 min
    python benchmarks/cpu_speed_probe.py --grids 2x2x2x1 --runs 6

If it could, the twin's prediction (made at the speed the profile was benched at) could be scaled to
the speed of each run, and this VM's run-to-run noise (about 9 % per run, benchmarks/cpu_noise_floor.py)
would drop out of the calibration loop. Each run (`backend run --model gpt-small --steps 6 --warmup 1`,
median of steps 3-6) is bracketed by a probe: one process per core at once, each timing a fixed
workload on one thread (a 512x768x768 GEMM, an elementwise pass over 3M floats, a pure-Python loop
of 10^5 additions; median of 15 repeats), averaged over the cores and over the probes before and
after. Prints per run the iteration and the probe, and per grid the correlation between them (over
the runs) and the spread of each. Timings depend on the machine's load: run it with nothing else.

What it found on the 2-core development VM (2026-12-01 22:00 UTC, quiet, the defaults): 1x1x1x1
0.487 s, spread 5.5 %, correlation with the GEMM probe +0.31, the elementwise one +0.17, the Python
one +0.14; 2x1x1x1 0.966 s, spread 19 % (one run of 1.38 s among 0.80-1.04 s), +0.65, -0.03, +0.20.
An earlier draft of the same probe (21:03 UTC): 1x1x1x1 spread 9.9 %, r = +0.12, +0.33, +0.17. Too
weak to scale a prediction by: the speed a run gets is not the speed of the seconds around it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_run_spread import one_run  # noqa: E402  (one `backend run`, its iteration: steps 3-6's median)

KINDS = ("gemm", "elementwise", "python")

PROBE = r'''
import json, time, torch
torch.set_num_threads(1)
a, b, x = torch.randn(512, 768), torch.randn(768, 768), torch.randn(4096, 768)
for _ in range(3):
    a @ b
times = {"gemm": [], "elementwise": [], "python": []}
for _ in range(15):
    t = time.perf_counter()
    for _ in range(4):
        a @ b
    times["gemm"].append(time.perf_counter() - t)
    t = time.perf_counter()
    torch.nn.functional.gelu(x) + x * 1.5
    times["elementwise"].append(time.perf_counter() - t)
    t = time.perf_counter()
    s = 0
    for i in range(100000):
        s += i
    times["python"].append(time.perf_counter() - t)
print(json.dumps({k: sorted(v)[len(v) // 2] for k, v in times.items()}))
'''


def probe() -> dict[str, float]:
    """Seconds of each probe workload, one process per core at once, averaged over the cores."""
    procs = [subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True)
             for _ in range(os.cpu_count() or 1)]
    outs = [json.loads(p.communicate()[0]) for p in procs]
    return {k: statistics.fmean(o[k] for o in outs) for k in KINDS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grids", default="1x1x1x1,2x1x1x1", help="grids, comma-separated (alternated)")
    ap.add_argument("--runs", type=int, default=8, help="runs per grid")
    a = ap.parse_args()
    grids = a.grids.split(",")
    rows: dict[str, list[tuple[float, dict[str, float]]]] = {g: [] for g in grids}
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(a.runs):
            for g in grids:
                before = probe()
                it = one_run("gpt-small", g, 6, "none", Path(tmp) / g / str(k))["iteration_s"]
                after = probe()
                p = {kind: (before[kind] + after[kind]) / 2 for kind in KINDS}
                rows[g].append((it, p))
                print(f"{g} run {k + 1}: iteration {it:.3f} s; probe " + ", ".join(
                    f"{kind} {before[kind] * 1e3:.2f}/{after[kind] * 1e3:.2f} ms" for kind in KINDS), flush=True)
    print("\nper grid: the runs' spread (sd/mean) and, per probe workload, its spread and its correlation "
          "with the iteration over the runs")
    for g, r in rows.items():
        its = [it for it, _ in r]
        parts = []
        for kind in KINDS:
            vals = [p[kind] for _, p in r]
            parts.append(f"{kind} {statistics.stdev(vals) / statistics.fmean(vals):.1%}, r = {statistics.correlation(its, vals):+.2f}")
        print(f"{g}: iteration {statistics.fmean(its):.3f} s, spread {statistics.stdev(its) / statistics.fmean(its):.1%}; "
              + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
