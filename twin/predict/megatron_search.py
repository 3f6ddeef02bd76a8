"""`twin search --framework megatron`: Megatron-LM's configurations of a study (docs/megatron.md),
ranked by an estimate built from small simulations, the best simulated.

The configurations: tensor parallelism t (the grid's y axis) of 1, 2, 4 or 8 GPUs inside one node,
pipelines of p stages (p divides the layers and the GPUs / t), data parallelism d = GPUs / (t p), a
micro-batch of b sequences (1, 2, 4, 8 or 16; M = batch / (d b) micro-batches per iteration) and the
schedule: no pipeline (p = 1), 1F1B (M >= p) or interleaved with V chunks (V > 1 divides the layers of
a stage, M a multiple of p). Those whose grid runs the model and fits in HBM count.

The estimate of one configuration, from two symmetric simulations of one pipeline stage as a job of
its own (L / p blocks on t d GPUs, grid 1 x t x 1 x d, the stage's data all-reduce and optimizer
included): with one micro-batch (T1) and with two (T2). u = T2 - T1 is a micro-batch's forward and
backward through the stage, f = T1 - u what the step adds once, and the pipeline takes
u (M + (p - 1) / V) + f (the bubble of Narayanan et al., SC'21, uniform stages; the sends and the
embedding and head of the end stages are left out). The best `simulate_top` by the estimate are then
simulated in full (twin.engine.pipeline), and the published configuration, where the caller names one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from topologies.common import TwinError
from twin.predict.run import simulate_grid
from twin.predict.study import Study, check_grid
from twin.program.grid import Grid

TENSOR_SIZES = (1, 2, 4, 8)
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
MAX_CHUNKS = 8


@dataclass
class MegatronCandidate:
    """One configuration: its grid and switches (in `study`), its estimate and, once run, its simulation (s)."""

    grid: Grid
    study: Study
    micro_batch: int        # sequences per micro-batch
    estimate_s: float
    simulated_s: float | None = None
    result: object = None

    def describe(self) -> str:
        o = self.study.options
        sched = "" if self.grid.pipe == 1 else f", {o.schedule}" + (f" x{o.chunks}" if o.chunks > 1 else "")
        return f"{self.grid} (b={self.micro_batch}, M={o.micro_batches}{sched})"

    def key(self) -> tuple:
        o = self.study.options
        return (str(self.grid), o.micro_batches, o.schedule if self.grid.pipe > 1 else "", o.chunks)


def configurations(study: Study) -> list[tuple[Grid, int, int, str, int]]:
    """(grid, micro-batch size, micro-batches, schedule, chunks) of every configuration (module docstring)."""
    model, gpus, B = study.model, study.gpus, study.batch
    per_node = study.system.gpus_per_node
    out = []
    for t in TENSOR_SIZES:
        if t > per_node or gpus % t:
            continue
        for p in range(1, model.layers + 1):
            if model.layers % p or (gpus // t) % p:
                continue
            d = gpus // (t * p)
            for b in MICRO_BATCH_SIZES:
                if B % (d * b):
                    continue
                M = B // (d * b)
                grid = Grid(1, t, 1, d, pipe=p)
                if p == 1:
                    out.append((grid, b, M, "1f1b", 1))
                    continue
                if M >= p:
                    out.append((grid, b, M, "1f1b", 1))
                if M % p == 0:
                    per_stage = model.layers // p
                    out += [(grid, b, M, "interleaved", V) for V in range(2, min(per_stage, MAX_CHUNKS) + 1)
                            if per_stage % V == 0]
    return out


def _stage_times(study: Study, t: int, p: int, d: int, b: int, cache: dict) -> tuple[float, float] | None:
    """(u, f) of a stage (module docstring), or None where the stage job does not run."""
    key = (t, p, d, b)
    if key not in cache:
        layers = dataclasses.replace(study.model, layers=study.model.layers // p)
        times = []
        for m in (1, 2):
            o = dataclasses.replace(study.options, micro_batches=m, schedule="1f1b", chunks=1)
            s = dataclasses.replace(study, model=layers, gpus=t * d, batch=d * b * m, options=o)
            try:
                r = simulate_grid(s, Grid(1, t, 1, d))
            except TwinError:
                times = None
                break
            times.append(r.iteration_time_s)
        cache[key] = None if times is None else (times[1] - times[0], 2 * times[0] - times[1])
    return cache[key]


def megatron_search(study: Study, simulate_top: int = 3, published: tuple | None = None,
                    tick=None) -> list[MegatronCandidate]:
    """Every configuration that runs, best estimate first, the best `simulate_top` simulated (and the
    `published` one: (grid, micro-batch size, schedule, chunks)). Raises TwinError when none runs."""
    cache: dict = {}
    out: list[MegatronCandidate] = []
    confs = configurations(study)
    for i, (grid, b, M, sched, V) in enumerate(confs):
        if tick is not None:
            tick(0.8 * i / max(1, len(confs)))
        o = dataclasses.replace(study.options, micro_batches=M, schedule=sched, chunks=V)
        full = dataclasses.replace(study, options=o)
        try:
            check_grid(full, grid)
        except TwinError:
            continue
        st = _stage_times(study, grid.y, grid.pipe, grid.data, b, cache)
        if st is None:
            continue
        u, f = st
        est = u * (M + (grid.pipe - 1) / V) + f
        out.append(MegatronCandidate(grid, full, b, est))
    if not out:
        raise TwinError(f"no Megatron-LM configuration of {study.model.name} runs on {study.gpus} GPUs with a "
                        f"batch of {study.batch} (t in {TENSOR_SIZES}, micro-batches of {MICRO_BATCH_SIZES})")
    out.sort(key=lambda c: (c.estimate_s, c.key()))
    chosen = out[:simulate_top]
    if published is not None:
        chosen += [c for c in out if (str(c.grid), c.micro_batch, c.study.options.schedule if c.grid.pipe > 1 else "",
                                      c.study.options.chunks) == published and c not in chosen]
    for c in chosen:
        c.result = simulate_grid(c.study, c.grid, grid_choice="search (megatron)")
        c.simulated_s = c.result.iteration_time_s
    return out
