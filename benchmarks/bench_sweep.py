"""A 200-point design-space sweep, serially and on Dask local workers: wall time and points per second.

The sweep: Frontier and Alps x NIC bandwidth (5 rates, 12.5-100 GB/s per direction) x GPU counts (256,
512, 1,024, 2,048, 4,096) x models (gpt-5b, gpt-10b, gpt-20b, gpt-40b), grid auto (simulate_top 1),
batch 1,024 sequences, time to train 1e12 tokens with checkpoints every 2 hours. Each run starts from a
cold process (its workers too) and writes its own results file; the rows of the runs are checked
equal. The machine may be shared with other work: repeat and read the spread.

    python benchmarks/bench_sweep.py [--workers 2] [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWEEP = """
name = "bench"
systems = ["frontier", "alps"]
models = ["gpt-5b", "gpt-10b", "gpt-20b", "gpt-40b"]
gpus = [256, 512, 1024, 2048, 4096]
batches = [1024]
simulate_top = 1
[overrides]
"node.nic_bandwidth" = [12.5e9, 25e9, 50e9, 75e9, 100e9]
[train]
tokens = 1e12
checkpoint_every_min = 120
checkpoint_write_min = 2
restart_min = 15
"""


def run(folder: Path, args: list[str]) -> tuple[float, float]:
    """Wall seconds of one `twin sweep` process, and the CPU seconds of it and its worker processes."""
    import resource
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "twin.cli", "sweep", str(folder / "bench.toml"), "--quiet", *args],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"twin sweep failed: {r.stderr[-2000:]}")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="Alternate the two runs this many times each.")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from twin.sweep.results import read_rows
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "bench.toml").write_text(SWEEP)
        times = {"serial": [], "dask": []}
        for i in range(a.repeat):
            for name, args in (("serial", ["--serial"]), ("dask", ["--workers", str(a.workers)])):
                out = folder / f"{name}{i}.csv"
                wall, cpu = run(folder, [*args, "--out", str(out)])
                times[name].append((wall, cpu, os.getloadavg()[0], out))
        rows = {name: [{k: v for k, v in r.items() if k != "seconds"} for r in read_rows(t[0][3])[1]]
                for name, t in times.items()}
        n = len(rows["serial"])
        failed = sum(r["status"] != "ok" for r in rows["serial"])
        same = all([{k: v for k, v in r.items() if k != "seconds"} for r in read_rows(t[3])[1]] == rows["serial"]
                   for ts in times.values() for t in ts)
        print(f"{n} points ({failed} failed); every run gave the same rows: {same}")
        for name, ts in times.items():
            label = "serial (one process)" if name == "serial" else f"Dask, {a.workers} local workers"
            for wall, cpu, load, out in ts:
                own = sum(float(r["seconds"]) for r in read_rows(out)[1])
                print(f"{label:26s} {wall:6.1f} s  {n / wall:5.2f} points/s  CPU {cpu:5.1f} s  points' own times "
                      f"{own:6.1f} s  load average after: {load:.1f} on {os.cpu_count()} cores")
        best = {name: min(t[0] for t in ts) for name, ts in times.items()}
        print(f"best of each: speed-up {best['serial'] / best['dask']:.2f}x")


if __name__ == "__main__":
    main()
