"""Pipelined grids in grid auto and `twin search`: which pipeline (stages P, schedule, micro-batches)
could beat the best 4D grid, and whether it does (`consider_pipelines`).

For each P of PIPE_SIZES that divides the GPUs and the layers, a stage is a 4D job: L / P blocks on
G / P GPUs. Its grids are ranked by the analytical model of twin.predict.search on one micro-batch
(batch / M sequences: every micro-batch gathers, all-reduces and computes again, so a stage's step
is M micro-batches of it); a schedule with V chunks then takes, with uniform stages,
(M + (P - 1) / V) micro-batch times (the bubble, Narayanan et al. SC'21). The schedules looked at
are 1F1B with M in {P, 2P, 4P} and interleaved 1F1B (V = 2) with M in {P, 2P} (GPipe has 1F1B's
bubble and more memory in flight, so it never wins on time); only pipelines whose 5D grid runs the
model and fits in HBM count. The best estimate is put on the scale of the simulation by the ratio of
the best 4D grid's simulated time to its estimate (the same estimate, routing-free probes); when it
could then beat the 4D grid (below it / BOUND_SLACK), it is simulated, stage by stage
(twin.engine.pipeline), and chosen if it is faster.
"""

from __future__ import annotations

import dataclasses

from topologies.common import TwinError
from twin.predict.run import simulate_grid
from twin.predict.search import Candidate, _pairs, _probe_all, analytical, bandwidth_for, estimate_grids
from twin.predict.study import Study, check_grid
from twin.program.grid import Grid
from twin.program.pipeline import check_pipeline

PIPE_SIZES = (2, 4, 8, 16)
STAGE_TOP = 3   # stage grids of each (P, M) looked at, best estimate first


@dataclasses.dataclass
class PipelineChoice:
    """A pipelined grid with its switches (schedule, chunks, micro-batches) and its estimate (s)."""

    grid: Grid
    study: Study
    estimate_s: float
    stage_estimate_s: float  # one micro-batch through one stage (s)


def pipeline_choices(study: Study) -> list[PipelineChoice]:
    """Every pipeline considered (module docstring) with its analytical estimate, best first. The
    stage grids are ranked once per P (on P micro-batches, twin.predict.search.estimate_grids); the
    best STAGE_TOP of them are estimated again for each schedule and micro-batch count."""
    model, gpus, o = study.model, study.gpus, study.options
    bw = bandwidth_for(study, optimistic=True)
    out: list[PipelineChoice] = []
    for P in PIPE_SIZES:
        if gpus % P or model.layers % P:
            continue
        layers = dataclasses.replace(model, layers=model.layers // P)

        def stage_study(M: int) -> Study:
            return dataclasses.replace(study, model=layers, gpus=gpus // P, batch=study.batch // M,
                                       options=dataclasses.replace(o, micro_batches=1))

        first = max(o.micro_batches, P)
        if study.batch % first:
            continue
        try:
            ranked = [c.grid for c in estimate_grids(stage_study(first))[:STAGE_TOP]]
        except TwinError:
            continue
        for sched, V, mults in (("1f1b", 1, (1, 2, 4)), ("interleaved", 2, (1, 2))):
            if model.layers % (P * V):
                continue
            for M in sorted({first * k for k in mults}):
                if study.batch % M:
                    continue
                stage = stage_study(M)
                opts = dataclasses.replace(o, micro_batches=M, schedule=sched, chunks=V)
                full = dataclasses.replace(study, options=opts)
                for g4 in ranked:
                    g = Grid(g4.x, g4.y, g4.z, g4.data, pipe=P)
                    try:
                        check_grid(stage, g4)
                        check_pipeline(model, g, opts)
                        check_grid(full, g)
                    except TwinError:
                        continue
                    _probe_all(bw, _pairs([g4]))
                    t = analytical(stage, g4, bw).analytical_s
                    out.append(PipelineChoice(g, full, t * (M + (P - 1) / V), t))
    out.sort(key=lambda p: (p.estimate_s, str(p.grid), p.study.options.schedule))
    return out


def describe(p: PipelineChoice) -> str:
    o = p.study.options
    return (f"{p.grid} ({o.schedule}" + (f", {o.chunks} chunks" if o.chunks > 1 else "")
            + f", {o.micro_batches} micro-batches)")


def consider_pipelines(study: Study, best: Candidate, slack: float) -> tuple[Candidate, str]:
    """Whether a pipelined grid beats `best` (a simulated 4D Candidate whose analytical_s is the
    routing-free estimate): (the winner, a clause saying what was looked at and why it won or lost)."""
    if study.profile.host is not None or study.options.chunks > 1:
        return best, ""
    choices = pipeline_choices(study)
    if not choices:
        return best, "; no pipelined grid runs it"
    scale = best.simulated_s / best.analytical_s if best.analytical_s > 0 else 1.0
    top = choices[0]
    predicted = top.estimate_s * scale
    what = f"; pipelines: {len(choices)} looked at, the best estimate {describe(top)} {predicted:.3f} s"
    if slack * predicted >= best.simulated_s:
        return best, what + f" (scaled to the simulation), not below {best.grid}'s {best.simulated_s:.3f} s"
    r = simulate_grid(top.study, top.grid, grid_choice="auto")
    if r.iteration_time_s >= best.simulated_s:
        return best, what + f", simulated {r.iteration_time_s:.3f} s: slower than {best.grid}"
    c = Candidate(top.grid, top.estimate_s, top.estimate_s, {}, r.memory_per_gpu_bytes, r.iteration_time_s, r)
    c.study = top.study  # its switches: the schedule and micro-batches
    return c, what + f", simulated {r.iteration_time_s:.3f} s: faster than {best.grid}'s {best.simulated_s:.3f} s"


def search_pipelines(study: Study, best: Candidate, slack: float) -> tuple[Candidate, str]:
    """`twin search`'s look at pipelines after its table: (the fastest, a sentence on the pipelines);
    slack: twin.predict.auto.BOUND_SLACK."""
    win, why = consider_pipelines(study, best, slack)
    if win is not best:
        o = win.study.options
        why += (f"; run it with --schedule {o.schedule} --micro-batches {o.micro_batches}"
                + (f" --chunks {o.chunks}" if o.chunks > 1 else ""))
    return win, (". P" + why[3:]) if why.startswith("; p") else why
