"""Does the search miss the best grid? Simulate EVERY valid grid of a few studies and compare with the
analytical ranking (a check, not a test: minutes of CPU).

    python benchmarks/search_exhaustive.py [--limit N] [CASE ...]

For each study: the analytical rank of the grid that simulates fastest (twin.simulate.search checks
the analytical top simulate_top + SCAN), the smallest ratio simulated / analytical, and whether the
lower bound of twin.search.lower_bound stayed below the simulated time of every grid.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from twin.search import lower_bound, rank_grids
from twin.simulate import simulate_grid
from twin.study import prepare

CASES = {
    "frontier-20b-512": ("frontier", "gpt-20b", 512, None),
    "perlmutter-20b-1024": ("perlmutter", "gpt-20b", 1024, None),
    "alps-40b-1024": ("alps", "gpt-40b", 1024, None),
    "frontier-80b-2048": ("frontier", "gpt-80b", 2048, 512),
    "perlmutter-40b-4096": ("perlmutter", "gpt-40b", 4096, None),
    "frontier-320b-32768": ("frontier", "gpt-320b", 32768, None),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=list(CASES)[:5])
    ap.add_argument("--limit", type=int, default=0, help="simulate only the analytical best N (0: all)")
    a = ap.parse_args()
    for name in a.cases:
        system, model, gpus, batch = CASES[name]
        st = prepare(system, model, gpus, batch)
        t = time.process_time()
        cands = rank_grids(st)
        rows = []
        for i, c in enumerate(cands[: a.limit or None]):
            r = simulate_grid(st, c.grid)
            rows.append((i, str(c.grid), c.analytical_s, r.iteration_time_s, lower_bound(st, c.grid)))
        best = min(rows, key=lambda x: (x[3], x[1]))
        ratio = min(x[3] / x[2] for x in rows)
        print(json.dumps({"case": name, "grids": len(cands), "simulated": len(rows), "best": best,
                          "best_analytical_rank": best[0], "min_sim_over_analytical": ratio,
                          "bound_ok": all(x[4] <= x[3] for x in rows),
                          "min_sim_over_bound": min(x[3] / x[4] for x in rows),
                          "cpu_s": time.process_time() - t, "rows": rows}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
