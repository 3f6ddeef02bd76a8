"""Where a CPU run's per-process spread comes from: the same grids run several times, alternating, with
and without binding ranks to cores, and what the machine did meanwhile.

    python benchmarks/cpu_run_spread.py --grids 1x2x1x1,1x2x2x1,1x1x2x4,8x1x1x1 --repeats 3
    python benchmarks/cpu_run_spread.py --binds none,cores --repeats 4      # pinned against not (default)
    python benchmarks/cpu_run_spread.py --binds none,norand --repeats 4 --grids 1x1x1x2,2x1x1x1,1x2x2x1,2x2x2x1

Each pass runs every (grid, bind) once with `backend run --model M --steps S --warmup 1`, in an order
rotated from pass to pass (so that a drift of the machine does not fall on one grid or one bind), and
takes a run's iteration as the median step time of its steps after the first two (as `twin validate`).
While a run goes, every 0.2 s it samples /proc: the steal and niced share of the machine's time (a
hypervisor or the other users taking the cores), and per rank process the scheduler's migrations and
involuntary switches. It prints per grid and bind the iterations of the passes, their spread
(max/min - 1), the median, and the sampled figures; at the end, per bind, the median spread over grids.
Timings depend on the machine's load: the load average is printed at the start and the end.

What it found on the 2-core development VM (2026-12-01, gpt-small, 6 steps, 3 passes; other helpers'
niced jobs around, load 2-12):
- The per-process spread is real: over 35 grids run in the three quiet loops 01d, 01e and 01f, the
  same grid's iteration (median of steps 3-6) moved by a standard deviation of 9.6 % (of its log),
  while its steps within a run scatter by 6.1 % each, which alone would move a median of 4 by about
  4 %. Three passes here: 6-11 % against 4 %. So more steps per run do little; more runs help.
- Not steal time: /proc/stat's steal was 0.0-0.3 % of the machine during every run.
- Not the ranks wandering between cores: binding rank i to core i mod 2 (BACKEND_CPU_BIND=cores)
  stopped migrations (4-20/s unbound, 0 bound) but did not narrow the spread (median max/min - 1 over
  the four grids: 12 % unbound, 25 % bound, with this script's default grids). It moves the level:
  8x1x1x1 2.95 -> 2.09 s, 1x2x2x1 0.55 -> 0.63 s. So it stays off by default (backend.launch.launcher).
- Not the memory layout: with address space randomization off (`setarch -R`, what `--binds
  none,norand` alternates; measured before that option existed, by the same alternation of plain and
  `setarch -R` runs, 4 grids x 4 passes, medians of steps 3-6, 2026-12-01 15:10 UTC, quiet) the spread was 2-29 % (1x1x1x2 24 %, 2x1x1x1 2 %,
  1x2x2x1 29 %, 2x2x2x1 19 %) against 9-33 % with it (25, 9, 33, 17 %).
- Other users' work fills the ranks' idle gaps even when niced: the kernel groups a session's
  processes (sched_autogroup_enabled = 1), and `nice` weighs only within a group, so other sessions'
  `nice -n 19` jobs took 12-72 % of the machine's time during these runs ("niced" in the lines),
  and the spread reached 40-240 %. Raising the measuring session's group (`echo -20 >
  /proc/self/autogroup`, root) brought that to about 20 % and the spread to the figures above. The
  quiet loop needs a machine without other sessions' jobs, niced or not.
- The first two steps are left out for a reason: step 2 (where torch's memory tracker measures the
  peak) takes 1.3-2.3x the median of steps 3-6, step 1 1.1-1.25x. The traced last step takes 1.01-1.04x.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_times() -> list[int]:
    """The machine's cpu line of /proc/stat: user nice system idle iowait irq softirq steal (jiffies)."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def children(root: int) -> list[int]:
    """Every process below `root` (by parent pid)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def sched(pid: int) -> dict[str, float]:
    """nr_migrations, nr_involuntary_switches and sum_exec_runtime (ms) of /proc/PID/sched, summed over
    its threads."""
    tot = {"migrations": 0.0, "involuntary": 0.0, "cpu_ms": 0.0}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return tot
    for t in tids:
        try:
            for line in Path(f"/proc/{pid}/task/{t}/sched").read_text().splitlines():
                k, _, v = line.partition(":")
                k = k.strip()
                if k == "se.nr_migrations":
                    tot["migrations"] += float(v)
                elif k == "nr_involuntary_switches":
                    tot["involuntary"] += float(v)
                elif k == "se.sum_exec_runtime":
                    tot["cpu_ms"] += float(v)
        except OSError:
            pass
    return tot


def one_run(model: str, grid: str, steps: int, bind: str, out: Path) -> dict:
    """One `backend run`, sampled; its iteration (s) and what the machine and the ranks did. bind: a
    BACKEND_CPU_BIND value, or 'norand' (unbound, the process tree started by `setarch -R`: address
    space randomization off, so every run lays out its memory alike)."""
    env = {**os.environ, "BACKEND_CPU_BIND": "none" if bind == "norand" else bind}
    pre = ["setarch", os.uname().machine, "-R"] if bind == "norand" else []
    c0, t0 = cpu_times(), time.perf_counter()
    p = subprocess.Popen(pre + [sys.executable, "-m", "backend.cli", "run", "--model", model, "--grid", grid,
                          "--steps", str(steps), "--warmup", "1", "--out", str(out)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last: dict[int, dict] = {}
    ranks: list[int] = []
    while p.poll() is None:
        time.sleep(0.2)
        if not ranks or len(ranks) < int(grid_size(grid)) - 1:
            ranks = children(p.pid)
        for r in ranks + [p.pid]:
            s = sched(r)
            if s["cpu_ms"]:
                last[r] = s
    wall = time.perf_counter() - t0
    c1 = cpu_times()
    if p.returncode:
        sys.exit(f"backend run {grid} failed: {p.stdout.read()[-2000:]}")
    steps_s = [json.loads(line)["step_time_s"] for line in (out / "log.jsonl").read_text().splitlines()]
    d = [b - a for a, b in zip(c0, c1)]
    total = sum(d) or 1
    rank_stats = [v for k, v in last.items() if k != p.pid] or list(last.values())
    return {"iteration_s": statistics.median(steps_s[2:]), "steps_s": steps_s, "wall_s": wall,
            "steal": d[7] / total, "niced": d[1] / total, "idle": d[3] / total,
            "migrations_per_s": statistics.fmean(s["migrations"] for s in rank_stats) / wall if rank_stats else 0,
            "involuntary_per_s": statistics.fmean(s["involuntary"] for s in rank_stats) / wall if rank_stats else 0}


def noise(groups: list[list[list[float]]]) -> tuple[float, float]:
    """Per grid the step times of each of its runs: (between, steps), both rms over the grids. between:
    the standard deviation over the runs of the log of a run's iteration (median of its steps after
    the first two); steps: what the scatter of the steps within a run alone would give it (their
    standard deviation, pooled over the runs, x 1.2 / sqrt(steps): a median of a few)."""
    between, steps = [], []
    for runs in groups:
        logs = [[math.log(x) for x in s[2:]] for s in runs]
        if len(logs) < 2 or min(map(len, logs)) < 2:
            continue
        between.append(statistics.stdev(statistics.median(lg) for lg in logs))
        within = math.sqrt(statistics.fmean(statistics.variance(lg) for lg in logs))
        steps.append(1.2 * within / math.sqrt(statistics.fmean(map(len, logs))))
    rms = (lambda v: math.sqrt(statistics.fmean(x * x for x in v)) if v else float("nan"))  # noqa: E731
    return rms(between), rms(steps)


def grid_size(grid: str) -> int:
    n = 1
    for x in grid.split("x"):
        n *= int(x)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grids", default="1x2x1x1,1x2x2x1,1x1x2x4,8x1x1x1")
    ap.add_argument("--binds", default="none,cores", help="BACKEND_CPU_BIND values (none, cores) or norand (none, address randomization off) to alternate")
    ap.add_argument("--repeats", type=int, default=3, help="passes over every (grid, bind)")
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", help="write every run's figures here")
    a = ap.parse_args()
    grids, binds = a.grids.split(","), a.binds.split(",")
    cases = [(g, b) for g in grids for b in binds]
    print(f"load average at the start {os.getloadavg()}; {len(cases)} cases x {a.repeats} passes", flush=True)
    res: dict[tuple, list[dict]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            k = (rep * 3) % len(cases)
            order = cases[k:] + cases[:k]
            if rep % 2:
                order = order[::-1]
            for g, b in order:
                r = one_run(a.model, g, a.steps, b, Path(tmp) / f"{g}-{b}-{rep}")
                res[(g, b)].append(r)
                print(f"  pass {rep}  {g:8s} bind={b:5s} {r['iteration_s']:.3f} s  steal {100 * r['steal']:.1f} %  "
                      f"niced {100 * r['niced']:.1f} %  migrations {r['migrations_per_s']:.1f}/s  "
                      f"involuntary {r['involuntary_per_s']:.0f}/s", flush=True)
    print("grid     bind   iterations (s)                 spread  median   steal  migr/s")
    spreads: dict[str, list[float]] = {b: [] for b in binds}
    for (g, b), rs in res.items():
        its = [r["iteration_s"] for r in rs]
        spread = max(its) / min(its) - 1
        spreads[b].append(spread)
        print(f"{g:8s} {b:6s} {' '.join(f'{x:.3f}' for x in its):30s} {100 * spread:5.1f} %  {statistics.median(its):.3f}  "
              f"{100 * statistics.fmean(r['steal'] for r in rs):4.1f} %  "
              f"{statistics.fmean(r['migrations_per_s'] for r in rs):5.1f}")
    for b in binds:
        meds = {g: statistics.median(r["iteration_s"] for r in res[(g, b)]) for g in grids}
        between, steps = noise([[r["steps_s"] for r in res[(g, b)]] for g in grids])
        print(f"bind={b}: median spread {100 * statistics.median(spreads[b]):.1f} %, "
              f"worst {100 * max(spreads[b]):.1f} %; iteration medians "
              + " ".join(f"{g} {meds[g]:.3f}" for g in grids))
        print(f"  a run's iteration moves by {100 * between:.1f} % (sd of its log over the passes, rms over grids); "
              f"its steps' scatter alone would move it by {100 * steps:.1f} %")
    if a.json:
        Path(a.json).write_text(json.dumps({f"{g}/{b}": rs for (g, b), rs in res.items()}, indent=1))
    print(f"load average at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
