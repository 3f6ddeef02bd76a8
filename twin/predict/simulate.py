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
from dataclasses import asdict, dataclass

from topologies import caches
from topologies.system import SystemSpec
from twin.predict.bounds import quick_bounds, routed_bound, tail_ns
from topologies.common import TwinError
from twin.engine.engine import NS, Stopped, simulate_program
from twin.host import sharing as shared_host
from twin.program.grid import AXES, Grid
from twin.costs.collectives import collective_timer
from twin.predict.memory import memory_per_gpu
from twin.program.model import ModelSpec
from twin.program.program import Options, Program, build_program
from twin.predict.result import LLAMA_FLOPS_CONVENTION, SimulationResult
from twin.predict.search import Candidate, estimate_grids, exact_estimate, rank_grids
from twin.predict.study import Study, check_grid, prepare
from twin.predict.study_cache import model_for, program_for, study_key
from twin.program.trace import Span, op_args


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
# symmetric runs of this process, the last 256; lower bounds (s) that stopped runs showed (stopped_bound)
_SIMULATED: OrderedDict[tuple[bytes, str], SimulationResult] = caches.register("twin.predict.simulate.simulated",
                                                                             OrderedDict())
_STOPPED: dict[tuple[bytes, str], float] = caches.register("twin.predict.simulate.stopped", {})


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
    p, km = study.profile, study.kernels
    if p.host is not None:  # ranks share their node's cores (CPU): the host model runs the program
        prog = shared_host.as_run(p.host, prog)
    if record:
        check_trace_size(len(prog.ops), grid.size if full else 1)
    cm = collectives if collectives is not None else model_for(study, grid)
    stop_ns = int(stop_s * NS)
    if p.host is not None:
        res = shared_host.simulate_shared(study, grid, prog, cm, full=full, slowdown=slowdown, record=record,
                                          stop_ns=stop_ns, tails=lambda: tail_ns(study, grid))
    else:
        compute_s = [0.0 if op.is_collective else km.kernel_time(op) for op in prog.ops]
        tails = tail_ns(study, grid) if stop_s else None
        res = simulate_program(prog, compute_s, collective_timer(prog, cm), full=full, slowdown=slowdown,
                               overlap_slowdown=p.overlap_slowdown, record=record,
                               stop_ns=stop_ns if tails is not None else 0, tail_ns=tails, by_size=True)
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


@dataclass(frozen=True)
class SimulationConfig:
    """What `simulate` predicts: the job (system, model, GPU count, grid, batch, switches) and how.

    Defaults: the system's default study (its model and GPU count), grid auto, the model's sequence
    length and the system's global batch. `program` (a program file, twin.program.programfile) fixes
    the model, grid, batch and switches. `full`: every rank simulated (`slowdown`: rank -> compute
    factor, stragglers); `record`: keep every op's span (SimulationResult.spans) for traces and plots;
    `simulate_top`: grid auto simulates the analytical top `simulate_top` (and any other grid its
    lower bound does not rule out)."""

    system: str | SystemSpec = "frontier"
    model: str | ModelSpec | None = None
    gpus: int | None = None
    grid: str | Grid | None = "auto"
    batch: int | None = None          # global batch (sequences)
    seq_len: int | None = None        # tokens per sequence
    options: Options | None = None
    placement: str = "contiguous"
    profile: str | None = None        # kernel profile name or file (None: the system's)
    gemm_tuning: bool = True
    full: bool = False
    slowdown: dict[int, float] | None = None
    record: bool = False
    simulate_top: int = 2
    program: Program | None = None


def simulate(config: SimulationConfig, *, collectives=None, progress=None) -> SimulationResult:
    """Simulate one training iteration as `config` says; see the module docstring.
    collectives: a stand-in collective model (anything with .time(kind, axis, nbytes, concurrent) ->
    seconds) in place of the flow model; progress(stage name): a callback, e.g. twin.present.progress.Stages."""
    t0 = time.perf_counter()
    c = config
    if c.slowdown and not c.full:
        raise TwinError("--slowdown needs --full: stragglers are simulated only when every rank is")
    model, gpus, grid, options, batch, seq_len = c.model, c.gpus, c.grid, c.options, c.batch, c.seq_len
    if c.program is not None:
        p = c.program
        model, gpus, grid, options, batch, seq_len = p.model, p.grid.size, p.grid, p.options, p.batch, p.seq_len
    study = prepare(c.system, model, gpus, batch, seq_len, options, c.placement, c.profile, c.gemm_tuning)
    result = None
    say = progress or (lambda stage: None)
    if grid is None or (isinstance(grid, str) and grid.strip().lower() == "auto"):
        if c.record and c.full:  # refuse an impossible trace before the search, not after it
            check_trace_size(min_ops_per_rank(study), study.gpus)
        say("ranking grids")
        best, how = choose_grid(study, simulate_top=c.simulate_top, collectives=collectives)
        g = best.grid
        if best.result is not None and not (c.full or c.slowdown or c.record):
            result = best.result  # already simulated in this very setting
            result.grid_choice = how
    else:
        g, how = (Grid.parse(grid) if isinstance(grid, str) else grid), "given"
    if result is None:
        say(f"simulating grid {g}" + (" (every rank)" if c.full else ""))
        result = simulate_grid(study, g, full=c.full, slowdown=c.slowdown, record=c.record, collectives=collectives,
                               grid_choice=how, program=c.program)
    result.wall_time_s = time.perf_counter() - t0
    return result
