"""`simulate(...)`: one training iteration of a model on a system, the Python API behind `twin simulate`.

Pieces: the study (twin.predict.study: system spec, model, kernel profile), the program of the grid
(twin.program.program), the collective model (twin.costs.collectives.CollectiveModel on the job's rank placement),
and the engine (twin.engine.engine). `--grid auto` ranks every valid grid with the analytical model of
twin.predict.search on routing-free probes (`estimate_grids`), bounds the top few from below and simulates,
best bound first, those that their lower bound does not rule out (`choose_grid` here); `search`
ranks with the exact probes (`rank_grids`) for its table, simulates its top rows, and then does the
same.
"""

from __future__ import annotations

import copy
import heapq
import math
import time
from collections import OrderedDict
from dataclasses import asdict

from topologies.system import SystemSpec
from twin.predict.bounds import quick_bounds, routed_bound, tail_ns
from topologies.common import TwinError
from twin.engine.engine import NS, Stopped, simulate_program
from twin.program.grid import AXES, Grid
from twin.costs.kernels import host_times
from twin.predict.memory import memory_per_gpu
from twin.program.model import ModelSpec
from twin.program.program import Options, Program, build_program, host_ordered
from twin.predict.result import LLAMA_FLOPS_CONVENTION, SimulationResult
from twin.predict.search import Candidate, estimate_grids, exact_estimate, rank_grids
from twin.host.spread import drawn_runs, mean_result, mean_shares
from twin.predict.study import Study, check_grid, prepare
from twin.predict.study_cache import model_for, program_for, study_key
from twin.present.trace import Span, op_args


def collective_timer(program: Program, model):
    """collective_s(op index, concurrent axes) -> seconds, from `model.time` (which caches its answers):
    it depends on the op only through its (kind, axis, bytes) (twin.engine.engine's by_size)."""
    ops = program.ops

    def timer(i: int, concurrent: frozenset) -> float:
        op = ops[i]
        return float(model.time(op.kind, op.axis, op.bytes, concurrent=concurrent))

    return timer


MAX_SLOWDOWN = 1e3         # a straggler's compute at most this many times slower
MAX_TRACE_SPANS = 4_000_000  # recorded ops (trace events) of one run: about 1.2 GB of trace files
TRACE_EVENT_BYTES = 300      # bytes of one event in a trace file (Chrome JSON with its args), about


def check_trace_size(ops_per_rank: int, ranks: int) -> None:
    """Refuse, before simulating, to record a trace (--trace, --html) that would not fit in memory."""
    spans = ops_per_rank * ranks
    if spans > MAX_TRACE_SPANS:
        raise TwinError(f"a trace of this run would hold {spans:,} events ({ranks:,} ranks x {ops_per_rank:,} ops, "
                        f"about {spans * TRACE_EVENT_BYTES / 1e9:.1f} GB), more than the {MAX_TRACE_SPANS:,} the twin "
                        "records: trace without --full (one representative rank) or a smaller job")


def min_ops_per_rank(study: Study) -> int:
    """Ops of the study's program on one GPU: no grid has fewer (a grid adds collectives and splits
    no compute op away), so a trace too large at this count is too large on every grid."""
    return len(build_program(study.model, Grid(1, 1, 1, 1), study.options, study.batch, study.seq_len).ops)


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
_SIMULATED: OrderedDict[tuple[bytes, str], SimulationResult] = OrderedDict()  # symmetric runs of this process
_STOPPED: dict[tuple[bytes, str], float] = {}  # lower bounds (s) that stopped runs showed (stopped_bound)


def simulate_grid(study: Study, grid: Grid, *, full: bool = False, slowdown: dict[int, float] | None = None,
                  record: bool = False, collectives=None, grid_choice: str = "given",
                  program: Program | None = None, stop_s: float = 0.0) -> SimulationResult | None:
    """Simulate one iteration of the study on `grid` (checked first). `collectives` overrides the
    collective model (anything with .time(kind, axis, nbytes, concurrent=frozenset) -> seconds).
    A symmetric run (no full mode, slowdown, record or stand-in model) already made in this process
    for an equal study and grid is returned again (a copy), as search, --grid auto, scaling and
    sensitivity sweeps ask for the same grids.
    `program`: simulate this program (e.g. an edited program file) instead of the built one.
    stop_s > 0 (a plain symmetric run): give up, returning None, as soon as the iteration is sure to
    take longer than stop_s seconds (the engine's branch and bound, twin.predict.bounds.tail_ns); the lower
    bound that showed it is kept for the process (`stopped_bound`)."""
    t0 = time.perf_counter()
    plain = not (full or slowdown or record) and collectives is None and program is None
    if plain:
        key = (study_key(study), str(grid))
        hit = _SIMULATED.get(key)
        if hit is not None:
            _SIMULATED.move_to_end(key)
            result = copy.deepcopy(hit)
            result.grid_choice = grid_choice
            result.wall_time_s = time.perf_counter() - t0
            return result
    elif stop_s:
        raise ValueError("stop_s is for plain symmetric runs")
    try:
        result = _simulate_grid(study, grid, full=full, slowdown=slowdown, record=record, collectives=collectives,
                                grid_choice=grid_choice, program=program, stop_s=stop_s)
    except Stopped as e:
        bound = e.bound_ns / NS
        _STOPPED[key] = max(bound, _STOPPED.pop(key, 0.0))
        if len(_STOPPED) > 4096:
            _STOPPED.pop(next(iter(_STOPPED)))
        return None
    if plain:
        _SIMULATED[key] = copy.deepcopy(result)
        if len(_SIMULATED) > 256:
            _SIMULATED.popitem(last=False)
    result.wall_time_s = time.perf_counter() - t0
    return result


def stopped_bound(study: Study, grid: Grid) -> float:
    """The largest lower bound (seconds) on the grid's simulated time that a run stopped by
    simulate_grid's stop_s showed in this process (0 if none)."""
    return _STOPPED.get((study_key(study), str(grid)), 0.0)


def _simulate_grid(study: Study, grid: Grid, *, full: bool, slowdown: dict[int, float] | None,
                   record: bool, collectives, grid_choice: str, program: Program | None,
                   stop_s: float = 0.0) -> SimulationResult:
    t0 = time.perf_counter()
    check_grid(study, grid)
    if slowdown:
        if not full:
            raise TwinError("--slowdown needs --full: stragglers are simulated only when every rank is")
        for r, f in slowdown.items():
            if not 0 <= r < grid.size:
                raise TwinError(f"--slowdown: rank {r} is not a rank of grid {grid} (0..{grid.size - 1})")
            if not (isinstance(f, (int, float)) and 0 < f <= MAX_SLOWDOWN):
                raise TwinError(f"--slowdown: the factor of rank {r} must be a number in (0, {MAX_SLOWDOWN:g}], got {f}")
    prog = program or program_for(study, grid)
    if study.profile.host_ordered:  # the executor's host runs each op in program order (CPU)
        prog = host_ordered(prog)
    if record:
        check_trace_size(len(prog.ops), grid.size if full else 1)
    km = study.kernels
    cm = collectives if collectives is not None else model_for(study, grid)
    p = study.profile
    hosts = host_times(prog.ops, p.host_op_s, p.host_issue_s)
    timer = collective_timer(prog, cm)
    stretch, settled_runs = _settled_stretch(study, grid, prog, hosts, timer)
    compute_s = _compute_times(prog, km, p.stretch, stretch, hosts)
    drawn = stretch is not None and bool(p.span_spread)  # CPU: the mean over spans drawn at their spread
    tails = tail_ns(study, grid) if stop_s and not drawn else None
    engine_kw = dict(full=full, slowdown=slowdown, overlap_slowdown=p.overlap_slowdown, comm_share=p.comm_share)
    res = simulate_program(prog, compute_s, timer, record=record, stop_ns=int(stop_s * NS) if tails is not None else 0,
                           tail_ns=tails, by_size=True, **engine_kw)
    if drawn:  # the stretch's last draws are these where they ran in the same mode (symmetric)
        runs = settled_runs if settled_runs and not full else \
            drawn_runs(prog, compute_s, hosts, timer, p.span_spread, simulate_program, **engine_kw)
        res = mean_result(res, runs)
    flops = study.model.reference_flops(study.batch, study.seq_len, prog.vocab, study.options.recompute)
    it = res.iteration_s
    fps = flops / it
    mem = memory_per_gpu(study.model, grid, study.options, study.batch, study.seq_len, study.profile.activation_bytes)
    breakdown = {"compute": res.compute_s, "exposed_comm": {a: res.exposed_s[a] for a in AXES},
                 "idle": res.idle_s}
    result = SimulationResult(
        system=study.system.name, model=study.model.name, gpus=grid.size,
        grid={a: grid.axis_size(a) for a in AXES}, global_batch=study.batch, seq_len=study.seq_len,
        iteration_time_s=it, flops_per_iteration=flops, flops_per_s=fps, flops_per_s_per_gpu=fps / grid.size,
        percent_of_peak=100.0 * fps / (grid.size * study.system.gpu.peak_flops), breakdown_s=breakdown,
        memory_per_gpu_bytes=mem.total, simulated_ops=res.simulated_ops,
        mode="full" if full else "symmetric", simulated_ranks=res.ranks, placement=study.placement,
        profile=study.profile.name, options={**asdict(study.options), "gemm_tuning": km.tuning},
        grid_choice=grid_choice)
    if study.model.is_llama:
        result.flops_convention = LLAMA_FLOPS_CONVENTION
    if record:
        result.spans = [Span(r, prog.ops[i].name, prog.ops[i].kind, prog.ops[i].stream, s, d, op_args(prog.ops[i]))
                        for r, i, s, d in res.spans]
    result.wall_time_s = time.perf_counter() - t0
    return result


STRETCH_ROUNDS = 20  # at most this many simulations to settle a grid's stretch (1-4 in practice)


def shared_core_stretch(study: Study, grid: Grid, prog: Program, collectives) -> float | None:
    """How many times its on-CPU time a compute op of this grid takes while its ranks share the node's
    cores (twin.host.cores), or None where the profile does not model it (GPU profiles; CPU profiles fitted
    before it, or from files without on-CPU times): every grid then takes the profile's pooled
    `stretch`, which its compute op times hold. The busy shares come from the twin's own timeline,
    which the stretch lengthens: the fixed point, from the pooled stretch by twin.host.cores.fixed_point
    (each evaluation one symmetric simulation, or where the profile has a `span_spread` the mean shares of
    twin.host.spread's draws; the map's slope is (R - 1) / cores x c (1 - c) / stretch where the
    step lengthens with the compute, up to (R - 1) / cores x c / stretch where it does not: 0.56 on
    1x1x4x2 in cpu-2026-12-02c, under 1). Programs are host-ordered and timed as _simulate_grid does."""
    p = study.profile
    return _settled_stretch(study, grid, prog, host_times(prog.ops, p.host_op_s, p.host_issue_s),
                            collective_timer(prog, collectives))[0]


def _compute_times(prog: Program, km, pooled: float, stretch: float | None, hosts: list[float]) -> list[float]:
    """Each op's compute time (seconds; 0 for a collective): its kernel time, which holds the profile's
    `pooled` stretch, at this grid's own `stretch` (CPU; None: as it is), plus the host time before it."""
    scale = 1.0 if stretch is None else stretch / pooled
    return [0.0 if op.is_collective else km.kernel_time(op) * scale + h for op, h in zip(prog.ops, hosts)]


def _settled_stretch(study: Study, grid: Grid, prog: Program, hosts: list[float],
                     timer) -> tuple[float | None, list | None]:
    """shared_core_stretch, and the engine results of twin.host.spread's draws at it (symmetric mode;
    None where the profile has no `span_spread`): _simulate_grid's mean over draws, already run.
    hosts: each op's host time before it (seconds, twin.costs.kernels.host_times); timer: collective_timer."""
    from twin.host.cores import busy_shares, core_stretch, fixed_point, stretch_floor
    p = study.profile
    ranks = min(grid.size, study.system.gpus_per_node)
    if not (p.node_cores and p.stretch > 0) or ranks < 2:
        return None, None
    km = study.kernels
    floor = stretch_floor(ranks, p.node_cores, p.stretch)
    engine_kw = dict(overlap_slowdown=p.overlap_slowdown, record=True, comm_share=p.comm_share)
    last: dict[float, list] = {}  # the stretch last mapped -> its draws

    def mapped(stretch: float) -> float:  # the stretch that the shares of a timeline at `stretch` give
        compute = _compute_times(prog, km, p.stretch, stretch, hosts)
        if p.span_spread:  # twin.host.spread: the mean shares over spans drawn at their spread
            runs = drawn_runs(prog, compute, hosts, timer, p.span_spread, simulate_program, **engine_kw)
        else:
            runs = [simulate_program(prog, compute, timer, by_size=True, **engine_kw)]
        shares = mean_shares([busy_shares(r.spans, lambda i: prog.ops[i].is_collective, hosts.__getitem__)
                              for r in runs])
        last.clear()
        last[stretch] = runs
        return core_stretch(ranks, p.node_cores, p.collective_core_load, *shares, floor)

    stretch = fixed_point(mapped, p.stretch, rounds=STRETCH_ROUNDS)
    return stretch, last.get(stretch) if p.span_spread else None


def search(study: Study, top: int = 10, simulate_top: int = 2, collectives=None) -> list[Candidate]:
    """Every valid grid ranked by the analytical model (twin.predict.search.rank_grids: the best `top` exactly),
    the best `simulate_top` of them simulated; then grid auto's bound search (`_bound_search`) over
    the analytical top max(simulate_top, 2) + SCAN of the routing-free estimate (at least grid auto's
    pool), with the fastest simulated so far as the time to beat, so that search and grid auto find
    the same fastest grid. Returns the best `top` of the ranking and any grid simulated beyond them
    (with its exact estimate), in ranking order."""
    ranked = rank_grids(study, collectives, keep=None if collectives is not None else max(top, simulate_top))
    best = math.inf
    for c in ranked[:simulate_top]:
        best = min(best, _simulate(study, c, collectives))
    shown = ranked[:max(top, simulate_top)]
    if collectives is None:
        done = {str(c.grid): c for c in shown}
        pool = [c for c in estimate_grids(study)[:max(simulate_top, 2) + SCAN]
                if str(c.grid) not in done or done[str(c.grid)].simulated_s is None]
        _bound_search(study, pool, best)
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


def _auto(study: Study, simulate_top: int, collectives) -> list[Candidate]:
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
    _bound_search(study, looked, math.inf)
    return looked


def _bound_search(study: Study, pool: list[Candidate], best: float) -> float:
    """Simulate the grids of `pool` that could beat `best` (seconds), best bound first; returns the
    fastest simulated time. Each grid's key is the largest lower bound the search has for it, first
    quick_bound, then routed_bound (the exact times of the axes routed so far) once the quick bound
    is the smallest key; a grid is simulated once its routed_bound is the smallest key, while
    BOUND_SLACK x its key is below the fastest simulated time (no bound routes anything; the
    simulation routes what it asks). A simulation stops as soon as its clock plus the least time left
    (twin.predict.bounds.tail_ns) shows the same (simulate_grid's stop_s): that grid keeps the bound it
    reached, and no time (`simulated_s` stays None)."""
    queue = []
    for i, (c, bound) in enumerate(zip(pool, quick_bounds(study, [c.grid for c in pool]))):
        c.bound_s = bound
        queue.append((bound, str(c.grid), False, i))
    heapq.heapify(queue)
    while queue:
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


def choose_grid(study: Study, simulate_top: int = 2, collectives=None) -> tuple[Candidate, str]:
    """The grid `--grid auto` runs, the fastest simulated (its Candidate, with its symmetric-mode
    result), and a line saying how it was chosen."""
    looked = _auto(study, simulate_top, collectives)
    sims = [c for c in looked if c.simulated_s is not None]
    best = min(sims, key=lambda c: (c.simulated_s, str(c.grid)))
    bounded = [c for c in looked if c.bound_s is not None and c.simulated_s is None]
    stopped = sum(stopped_bound(study, c.grid) >= c.bound_s for c in bounded)
    how = "" if collectives is not None else " (routing-free estimate)"
    return best, (f"auto: fastest simulated of the analytical top {len(looked)}{how} "
                  f"({', '.join(f'{c.grid} {c.simulated_s:.3f} s' for c in sims)}"
                  + (f"; {len(bounded)} more ruled out by their lower bound" if bounded else "")
                  + (f", {stopped} of them partway through their simulation" if stopped else "") + ")")


def simulate(system: str | SystemSpec, model: str | ModelSpec | None = None, gpus: int | None = None,
             grid: str | Grid | None = "auto", batch: int | None = None, seq_len: int | None = None,
             options: Options | None = None, placement: str = "contiguous", full: bool = False,
             slowdown: dict[int, float] | None = None, gemm_tuning: bool = True, profile: str | None = None,
             record: bool = False, simulate_top: int = 2, collectives=None,
             program: Program | None = None, progress=None) -> SimulationResult:
    """Simulate one training iteration; see the module docstring. Defaults: the system's default
    study (model and GPU count), grid auto (the analytical top `simulate_top` + SCAN, bounded, those
    not ruled out simulated).
    With record=True the result's `spans` hold every op of every simulated rank (twin.present.trace.Span).
    program: simulate this program (twin.program.programfile); it fixes the model, grid, batch and switches."""
    t0 = time.perf_counter()
    if slowdown and not full:
        raise TwinError("--slowdown needs --full: stragglers are simulated only when every rank is")
    if program is not None:
        model, gpus, grid, options = program.model, program.grid.size, program.grid, program.options
        batch, seq_len = program.batch, program.seq_len
    study = prepare(system, model, gpus, batch, seq_len, options, placement, profile, gemm_tuning)
    result = None
    say = progress or (lambda stage: None)  # progress(stage name), e.g. twin.present.progress.Stages
    if grid is None or (isinstance(grid, str) and grid.strip().lower() == "auto"):
        if record and full:  # refuse an impossible trace before the search, not after it
            check_trace_size(min_ops_per_rank(study), study.gpus)
        say("ranking grids")
        best, how = choose_grid(study, simulate_top=simulate_top, collectives=collectives)
        g = best.grid
        if best.result is not None and not (full or slowdown or record):
            result = best.result  # already simulated in this very setting
            result.grid_choice = how
    else:
        g, how = (Grid.parse(grid) if isinstance(grid, str) else grid), "given"
    if result is None:
        say(f"simulating grid {g}" + (" (every rank)" if full else ""))
        result = simulate_grid(study, g, full=full, slowdown=slowdown, record=record, collectives=collectives,
                               grid_choice=how, program=program)
    result.wall_time_s = time.perf_counter() - t0
    return result
