"""Does the search miss the best grid? Simulate EVERY valid grid of a few studies and compare with what
`twin.predict.auto.choose_grid` (grid auto) picks (a check, not a test: minutes of CPU).

    python benchmarks/search_exhaustive.py [--limit N] [CASE ...]

One JSON line per study: the grid auto chose and how many it simulated; the fastest of all grids, with
its rank in the exact analytical ranking and in the routing-free estimate's (grid auto bounds the top
simulate_top + SCAN of the latter: `best_estimate_rank` must stay below `pool`); whether the lower
bound of twin.predict.bounds.lower_bound stayed below the simulated time of every grid (`bound_ok`, with the
smallest simulated / bound); whether the search's routing-free bound (twin.predict.bounds.quick_bounds, one
program per class of grids) stayed below that bound on every grid (`quick_ok`, with the smallest bound / quick bound); and
`faster_alone`: how many collective times the simulations asked under contention of other axes came
out below the same collective alone (the property the bound rests on; must be 0).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from twin.predict.bounds import lower_bound, quick_bounds
from twin.predict.search import estimate_grids, rank_grids
from twin.predict.auto import choose_grid, SCAN
from twin.predict.run import simulate_grid
from twin.predict.study import prepare
from twin.predict.study_cache import model_for

CASES = {
    "frontier-20b-512": ("frontier", "gpt-20b", 512, None),
    "perlmutter-20b-1024": ("perlmutter", "gpt-20b", 1024, None),
    "alps-40b-1024": ("alps", "gpt-40b", 1024, None),
    "frontier-80b-2048": ("frontier", "gpt-80b", 2048, 512),
    "perlmutter-40b-4096": ("perlmutter", "gpt-40b", 4096, None),
    "frontier-320b-32768": ("frontier", "gpt-320b", 32768, None),
    "frontier-default": ("frontier", None, None, None),
}


def faster_alone(model) -> int:
    """Collective times under contention that are below the same collective with no other axis running."""
    return sum(t < model.time(k, a, b) * (1 - 1e-12) for (k, a, b, c), t in list(model._times.items()) if c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=list(CASES)[:5])
    ap.add_argument("--limit", type=int, default=0, help="simulate only the analytical best N (0: all)")
    ap.add_argument("--simulate-top", type=int, default=2, help="as `twin simulate --simulate-top`")
    a = ap.parse_args()
    for name in a.cases:
        system, model, gpus, batch = CASES[name]
        st = prepare(system, model, gpus, batch)
        t = time.process_time()
        chosen, how = choose_grid(st, simulate_top=a.simulate_top)
        search_s = time.process_time() - t
        cands = rank_grids(st)
        rows, bad = [], 0
        quick = quick_bounds(st, [c.grid for c in cands[: a.limit or None]])  # one program per class, as the search
        for i, c in enumerate(cands[: a.limit or None]):
            r = simulate_grid(st, c.grid)
            bad += faster_alone(model_for(st, c.grid))
            rows.append((i, str(c.grid), c.analytical_s, r.iteration_time_s, lower_bound(st, c.grid), quick[i]))
        best = min(rows, key=lambda x: (x[3], x[1]))
        order = [str(c.grid) for c in estimate_grids(st)]  # the order grid auto looks at grids in
        print(json.dumps({"case": name, "grids": len(cands), "simulated": len(rows),
                          "chosen": [str(chosen.grid), chosen.simulated_s], "chosen_is_best": str(chosen.grid) == best[1],
                          "search_cpu_s": search_s, "search_simulated": len(re.findall(r"\d s\b", how)),
                          "best": best, "best_analytical_rank": best[0],
                          "best_estimate_rank": order.index(best[1]), "pool": a.simulate_top + SCAN,
                          "bound_ok": all(x[4] <= x[3] + 1e-6 for x in rows),
                          "min_sim_over_bound": min(x[3] / x[4] for x in rows),
                          "quick_ok": all(x[5] <= x[4] for x in rows),
                          "min_bound_over_quick": min(x[4] / x[5] for x in rows), "faster_alone": bad,
                          "cpu_s": time.process_time() - t, "rows": rows}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
