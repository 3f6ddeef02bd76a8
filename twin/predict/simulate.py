"""`simulate(config)`: one training iteration of a model on a system, the Python API behind
`twin simulate`.

A `SimulationConfig` says the job (system, model, GPU count, grid, batch, switches) and how to run it;
the study (twin.predict.study) resolves it once; grid auto picks the grid (twin.predict.auto) and
twin.predict.run simulates it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from topologies.common import TwinError
from topologies.system import SystemSpec
from twin.predict.auto import choose_grid
from twin.predict.result import SimulationResult
from twin.predict.run import check_trace_size, min_ops_per_rank, simulate_grid
from twin.predict.study import prepare
from twin.program.grid import Grid
from twin.program.model import ModelSpec
from twin.program.program import Options, Program


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
    program: Program | list[Program] | None = None


def simulate(config: SimulationConfig, *, collectives=None, progress=None) -> SimulationResult:
    """Simulate one training iteration as `config` says; see the module docstring.
    collectives: a stand-in collective model (anything with .time(kind, axis, nbytes, concurrent) ->
    seconds) in place of the flow model; progress(stage name): a callback, e.g. twin.present.progress.Stages
    (where it has a `part(fraction)` method, the engine's run reports its progress there)."""
    t0 = time.perf_counter()
    c = config
    if c.slowdown and not c.full:
        raise TwinError("--slowdown needs --full: stragglers are simulated only when every rank is")
    model, gpus, grid, options, batch, seq_len = c.model, c.gpus, c.grid, c.options, c.batch, c.seq_len
    if c.program is not None:
        p = c.program[0] if isinstance(c.program, list) else c.program  # a pipelined grid's: its stages
        model, gpus, grid, options, batch, seq_len = p.model, p.grid.size, p.grid, p.options, p.batch, p.seq_len
    study = prepare(c.system, model, gpus, batch, seq_len, options, c.placement, c.profile, c.gemm_tuning)
    result = None
    say = progress or (lambda stage: None)
    if grid is None or (isinstance(grid, str) and grid.strip().lower() == "auto"):
        if c.record and c.full:  # refuse an impossible trace before the search, not after it
            check_trace_size(min_ops_per_rank(study), study.gpus)
        say("ranking grids")
        if study.options.framework.startswith("megatron"):  # Megatron-LM's configurations (t, p, d, micro-batch, schedule)
            best, how = _megatron_choice(study, c.simulate_top, getattr(progress, "part", None))
        else:
            best, how = choose_grid(study, simulate_top=c.simulate_top, collectives=collectives,
                                    tick=getattr(progress, "part", None))
        g = best.grid
        study = getattr(best, "study", study)  # a pipelined grid's: its schedule and micro-batches
        if best.result is not None and not (c.full or c.slowdown or c.record):
            result = best.result  # already simulated in this very setting
            result.grid_choice = how
    else:
        g, how = (Grid.parse(grid) if isinstance(grid, str) else grid), "given"
    if result is None:
        say(f"simulating grid {g}" + (" (every rank)" if c.full else ""))
        result = simulate_grid(study, g, full=c.full, slowdown=c.slowdown, record=c.record, collectives=collectives,
                               grid_choice=how, program=c.program, tick=getattr(progress, "part", None))
    from twin.predict.ckptcost import checkpoint_cost
    result.checkpoint = checkpoint_cost(study.system, study.model, result.gpus, g.y).as_dict()
    result.wall_time_s = time.perf_counter() - t0
    return result


def _megatron_choice(study, simulate_top: int, tick):
    """Grid auto for --framework megatron: the fastest simulated of twin.predict.megatron_search."""
    from twin.predict.megatron_search import megatron_search
    cands = megatron_search(study, simulate_top=simulate_top, tick=tick)
    best = min((c for c in cands if c.simulated_s is not None), key=lambda c: (c.simulated_s, c.key()))
    return best, (f"auto (megatron): {best.describe()} the fastest of the {simulate_top} best by estimate, "
                  f"{len(cands)} configurations estimated")
