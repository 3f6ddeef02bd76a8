"""How fast max-min fair rates are, against a baseline checkout's twin/costs/flows.py, in the same run.

    python benchmarks/bench_maxmin.py [--baseline DIR] [--grid 2x32x64x8] [--repeat N]

Captures every max-min problem that `twin simulate --system frontier --grid GRID` solves (the
inputs of twin.costs.flows._max_min, in this checkout; GRID may be auto), then times this checkout's _max_min and the
baseline's (DIR/twin/flows.py, loaded as a module of its own) on each, alternately, `--repeat`
times: the best CPU milliseconds of each, their ratio, and whether the rates are the same to the
bit (they must be). CPU time of repeated calls in one process: warm caches and a warm heap, so it
leaves out what a cold process pays in page faults (bench_simulate.py measures whole processes).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

import twin.costs.flows as flows  # noqa: E402
from twin.predict.run import simulate_grid  # noqa: E402
from twin.predict.simulate import SimulationConfig, simulate  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.predict.study import prepare  # noqa: E402


def capture(grid: str) -> list[tuple]:
    """The arguments of every _max_min call of a fixed-grid Frontier simulation (copies)."""
    seen, solve = [], flows._max_min

    def record(ptr, links, cap_link, cap_flow, rtol, link_counts=None):
        seen.append((ptr.copy(), links.copy(), cap_link, cap_flow.copy(), rtol, link_counts))
        return solve(ptr, links, cap_link, cap_flow, rtol, link_counts)

    flows._max_min = record
    try:
        if grid == "auto":
            simulate(SimulationConfig("frontier"))
        else:
            simulate_grid(prepare("frontier"), Grid.parse(grid))
    finally:
        flows._max_min = solve
    return seen


def load_flows(root: Path):
    spec = importlib.util.spec_from_file_location("baseline_flows", root / "twin" / "flows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="another checkout (e.g. a worktree of an older commit)")
    ap.add_argument("--grid", default="2x32x64x8")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    problems = capture(args.grid)
    sides = [("this", flows)] + ([("baseline", load_flows(args.baseline))] if args.baseline else [])
    print(f"{len(problems)} max-min problems of --grid {args.grid}; best CPU ms of {args.repeat}")
    print(f"{'flows':>8s} {'entries':>9s} " + " ".join(f"{name:>9s}" for name, _ in sides)
          + ("    ratio  same" if args.baseline else ""))
    total = [0.0] * len(sides)
    for ptr, links, cap_link, cap_flow, rtol, counts in problems:
        best, out = [float("inf")] * len(sides), [None] * len(sides)
        for _ in range(args.repeat):
            for i, (_, module) in enumerate(sides):
                t = time.process_time()
                out[i] = module._max_min(ptr, links, cap_link, cap_flow.copy(), rtol, counts)
                best[i] = min(best[i], time.process_time() - t)
        total = [a + b for a, b in zip(total, best)]
        line = f"{len(ptr) - 1:8d} {len(links):9d} " + " ".join(f"{b * 1e3:9.1f}" for b in best)
        if args.baseline:
            line += f"  {best[0] / best[1]:6.2f}x  {out[0].tobytes() == out[1].tobytes()}"
        print(line)
    line = f"{'total':>18s} " + " ".join(f"{b * 1e3:9.1f}" for b in total)
    print(line + (f"  {total[0] / total[1]:6.2f}x" if args.baseline else ""))


if __name__ == "__main__":
    main()
