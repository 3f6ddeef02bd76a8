"""How fast full mode (`twin simulate --full`, every rank) is, against a baseline measured in the same
run (a report, not a test).

    python benchmarks/bench_full.py [--baseline DIR] [--repeat N] [--machine] [--cases 1,3]

Each case is a whole process (imports included) that calls `twin.predict.simulate.simulate(..., full=True)`
with stragglers drawn from a fixed seed; it prints wall and CPU seconds, the process's peak resident
memory, simulated ops (op executions summed over all ranks) per second of the whole process, and the
classes of alike ranks the engine simulated (twin.engine.symmetry; "-" in a checkout without it):
1. gpt-5b on 4,096 GCDs (grid 2x2x2x512) in symmetric mode (the reference of peak memory);
2. full mode, no straggler (one class: the symmetric run);
3. the same with 16 random stragglers (compute x1.25);
4. the same with every rank its own compute factor (1 + rank * 1e-6): every rank is its own class,
   the engine runs rank by rank (twin.engine.lockstep.lockstep: the program stepped once over all ranks with numpy;
   before it, one event per rank and op);
with --machine, Frontier's default study (gpt-320b on all 32,768 GCDs, `twin simulate --system
frontier --grid 2x32x64x8 --full`, about 196 M ops):
5. symmetric; 6. no straggler; 7. 16 random stragglers; 8. every rank its own factor (rank by rank;
   minutes: give --timeout; the event engine took about 20).
Memory per simulated rank: (peak of a rank-by-rank case - peak of the symmetric run) / ranks.
Every case runs in this checkout and, with --baseline, in another (e.g. `git worktree add /tmp/base
COMMIT`), alternately; ratios are this / baseline. The machine may be shared: the load average is
printed before and after; CPU seconds are steadier than wall seconds under load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
CHILD = r"""
import json, random, resource, sys, time
from twin.predict.simulate import SimulationConfig, simulate
c = json.loads(sys.argv[1])
rng = random.Random(0)
n = c["gpus"]
if c["stragglers"] == "every":
    slow = {r: 1 + r * 1e-6 for r in range(n)}
else:
    slow = {rng.randrange(n): 1.25 for _ in range(c["stragglers"])}
t = time.perf_counter()
r = simulate(SimulationConfig("frontier", c["model"], n, c["grid"], full=c.get("full", True), slowdown=slow or None))
sim_s = time.perf_counter() - t
try:
    from twin.program.grid import Grid
    from twin.engine.symmetry import rank_classes
    classes = len(rank_classes(Grid.parse(c["grid"]), slow))
except ImportError:
    classes = None
print(json.dumps({"ops": r.simulated_ops, "iteration_s": r.iteration_time_s, "sim_s": sim_s, "classes": classes,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

GPT5B = {"model": "gpt-5b", "gpus": 4096, "grid": "2x2x2x512"}
GPT320B = {"model": None, "gpus": 32768, "grid": "2x32x64x8"}  # frontier's default study: gpt-320b, its batch
CASES = [
    ("gpt-5b 4,096 GCDs, symmetric mode (memory reference)", {**GPT5B, "stragglers": 0, "full": False}, "-"),
    ("gpt-5b 4,096 GCDs, no straggler", {**GPT5B, "stragglers": 0}, ">= 1 M ops/s"),
    ("gpt-5b 4,096 GCDs, 16 stragglers", {**GPT5B, "stragglers": 16}, ">= 1 M ops/s"),
    ("gpt-5b 4,096 GCDs, every rank its own factor", {**GPT5B, "stragglers": "every"}, ">= 1 M ops/s"),
]
MACHINE = [
    ("gpt-320b 32,768 GCDs, symmetric mode (memory reference)", {**GPT320B, "stragglers": 0, "full": False}, "-"),
    ("gpt-320b 32,768 GCDs, no straggler", {**GPT320B, "stragglers": 0}, "< 300 s, < 12 GB"),
    ("gpt-320b 32,768 GCDs, 16 stragglers", {**GPT320B, "stragglers": 16}, "< 300 s, < 12 GB"),
    ("gpt-320b 32,768 GCDs, every rank its own factor", {**GPT320B, "stragglers": "every"}, "< 300 s, < 12 GB"),
]


def run(root: Path, case: dict, timeout: float) -> dict:
    """One whole process: wall s, CPU s, and what the child printed (ops, peak RSS, classes)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], cwd=root, capture_output=True,
                             text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(root)})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["wall"] = wall
    r["cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return r


def summary(rs: list[dict]) -> dict | None:
    ok = [r for r in rs if "error" not in r]
    if not ok:
        return None
    return {"wall": statistics.median(r["wall"] for r in ok), "cpu": statistics.median(r["cpu"] for r in ok),
            "rss": max(r["rss"] for r in ok), "ops": ok[0]["ops"], "classes": ok[0]["classes"],
            "iteration_s": ok[0]["iteration_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="another checkout to run the same cases in")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case and checkout (median reported)")
    ap.add_argument("--machine", action="store_true", help="also the 32,768-GCD cases (minutes)")
    ap.add_argument("--cases", help="comma-separated case numbers to run (default: all)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    a = ap.parse_args()
    cases = list(enumerate(CASES + (MACHINE if a.machine else []), 1))
    if a.cases:
        keep = {int(k) for k in a.cases.split(",")}
        cases = [(k, c) for k, c in cases if k in keep]
    roots = [("this", HERE)] + ([("baseline", a.baseline.resolve())] if a.baseline else [])
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    peaks: dict[tuple[str, int], float] = {}
    for k, (name, case, target) in cases:
        results: dict[str, list[dict]] = {key: [] for key, _ in roots}
        for _ in range(1 if case["gpus"] > 4096 else a.repeat):
            for key, root in roots:  # alternate, so that both see the same load
                results[key].append(run(root, case, a.timeout))
        print(f"== {k}. {name}  (target {target})")
        figs = {}
        for key, _ in roots:
            s = figs[key] = summary(results[key])
            if s is None:
                print(f"   {key:9s} {results[key][0]['error']}")
                continue
            peaks[key, k] = s["rss"]
            rate = f"{s['ops'] / s['wall'] / 1e6:6.2f} M ops/s" if case.get("full", True) else "     symmetric"
            print(f"   {key:9s} {s['wall']:7.2f} s wall {s['cpu']:7.2f} s CPU {s['rss'] / 2**30:5.2f} GiB "
                  f"{rate}  classes {s['classes'] if s['classes'] else '-'}  "
                  f"iteration {s['iteration_s']:.9f} s")
            if case["stragglers"] == "every" and (key, k - 3) in peaks:
                print(f"   {key:9s} memory per simulated rank {(s['rss'] - peaks[key, k - 3]) / case['gpus'] / 1024:.1f} KiB "
                      "(over the symmetric run's peak)")
        if a.baseline and figs["this"] and figs["baseline"]:
            t, b = figs["this"], figs["baseline"]
            print(f"   ratio     {t['wall'] / b['wall']:7.2f} x wall {t['cpu'] / b['cpu']:7.2f} x CPU (this / baseline); "
                  f"same iteration time: {t['iteration_s'] == b['iteration_s']}")
        sys.stdout.flush()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
