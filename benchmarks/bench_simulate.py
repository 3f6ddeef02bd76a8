"""How fast the simulator is (a report, not a test).

    python benchmarks/bench_simulate.py [--quick]

1. `twin simulate --system frontier` (gpt-320b on 32,768 GCDs, symmetric, grid auto) as a whole
   process, and where the time goes inside (cProfile by module: collective model, engine, search, ...).
2. Full mode: simulated ops per second of the engine (gpt-5b on 512, 1,024 and 4,096 GCDs, grid
   2x2x2xN), and one iteration of 4,096 ranks (gpt-40b on 4,096 Perlmutter GPUs, the published case).
3. Growth of wall time with GPU count (512 ... 32,768; symmetric, fixed and auto grid) and with layers.
Timings on a shared machine vary; each figure is the best of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import subprocess
import sys
import time
from collections import defaultdict

from twin.grid import Grid
from twin.model import load_model
from twin.engine import simulate_program
from twin.program import build_program
from twin.simulate import collective_timer, simulate, simulate_grid
from twin.study import collective_model, prepare


def best_of(n: int, fn):
    """(best wall seconds, last result) of n calls."""
    best, out = float("inf"), None
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def cpu_of(fn):
    """(CPU seconds of this process, result): steadier than wall time on a shared, loaded machine."""
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def frontier_default(repeat: int) -> None:
    print("== twin simulate --system frontier (whole process)")
    wall, _ = best_of(repeat, lambda: subprocess.run(["twin", "simulate", "--system", "frontier", "--json"],
                                                     check=True, capture_output=True))
    print(f"   whole process: {wall:.2f} s (target < 10 s)")
    import twin.search
    workers, twin.search.MAX_WORKERS = twin.search.MAX_WORKERS, 1  # profile in one process
    prof = cProfile.Profile()
    prof.enable()
    r = simulate("frontier")
    prof.disable()
    twin.search.MAX_WORKERS = workers
    stats = pstats.Stats(prof)
    by_module: dict[str, float] = defaultdict(float)
    for (file, _, _), (_, _, tottime, _, _) in stats.stats.items():
        for key in ("twin/collectives", "twin/flows", "topologies/", "twin/engine", "simpy/", "twin/program",
                    "twin/search", "twin/kernels", "twin/memory", "numpy"):
            if key in file:
                by_module[key] += tottime
                break
        else:
            by_module["other"] += tottime
    total = sum(by_module.values())
    print(f"   in one process (no worker processes; profiled, so slower): {total:.2f} s; grid {r.grid_str} "
          f"({r.grid_choice})")
    for k, v in sorted(by_module.items(), key=lambda kv: -kv[1]):
        print(f"     {k:20s} {v:6.2f} s  {100 * v / total:5.1f} %")


def engine_only(study, grid: Grid, full: bool):
    """(engine wall s, engine CPU s, EngineResult): the collective model is built and its caches warmed first."""
    prog = build_program(study.model, grid, study.options, study.batch, study.seq_len)
    compute = [0.0 if op.is_collective else study.kernels.op_time(op) for op in prog.ops]
    timer = collective_timer(prog, collective_model(study, grid))
    simulate_program(prog, compute, timer, overlap_slowdown=study.profile.overlap_slowdown)  # warm
    t, c = time.perf_counter(), time.process_time()
    r = simulate_program(prog, compute, timer, full=full, overlap_slowdown=study.profile.overlap_slowdown)
    return time.perf_counter() - t, time.process_time() - c, r


def full_mode(repeat: int, quick: bool) -> None:
    print("== full mode (target >= 300,000 simulated ops per second at every size)")
    for gpus in (512, 1024, 4096)[: 1 if quick else 3]:
        study = prepare("frontier", "gpt-5b", gpus)
        g = Grid(2, 2, 2, gpus // 8)
        runs = [engine_only(study, g, True) for _ in range(repeat if gpus <= 1024 else 1)]
        eng, cpu, r = min(x[0] for x in runs), min(x[1] for x in runs), runs[-1][2]
        print(f"   gpt-5b on {gpus:,} GCDs {g}: {r.simulated_ops:,} ops; engine {eng:.2f} s wall ({cpu:.2f} s CPU) = "
              f"{r.simulated_ops / eng:,.0f} ops/s wall, {r.simulated_ops / cpu:,.0f} per CPU second")
    if quick:
        return
    study = prepare("perlmutter", "gpt-40b", 4096)
    g = Grid.parse("1x8x8x64")
    t = time.perf_counter()
    cpu, r = cpu_of(lambda: simulate_grid(study, g, full=True))
    wall = time.perf_counter() - t
    print(f"   gpt-40b on 4,096 Perlmutter GPUs {g}: {r.simulated_ops:,} ops in {wall:.1f} s wall, {cpu:.1f} s CPU "
          f"= {r.simulated_ops / cpu:,.0f} ops per CPU second (target: one iteration < 60 s)")


def scaling(repeat: int, quick: bool) -> None:
    print("== wall time vs GPU count (gpt-80b on Frontier, symmetric, global batch = GPUs / 16 sequences)")
    print(f"   {'GPUs':>6} {'grid':>12} {'fixed grid (s)':>15} {'grid auto (s)':>14} {'iteration (s)':>14}")
    for gpus in (512, 2048, 8192, 32768)[: 2 if quick else 4]:
        grid = Grid(8, 8, 4, gpus // 256)
        wall_fixed, r = best_of(repeat, lambda: simulate("frontier", "gpt-80b", gpus, grid, batch=gpus // 16))
        wall_auto, _ = best_of(1, lambda: simulate("frontier", "gpt-80b", gpus, "auto", batch=gpus // 16))
        print(f"   {gpus:>6} {str(grid):>12} {wall_fixed:>15.2f} {wall_auto:>14.2f} {r.iteration_time_s:>14.3f}")
    print("== full-mode wall time vs GPU count (gpt-5b on Frontier)")
    for gpus in (128, 256, 512, 1024)[: 2 if quick else 4]:
        grid = Grid(2, 2, 2, gpus // 8)
        wall, r = best_of(1, lambda: simulate("frontier", "gpt-5b", gpus, grid, full=True))
        print(f"   {gpus:>6} {str(grid):>12} {wall:>8.2f} s  {r.simulated_ops:>10,} ops  {r.simulated_ops / wall:>9,.0f} ops/s")
    print("== wall time vs layers (gpt-320b widths on 32,768 GCDs, grid 8x8x4x128, symmetric)")
    base = load_model("gpt-320b")
    study = prepare("frontier", base, 32768)
    for layers in (24, 48, 96, 192)[: 2 if quick else 4]:
        model = dataclasses.replace(base, name=f"gpt-320b-{layers}l", layers=layers)
        st = dataclasses.replace(study, model=model)
        wall, r = best_of(repeat, lambda: simulate_grid(st, Grid(8, 8, 4, 128)))
        print(f"   {layers:>4} layers: {wall:6.2f} s, {r.simulated_ops:,} ops, iteration {r.iteration_time_s:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer and smaller cases")
    ap.add_argument("--repeat", type=int, default=2, help="runs per timing (best is reported)")
    a = ap.parse_args()
    frontier_default(a.repeat)
    full_mode(a.repeat, a.quick)
    scaling(a.repeat, a.quick)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
