"""`simulate(...)`: one training iteration of a model on a system, the Python API behind `twin simulate`.

Pieces: the system spec (topologies.system), a kernel profile for its GPU (twin.profile reads
calibration/profiles),
the program of the grid (twin.program), the collective model (twin.collectives.CollectiveModel on the
job's rank placement), and the engine (twin.engine). `--grid auto` ranks every valid grid with the
analytical model of twin.search and simulates the best few.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from topologies.system import SystemSpec, load_system
from twin.engine import simulate_program
from twin.errors import TwinError
from twin.grid import AXES, Grid
from twin.kernels import KernelModel
from twin.memory import check_fits, memory_per_gpu
from twin.model import ModelSpec, load_model
from twin.profile import Profile, load_profile, profile_for_gpu
from twin.program import Options, Program, build_program
from twin.result import SimulationResult
from twin.trace import Span, op_args


@dataclass
class Study:
    """What to simulate, apart from the grid: system, model, GPU count, batch, switches, kernel model."""

    system: SystemSpec
    model: ModelSpec
    gpus: int
    batch: int          # global batch, sequences
    seq_len: int        # tokens per sequence
    options: Options
    placement: str      # contiguous | scattered
    profile: Profile
    kernels: KernelModel


def prepare(system: str | SystemSpec, model: str | ModelSpec | None = None, gpus: int | None = None,
            batch: int | None = None, seq_len: int | None = None, options: Options | None = None,
            placement: str = "contiguous", profile: str | None = None, gemm_tuning: bool = True) -> Study:
    """Resolve names and defaults (the system's default study) into a Study. Raises TwinError."""
    spec = load_system(system) if isinstance(system, str) else system
    if model is None:
        model = spec.default_model
        gpus = spec.default_gpus if gpus is None else gpus
    m = load_model(model) if isinstance(model, str) else model
    gpus = spec.default_gpus if gpus is None else gpus
    if gpus < 1 or gpus > spec.total_gpus:
        raise TwinError(f"{spec.name} has {spec.total_gpus} GPUs; --gpus {gpus} is out of range")
    if placement not in ("contiguous", "scattered"):
        raise TwinError(f"unknown placement {placement!r}: choose contiguous or scattered")
    prof_name = profile or getattr(spec, "profile", None)
    prof = load_profile(prof_name) if prof_name else profile_for_gpu(spec.gpu.name)
    batch = m.global_batch if batch is None else batch
    seq_len = m.seq_len if seq_len is None else seq_len
    if batch < 1 or seq_len < 1:
        raise TwinError(f"batch ({batch}) and sequence length ({seq_len}) must be positive")
    if options is not None and options.micro_batches < 1:
        raise TwinError(f"--micro-batches must be at least 1, got {options.micro_batches}")
    return Study(spec, m, gpus, batch, seq_len, options or Options(), placement, prof,
                 KernelModel(prof, tuning=gemm_tuning))


def check_grid(study: Study, grid: Grid) -> None:
    """Raise TwinError unless `grid` runs the study's model on its GPUs and fits in HBM."""
    grid.validate(study.model, gpus=study.gpus, batch=study.batch,
                  micro_batches=study.options.micro_batches, seq_len=study.seq_len)
    mem = memory_per_gpu(study.model, grid, study.options, study.batch, study.seq_len)
    check_fits(mem, study.system.gpu.hbm_bytes, f"{study.model.name} on grid {grid} of {study.system.name} ")


def collective_model(study: Study, grid: Grid):
    """The system's collective model for this grid on the study's rank placement."""
    from twin.collectives import CollectiveModel
    return CollectiveModel(study.system, grid, placement=study.placement)


def collective_timer(program: Program, model):
    """collective_s(op index, concurrent axes) -> seconds, from `model.time` (which caches its answers)."""
    ops = program.ops

    def timer(i: int, concurrent: frozenset) -> float:
        op = ops[i]
        return float(model.time(op.kind, op.axis, op.bytes, concurrent=concurrent))

    return timer


def simulate_grid(study: Study, grid: Grid, *, full: bool = False, slowdown: dict[int, float] | None = None,
                  record: bool = False, collectives=None, grid_choice: str = "given") -> SimulationResult:
    """Simulate one iteration of the study on `grid` (checked first). `collectives` overrides the
    collective model (anything with .time(kind, axis, nbytes, concurrent=frozenset) -> seconds)."""
    t0 = time.perf_counter()
    check_grid(study, grid)
    if slowdown:
        bad = [r for r, f in slowdown.items() if not 0 <= r < grid.size or f <= 0]
        if bad:
            raise TwinError(f"slowdown: rank {bad[0]} is not a rank of {grid.size} or its factor is not positive")
    prog = build_program(study.model, grid, study.options, study.batch, study.seq_len)
    km = study.kernels
    compute_s = [0.0 if op.is_collective else km.op_time(op) for op in prog.ops]
    cm = collectives if collectives is not None else collective_model(study, grid)
    res = simulate_program(prog, compute_s, collective_timer(prog, cm), full=full, slowdown=slowdown,
                           overlap_slowdown=study.profile.overlap_slowdown, record=record)
    flops = study.model.reference_flops(study.batch, study.seq_len, prog.vocab, study.options.recompute)
    it = res.iteration_s
    fps = flops / it
    mem = memory_per_gpu(study.model, grid, study.options, study.batch, study.seq_len)
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
    if record:
        result.spans = [Span(r, prog.ops[i].name, prog.ops[i].kind, prog.ops[i].stream, s, d, op_args(prog.ops[i]))
                        for r, i, s, d in res.spans]
    result.wall_time_s = time.perf_counter() - t0
    return result


def simulate(system: str | SystemSpec, model: str | ModelSpec | None = None, gpus: int | None = None,
             grid: str | Grid | None = "auto", batch: int | None = None, seq_len: int | None = None,
             options: Options | None = None, placement: str = "contiguous", full: bool = False,
             slowdown: dict[int, float] | None = None, gemm_tuning: bool = True, profile: str | None = None,
             record: bool = False, simulate_top: int = 2, collectives=None) -> SimulationResult:
    """Simulate one training iteration; see the module docstring. Defaults: the system's default
    study (model and GPU count), grid auto (analytical ranking, the best `simulate_top` simulated).
    With record=True the result's `spans` hold every op of every simulated rank (twin.trace.Span)."""
    t0 = time.perf_counter()
    study = prepare(system, model, gpus, batch, seq_len, options, placement, profile, gemm_tuning)
    result = None
    if grid is None or (isinstance(grid, str) and grid.strip().lower() == "auto"):
        from twin.search import choose_grid
        best, how = choose_grid(study, simulate_top=simulate_top, collectives=collectives)
        g = best.grid
        if best.result is not None and not (full or slowdown or record):
            result = best.result  # already simulated in this very setting
            result.grid_choice = how
    else:
        g, how = (Grid.parse(grid) if isinstance(grid, str) else grid), "given"
    if result is None:
        result = simulate_grid(study, g, full=full, slowdown=slowdown, record=record, collectives=collectives,
                               grid_choice=how)
    result.wall_time_s = time.perf_counter() - t0
    return result
