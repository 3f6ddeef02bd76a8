"""One iteration of a study on one grid (`simulate_grid`), and the runs this process keeps.

The program of the grid (twin.program.program), its collectives on the job's rank placement
(twin.costs.collectives.CollectiveModel) and its kernels' times go through the engine
(twin.engine.engine); where the ranks share their node's cores, through the host model
(twin.host.sharing) instead. A plain symmetric run is kept for the process, since search, grid auto,
scaling and sensitivity sweeps ask for the same grids again.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from dataclasses import asdict

from topologies import caches
from topologies.common import TwinError
from twin.costs.collectives import collective_timer
from twin.engine.engine import NS, Stopped, simulate_program
from twin.host import sharing as shared_host
from twin.predict.bounds import tail_ns
from twin.predict.memory import memory_per_gpu
from twin.predict.result import LLAMA_FLOPS_CONVENTION, SimulationResult
from twin.predict.study import Study, check_grid, coverage_notes
from twin.predict.study_cache import model_for, program_for, study_key
from twin.program.grid import AXES, Grid
from twin.program.program import Program, build_program
from twin.program.trace import Span, op_args, wait_span

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


# symmetric runs of this process, the last 256; lower bounds (s) that stopped runs showed (stopped_bound)
_SIMULATED: OrderedDict[tuple[bytes, str], SimulationResult] = caches.register("twin.predict.run.simulated",
                                                                             OrderedDict())
_STOPPED: dict[tuple[bytes, str], float] = caches.register("twin.predict.run.stopped", {})



def simulate_grid(study: Study, grid: Grid, *, full: bool = False, slowdown: dict[int, float] | None = None,
                  record: bool = False, collectives=None, grid_choice: str = "given",
                  program: Program | None = None, stop_s: float = 0.0, tick=None) -> SimulationResult | None:
    """Simulate one iteration of the study on `grid` (checked first). `collectives` overrides the
    collective model (anything with .time(kind, axis, nbytes, concurrent=frozenset) -> seconds).
    A symmetric run (no full mode, slowdown, record or stand-in model) already made in this process
    for an equal study and grid is returned again (a copy), as search, --grid auto, scaling and
    sensitivity sweeps ask for the same grids.
    `program`: simulate this program (e.g. an edited program file) instead of the built one.
    stop_s > 0 (a plain symmetric run): give up, returning None, as soon as the iteration is sure to
    take longer than stop_s seconds (the engine's branch and bound, twin.predict.bounds.tail_ns); the lower
    bound that showed it is kept for the process (`stopped_bound`). `tick(fraction)`: progress of the
    engine's run (twin.engine.engine.simulate_program's tick)."""
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
                                grid_choice=grid_choice, program=program, stop_s=stop_s, tick=tick)
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
                   stop_s: float = 0.0, tick=None) -> SimulationResult:
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
    if grid.pipe > 1:
        if full or slowdown:
            raise TwinError(f"grid {grid} is pipelined: --full and --slowdown simulate unpipelined grids only "
                            "(a pipelined grid is simulated one representative rank per stage)")
        from twin.predict.pipelined import simulate_pipelined
        return simulate_pipelined(study, grid, record=record, collectives=collectives, grid_choice=grid_choice,
                                  programs=program)
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
                                          stop_ns=stop_ns, tails=lambda: tail_ns(study, grid), tick=tick)
    else:
        compute_s = [0.0 if op.is_collective else km.kernel_time(op) for op in prog.ops]
        tails = tail_ns(study, grid) if stop_s else None
        res = simulate_program(prog, compute_s, collective_timer(prog, cm), full=full, slowdown=slowdown,
                               overlap_slowdown=p.overlap_slowdown, record=record,
                               stop_ns=stop_ns if tails is not None else 0, tail_ns=tails, by_size=True, tick=tick)
    flops = study.model.reference_flops(study.batch, study.seq_len, prog.vocab, study.options.recompute)
    it = res.iteration_s
    fps = flops / it
    mem = memory_per_gpu(study.model, grid, study.options, study.batch, study.seq_len, study.profile.activation_bytes)
    breakdown = {"compute": res.compute_s, "exposed_comm": {a: res.exposed_s[a] for a in AXES},
                 "idle": res.idle_s}
    result = SimulationResult(
        system=study.system.name, model=study.model.name, gpus=grid.size,
        grid={a: grid.axis_size(a) for a in AXES} | ({"expert": grid.expert} if grid.expert > 1 else {}), global_batch=study.batch, seq_len=study.seq_len,
        iteration_time_s=it, flops_per_iteration=flops, flops_per_s=fps, flops_per_s_per_gpu=fps / grid.size,
        percent_of_peak=100.0 * fps / (grid.size * study.system.gpu.peak_flops), breakdown_s=breakdown,
        memory_per_gpu_bytes=mem.total, simulated_ops=res.simulated_ops,
        mode="full" if full else "symmetric", simulated_ranks=res.ranks, placement=study.placement,
        profile=study.profile.name, options={**asdict(study.options), "gemm_tuning": km.tuning},
        grid_choice=grid_choice, notes=coverage_notes(study, grid))
    if study.model.is_llama:
        result.flops_convention = LLAMA_FLOPS_CONVENTION
    if record:
        result.spans = [Span(r, prog.ops[i].name, prog.ops[i].kind, prog.ops[i].stream, s, d, op_args(prog.ops[i]))
                        for r, i, s, d in res.spans]
        result.waits = [wait_span(r, a, b, axis) for r, a, b, axis in res.waits]
    result.wall_time_s = time.perf_counter() - t0
    return result
