"""What grid auto does, step by step, and what each step costs (CPU seconds, in this process).

    PYTHONPATH=. python benchmarks/grid_auto_steps.py [--system frontier] [--baseline OTHER_CHECKOUT]

Prints one line per step of `twin.predict.auto.choose_grid` on the system's default study: the
routing-free estimate of every grid, the quick bounds of the pool, each routed bound, each
simulation (in full, or stopped partway by the branch and bound: its bound, the stop and the
simulated time it stopped at), then the chosen grid and the total. With --baseline, the same in a
run of the other checkout's code (a fresh process), for a before/after in one run; the machine is
shared, so read CPU seconds, and the sequence itself.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def steps(system: str) -> None:
    t0 = time.process_time()
    import twin.engine.engine as engine
    import twin.predict.auto as sim
    import twin.predict.run as run_mod
    from twin.predict.study import prepare
    imports = time.process_time() - t0
    log = []
    stop_at = {}

    def wrap(name, show):
        f = getattr(sim, name)

        def g(*a, **k):
            t = time.process_time()
            r = f(*a, **k)
            log.append((name, time.process_time() - t, show(a, k, r)))
            return r
        setattr(sim, name, g)

    run = run_mod.simulate_program

    def simulate_program(*a, **k):
        try:
            return run(*a, **k)
        except engine.Stopped as e:
            stop_at["now"] = e.now_ns / engine.NS
            raise
    run_mod.simulate_program = simulate_program

    def simulated(a, k, r):
        if r is not None:
            return f"{a[1]} in full: {r.iteration_time_s:.4f} s" + (f" (stop at {k['stop_s']:.4f})" if k.get("stop_s") else "")
        return (f"{a[1]} stopped at {stop_at.pop('now', 0):.3f} s of simulated time: bound "
                f"{sim.stopped_bound(a[0], a[1]):.4f} > stop {k['stop_s']:.4f}")
    wrap("estimate_grids", lambda a, k, r: f"{len(r)} grids")
    wrap("quick_bounds", lambda a, k, r: f"{len(a[1])} grids: " + ", ".join(f"{g} {b:.3f}" for g, b in zip(a[1], r)))
    wrap("routed_bound", lambda a, k, r: f"{a[1]} {r:.4f}")
    wrap("simulate_grid", simulated)
    t = time.process_time()
    best, how = sim.choose_grid(prepare(system))
    total = time.process_time() - t
    print(f"imports {imports:.3f} s CPU; choose_grid {total:.3f} s CPU")
    for name, dt, what in log:
        print(f"  {dt:6.3f} s  {name:15s} {what}")
    print(f"  chosen {best.grid} {best.simulated_s:.4f} s: {how}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", default="frontier")
    ap.add_argument("--baseline", help="another checkout: run the same there (a fresh process) first")
    a = ap.parse_args()
    if a.baseline:
        print(f"== baseline {a.baseline}")
        sys.stdout.flush()
        env = dict(os.environ, PYTHONPATH=os.path.abspath(a.baseline))
        subprocess.run([sys.executable, os.path.abspath(__file__), "--system", a.system], env=env,
                       cwd=a.baseline, check=True)
        print("== this checkout")
        sys.stdout.flush()
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        subprocess.run([sys.executable, os.path.abspath(__file__), "--system", a.system], env=env, check=True)
        return
    steps(a.system)


if __name__ == "__main__":
    main()
