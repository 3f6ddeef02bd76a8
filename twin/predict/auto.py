"""Grid auto and `twin search`: which grids to simulate, and which the lower bounds rule out.

`choose_grid` is the grid `--grid auto` runs: every valid grid ranked by the analytical model of
twin.predict.search on routing-free probes (`estimate_grids`), the top few bounded from below and
simulated, best bound first, while their bound could beat the fastest simulated so far. `search`
ranks with the exact probes (`rank_grids`) for its table, simulates its top rows, and then does the
same, so that both find the same fastest grid.
"""

from __future__ import annotations

import heapq
import math

from twin.predict.bounds import quick_bounds, routed_bound
from twin.predict.run import simulate_grid, stopped_bound
from twin.predict.search import Candidate, estimate_grids, exact_estimate, rank_grids
from twin.predict.study import Study

# Grid auto looks at the analytical top simulate_top + SCAN of every valid grid, ranked by the
# analytical model on routing-free probes (twin.predict.search.estimate_grids: twin.costs.solobound's bounds on each
# probe, so no whole-machine probe is routed for ranking; the exact ranking of `twin search` routes
# one per data-axis size, about 0.17 s each on Frontier). It bounds each from below
# (twin.predict.bounds.lower_bound: the grid's own collective model without the other axes' traffic, compute
# slowed by the overlap slowdown only where a collective is surely in flight, the longest path through
# the program) and simulates them in the order of their bounds while BOUND_SLACK x a bound is below
# the fastest simulated time (the first one in full). The bound would be exact if contention never
# sped a collective up; in the flow model it sometimes does (a flow's sub-flows on adaptive paths: up
# to 7% on a data all-reduce with z running, Alps and Perlmutter), so the exhaustive check
# (benchmarks/search_exhaustive.py: every valid grid of several studies simulated) measures simulated
# / bound: at least 0.99943 over every grid of Frontier, Alps and Perlmutter studies (1.0 on Frontier;
# the bound counts the overlap slowdown where a collective is surely in flight), and the grid chosen
# the fastest of all in every study (6 studies, 106-412 grids each, the default Frontier study
# included), the fastest at 0-based rank 0 to 12 of the estimate (and of the exact ranking). The slack
# is 3.5x the worst shortfall measured; SCAN leaves room beyond rank 12. A grid's bound is first taken
# without routing (twin.predict.bounds.quick_bound, at most lower_bound: proved, and checked on every grid by
# the same benchmark), then with the exact times of the axes routed already in this process
# (twin.predict.bounds.routed_bound, between the two); nothing is routed for a bound. A grid that is simulated
# in the bound search stops as soon as its clock plus the least time left (twin.predict.bounds.tail_ns: the
# same bound from the op running on, without the overlap slowdown) rules it out, and a run stopped
# before the end of the step never routes the data axis, which only the gradient all-reduces at the
# end use.
SCAN = 16
BOUND_SLACK = 0.998


def _part(tick, lo: float, hi: float):
    """`tick` (a progress callback taking the share done, 0-1) for the part of the work from lo to hi."""
    return None if tick is None else (lambda f: tick(lo + (hi - lo) * f))


def search(study: Study, top: int = 10, simulate_top: int = 2, collectives=None, tick=None) -> list[Candidate]:
    """Every valid grid ranked by the analytical model (twin.predict.search.rank_grids: the best `top` exactly),
    the best `simulate_top` of them simulated; then grid auto's bound search (`_bound_search`) over
    the analytical top max(simulate_top, 2) + SCAN of the routing-free estimate (at least grid auto's
    pool), with the fastest simulated so far as the time to beat, so that search and grid auto find
    the same fastest grid. Returns the best `top` of the ranking and any grid simulated beyond them
    (with its exact estimate), in ranking order. `tick(share done)`: progress, where given."""
    ranked = rank_grids(study, collectives, keep=None if collectives is not None else max(top, simulate_top))
    best = math.inf
    for i, c in enumerate(ranked[:simulate_top]):
        best = min(best, _simulate(study, c, collectives))
        if tick is not None:
            tick(0.5 * (i + 1) / simulate_top)
    shown = ranked[:max(top, simulate_top)]
    if collectives is None:
        done = {str(c.grid): c for c in shown}
        pool = [c for c in estimate_grids(study)[:max(simulate_top, 2) + SCAN]
                if str(c.grid) not in done or done[str(c.grid)].simulated_s is None]
        _bound_search(study, pool, best, _part(tick, 0.5, 1.0))
        for c in pool:
            if c.simulated_s is None:
                continue
            e = done.get(str(c.grid))
            if e is None:
                e = exact_estimate(study, c.grid)
                shown.append(e)
            e.result, e.simulated_s, e.bound_s = c.result, c.simulated_s, c.bound_s
    return shown[:top] + sorted((c for c in shown[top:] if c.simulated_s is not None),
                                key=lambda c: (c.analytical_s, str(c.grid)))


def _auto(study: Study, simulate_top: int, collectives, tick=None) -> list[Candidate]:
    """The grids grid auto looks at: the analytical top simulate_top + SCAN by the routing-free
    estimate (twin.predict.search.estimate_grids), every one through `_bound_search` (the first one it takes,
    the best bound, simulated in full; each other simulated, and stopped partway where its bound
    rules it out, or not at all). With a stand-in collective model: the top simulate_top of the exact
    ranking, all simulated."""
    if collectives is not None:
        looked = rank_grids(study, collectives)[:simulate_top]
        for c in looked:
            _simulate(study, c, collectives)
        return looked
    looked = estimate_grids(study)[:simulate_top + SCAN]
    _bound_search(study, looked, math.inf, tick)
    return looked


def _bound_search(study: Study, pool: list[Candidate], best: float, tick=None) -> float:
    """Simulate the grids of `pool` that could beat `best` (seconds), best bound first; returns the
    fastest simulated time. Each grid's key is the largest lower bound the search has for it, first
    quick_bound, then routed_bound (the exact times of the axes routed so far) once the quick bound
    is the smallest key; a grid is simulated once its routed_bound is the smallest key, while
    BOUND_SLACK x its key is below the fastest simulated time (no bound routes anything; the
    simulation routes what it asks). A simulation stops as soon as its clock plus the least time left
    (twin.predict.bounds.tail_ns) shows the same (simulate_grid's stop_s): that grid keeps the bound it
    reached, and no time (`simulated_s` stays None). `tick(share done)`: progress, as the share of the
    at most two steps per grid taken so far (an estimate: the search usually ends sooner)."""
    queue = []
    for i, (c, bound) in enumerate(zip(pool, quick_bounds(study, [c.grid for c in pool]))):
        c.bound_s = bound
        queue.append((bound, str(c.grid), False, i))
    heapq.heapify(queue)
    steps = 0
    while queue:
        if tick is not None:
            tick(steps / (2 * len(pool)))
        steps += 1
        bound, name, exact, i = heapq.heappop(queue)
        if BOUND_SLACK * bound >= best:
            break  # neither this grid nor any with a larger bound can beat the fastest simulated grid
        c = pool[i]
        if exact:
            r = simulate_grid(study, c.grid, stop_s=best / BOUND_SLACK if math.isfinite(best) else 0.0)
            if r is None:
                c.bound_s = stopped_bound(study, c.grid)
            else:
                c.result, c.simulated_s = r, r.iteration_time_s
                best = min(best, r.iteration_time_s)
        else:
            c.bound_s = max(routed_bound(study, c.grid), stopped_bound(study, c.grid))
            heapq.heappush(queue, (c.bound_s, name, True, i))
    return best


def _simulate(study: Study, c: Candidate, collectives) -> float:
    r = simulate_grid(study, c.grid, collectives=collectives)
    c.result, c.simulated_s = r, r.iteration_time_s
    return r.iteration_time_s


def choose_grid(study: Study, simulate_top: int = 2, collectives=None, tick=None,
                pipelines: bool = True) -> tuple[Candidate, str]:
    """The grid `--grid auto` runs, the fastest simulated (its Candidate, with its symmetric-mode
    result), and a line saying how it was chosen. `tick(share done)`: progress, where given.
    pipelines: also consider pipelined grids (twin.predict.pipe_auto; a pipelined winner's Candidate
    carries its `study`, whose switches say the schedule and micro-batches)."""
    looked = _auto(study, simulate_top, collectives, tick)
    sims = [c for c in looked if c.simulated_s is not None]
    best = min(sims, key=lambda c: (c.simulated_s, str(c.grid)))
    bounded = [c for c in looked if c.bound_s is not None and c.simulated_s is None]
    stopped = sum(stopped_bound(study, c.grid) >= c.bound_s for c in bounded)
    how = "" if collectives is not None else " (routing-free estimate)"
    why = ""
    if collectives is None and pipelines:  # pipelined grids (twin.predict.pipe_auto)
        from twin.predict.pipe_auto import consider_pipelines
        best, why = consider_pipelines(study, best, BOUND_SLACK)
    return best, (f"auto: fastest simulated of the analytical top {len(looked)}{how} "
                  f"({', '.join(f'{c.grid} {c.simulated_s:.3f} s' for c in sims)}"
                  + (f"; {len(bounded)} more ruled out by their lower bound" if bounded else "")
                  + (f", {stopped} of them partway through their simulation" if stopped else "") + why + ")")
