"""One iteration of a study on a pipelined grid (XxYxZxPxD, P > 1): the program of every stage
(twin.program.pipeline), their collectives and sends on the job's placement (twin.costs.p2p) and their
kernels' times through the pipeline engine (twin.engine.pipeline). Called by twin.predict.run.

On a CPU profile (ranks sharing a node's cores) the stages run through the same engine with the
profile's kernel times plus the host's time per op and per collective or send issued (its op_s and
issue_s); the rest of the host model (twin.host: the stretch of time-sliced ranks, the spread of
spans, collectives slowed beside compute) is not applied to pipelined grids.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from twin.costs.p2p import pipeline_timers
from twin.engine.pipeline import simulate_pipeline
from twin.predict.memory import memory_per_gpu
from twin.predict.result import LLAMA_FLOPS_CONVENTION, SimulationResult
from twin.predict.study import Study
from twin.predict.study_cache import model_for
from twin.program.grid import AXES, Grid
from twin.program.pipeline import P2P_KINDS, PIPE, in_flight, schedule, stage_programs
from twin.program.trace import Span, op_args


def stage_rank(grid: Grid, stage: int) -> int:
    """The rank that stands for `stage` in a pipelined run's spans (x = y = z = data = 0)."""
    return grid.rank(0, 0, 0, 0, pipe=stage)


def simulate_pipelined(study: Study, grid: Grid, *, record: bool = False, collectives=None,
                       grid_choice: str = "given", programs=None) -> SimulationResult:
    """Simulate one iteration of the study on the pipelined `grid` (already checked); `programs`: the
    stage programs to run instead of the built ones (a program file's)."""
    t0 = time.perf_counter()
    o = study.options
    progs = programs if isinstance(programs, list) else stage_programs(study.model, grid, o, study.batch,
                                                                       study.seq_len)
    km = study.kernels
    compute_s = [[0.0 if (op.is_collective or op.kind in P2P_KINDS) else km.kernel_time(op) for op in p.ops]
                 for p in progs]
    host = study.profile.host
    if host is not None:  # CPU ranks: the host's time per op and per collective or send issued before it
        for p, cs in zip(progs, compute_s):
            issued = 0
            for op in p.ops:
                if op.is_collective or op.kind in P2P_KINDS:
                    issued += 1
                else:
                    cs[op.index] += host.op_s + issued * host.issue_s
                    issued = 0
    cm = collectives if collectives is not None else model_for(study, grid)
    if not hasattr(cm, "p2p_time"):  # a stand-in collective model: sends cost nothing
        cm = _WithoutSends(cm)
    collective_s, p2p_s = pipeline_timers(progs, cm)
    res = simulate_pipeline(progs, compute_s, collective_s, p2p_s, overlap_slowdown=study.profile.overlap_slowdown,
                            record=record, stage_rank=lambda k: stage_rank(grid, k))
    flops = study.model.reference_flops(study.batch, study.seq_len, progs[0].vocab, o.recompute)
    it = res.iteration_s
    fps = flops / it
    mem = memory_per_gpu(study.model, grid, o, study.batch, study.seq_len, study.profile.activation_bytes)
    breakdown = {"compute": res.compute_s, "exposed_comm": {a: res.exposed_s[a] for a in AXES + (PIPE,)},
                 "bubble": res.bubble_s, "idle": res.idle_s}
    P = grid.pipe
    pipeline = {"schedule": o.schedule, "chunks": o.chunks, "micro_batches": o.micro_batches, "stages": P,
                "bubble_share": res.bubble_s / it if it else 0.0,
                "stages_s": [{"stage": k, "compute": c, "bubble": b, "idle": i,
                              "micro_batches_in_flight": in_flight(schedule(o.schedule, P, o.micro_batches,
                                                                            o.chunks, k))}
                             for k, (c, b, i) in enumerate(res.stage_s)]}
    result = SimulationResult(
        system=study.system.name, model=study.model.name, gpus=grid.size,
        grid={**{a: grid.axis_size(a) for a in AXES}, "pipe": P, **({"expert": grid.expert} if grid.expert > 1 else {})}, global_batch=study.batch,
        seq_len=study.seq_len, iteration_time_s=it, flops_per_iteration=flops, flops_per_s=fps,
        flops_per_s_per_gpu=fps / grid.size,
        percent_of_peak=100.0 * fps / (grid.size * study.system.gpu.peak_flops), breakdown_s=breakdown,
        memory_per_gpu_bytes=mem.total, simulated_ops=res.simulated_ops, mode="symmetric",
        simulated_ranks=P, placement=study.placement, profile=study.profile.name,
        options={**asdict(o), "gemm_tuning": km.tuning}, grid_choice=grid_choice, pipeline=pipeline,
        notes=list(study.notes))
    if study.model.is_llama:
        result.flops_convention = LLAMA_FLOPS_CONVENTION
    if record:
        by_rank = {stage_rank(grid, k): p for k, p in enumerate(progs)}
        result.spans = [Span(r, by_rank[r].ops[i].name, by_rank[r].ops[i].kind, by_rank[r].ops[i].stream, s, d,
                             op_args(by_rank[r].ops[i])) for r, i, s, d in res.spans]
        result.spans.sort(key=lambda sp: (sp.rank, sp.start_s))
    result.wall_time_s = time.perf_counter() - t0
    return result


class _WithoutSends:
    """A stand-in collective model (anything with .time) with free sends: for tests and bounds."""

    def __init__(self, model):
        self.model = model

    def time(self, *args, **kwargs) -> float:
        return self.model.time(*args, **kwargs)

    def p2p_time(self, a: int, b: int, nbytes: int) -> float:
        return 0.0

    def stages_all_reduce_time(self, nbytes: int) -> float:
        return 0.0
