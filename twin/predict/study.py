"""What to simulate, resolved once: `prepare(...)` turns names and defaults into a `Study`
(system, model, GPU count, batch, switches, kernel model), and `check_grid` says whether a grid runs it.

Both `twin.predict.search` (ranking grids) and `twin.predict.simulate` (simulating one) start from a Study.
"""

from __future__ import annotations

from dataclasses import dataclass

from topologies.system import SystemSpec, load_system
from topologies.common import TwinError
from twin.program.grid import Grid
from twin.costs.kernels import KernelModel
from twin.predict.memory import check_fits, memory_per_gpu
from twin.program.model import ModelSpec, load_model
from twin.costs.profile import load_profile, profile_for_gpu
from twin.costs.profile_types import Profile
from twin.program.program import Options


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
    notes: tuple[str, ...] = ()  # what the prediction extrapolates, one line each (e.g. the profile's rank counts)


def prepare(system: str | SystemSpec, model: str | ModelSpec | None = None, gpus: int | None = None,
            batch: int | None = None, seq_len: int | None = None, options: Options | None = None,
            placement: str = "contiguous", profile: str | None = None, gemm_tuning: bool = True) -> Study:
    """Resolve names and defaults (the system's default study) into a Study. Raises TwinError."""
    spec = load_system(system) if isinstance(system, str) else system
    if model is None:  # the system's default study: its model, GPU count and (if it says one) batch
        model = spec.default_model
        gpus = spec.default_gpus if gpus is None else gpus
        batch = spec.default_batch or None if batch is None else batch
    m = load_model(model) if isinstance(model, str) else model
    gpus = spec.default_gpus if gpus is None else gpus
    if gpus < 1 or gpus > spec.total_gpus:
        raise TwinError(f"{spec.name} has {spec.total_gpus} GPUs; --gpus {gpus} is out of range")
    if placement not in ("contiguous", "scattered"):
        from topologies.datafile import did_you_mean
        raise TwinError(f"unknown placement {placement!r}:{did_you_mean(placement, ('contiguous', 'scattered'))} "
                        "choose contiguous or scattered")
    prof_name = profile or getattr(spec, "profile", None)
    prof = load_profile(prof_name) if prof_name else profile_for_gpu(spec.gpu.name)
    if abs(prof.peak_flops - spec.gpu.peak_flops) > 1e-6 * spec.gpu.peak_flops:
        raise TwinError(f"kernel profile {prof.name} says a GPU peaks at {prof.peak_flops:.4g} flop/s but system "
                        f"{spec.name} says {spec.gpu.peak_flops:.4g}: one machine has one peak, make them agree")
    per_node = min(gpus, spec.gpus_per_node)
    notes = tuple(n for n in (prof.coverage(per_node),) if n)
    prof = prof.for_ranks(per_node)  # ranks sharing a node (measured profiles)
    batch = m.global_batch if batch is None else batch
    seq_len = m.seq_len if seq_len is None else seq_len
    if batch < 1 or seq_len < 1:
        raise TwinError(f"batch ({batch}) and sequence length ({seq_len}) must be positive")
    if options is not None and options.micro_batches < 1:
        raise TwinError(f"--micro-batches must be at least 1, got {options.micro_batches}")
    if options is not None and options.moe_imbalance != 1.0:  # mixture of experts (twin/program/moe_spec.py)
        from twin.program.moe_spec import check_imbalance
        check_imbalance(m, options.moe_imbalance)
    return Study(spec, m, gpus, batch, seq_len, options or Options(), placement, prof,
                 KernelModel(prof, tuning=gemm_tuning), notes)


def check_grid(study: Study, grid: Grid) -> None:
    """Raise TwinError unless `grid` runs the study's model on its GPUs and fits in HBM."""
    grid.validate(study.model, gpus=study.gpus, batch=study.batch,
                  micro_batches=study.options.micro_batches, seq_len=study.seq_len)
    from twin.program.megatron import check_framework
    from twin.program.pipeline import check_pipeline
    check_framework(grid, study.options)
    check_pipeline(study.model, grid, study.options)
    mem = memory_per_gpu(study.model, grid, study.options, study.batch, study.seq_len, study.profile.activation_bytes)
    check_fits(mem, study.system.gpu.hbm_bytes, f"{study.model.name} on grid {grid} of {study.system.name} ")


def collective_model(study: Study, grid: Grid):
    """The system's collective model for this grid on the study's rank placement."""
    from twin.costs.collectives import CollectiveModel
    if grid.pipe > 1:  # the axes laid out on the 5D rank order, and point-to-point sends between stages
        from twin.costs.p2p import PipelineModel
        return PipelineModel(study.system, grid, placement=study.placement, measured=study.profile.collectives())
    return CollectiveModel(study.system, grid, placement=study.placement, measured=study.profile.collectives())


def coverage_notes(study: Study, grid: Grid) -> list[str]:
    """What a prediction of `grid` extrapolates, one line at most: the profile's rank-count note where
    the study lies outside its measured counts (prepare), else where the grid's collectives run over
    group sizes it recorded no line of inside training (Profile.grid_coverage)."""
    if study.notes:
        return list(study.notes)
    from twin.program.grid import AXES
    line = study.profile.grid_coverage({a: grid.axis_size(a) for a in AXES})
    return [line] if line else []
