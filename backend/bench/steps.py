"""Recorded training steps for backend.bench.bench: every op's cost inside training (span, on-CPU time,
overlap, wake-up after a collective) and the executor's host time between compute ops."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from backend.bench.timing import mean_over_ranks, world_group
from twin.program.model import load_model
from twin.program.ops import COLLECTIVES
from twin.program.program import Options, build_program
from twin.program.trace import covered_share, host_gaps

# every kind of collective the program has, the MoE all-to-alls included: a gap with one in flight is
# no host time, and a compute op beside one is covered
COLLECTIVE_KINDS = COLLECTIVES


def rank_collectives(spans: list) -> list:
    """The collective spans of one rank's recorded step (every kind of COLLECTIVE_KINDS): those during
    which a gap between compute ops is no host time and a compute op is covered."""
    return [sp for sp in spans if sp.kind in COLLECTIVE_KINDS]


def kept_rows(rows: list[dict], recorded: set[str]) -> list[dict]:
    """The op rows a bench file keeps: those with a span, and every collective the recorder saw (names in
    `recorded`) even at a span of 0, mean over ranks and steps. A collective's span of 0 is a
    measurement: it completed while the one before it on its stream ran (an MoE step's expert-gradient
    all-reduces, on a process group of their own beside the data burst's), and the fit's lines keep the
    summed span of what the steps ran (docs/moe-backend.md)."""
    return [r for r in rows if r["seconds"] > 0 or (r["kind"] in COLLECTIVE_KINDS and r["name"] in recorded)]


WARMUP_STEPS = 2  # steps before the recorded ones: as many as validation leaves out of a run (calibration/validate.py)


def is_recorded(step: int, warmup: int = WARMUP_STEPS) -> bool:
    """Whether bench_steps records its step `step` (from 0): after the warm-up, every other step, the
    ones between unrecorded (their wall times are `free_step_s`), so that both sample the same
    stretch of the machine's time."""
    return step >= warmup and (step - warmup) % 2 == 0


def per_step(values: list[float]) -> float:
    """What an op costs per step, from its times in the recorded steps: their mean. The twin sums its
    ops into an iteration, and the mean of a sum is the sum of the means, whatever the shape of each
    op's spread (a run's iteration, the median of its step times, each a sum of hundreds of ops, is
    close to their mean); a median of a few steps is not, where a few steps run long."""
    return sum(values) / len(values)


def bench_steps(model: str, ctx, batch: int | None = None, steps: int = 4,
                warmup: int = WARMUP_STEPS) -> tuple[dict | None, list[dict]]:
    """`steps` recorded training steps of `model` on the grid of `ctx` (every rank at once, as in
    `backend run`): what the microbenchmarks cannot see, measured where it happens.

    Returns (host row, step rows):
    - host {op: "host", model, ops, seconds, mean_s, all_gaps_s, free_mean_s, busy_mean_s, busy_gaps,
      step_s, free_step_s}: the executor's host
      time per compute op, the median gap between consecutive compute ops of each step's compute
      stream during which no collective of the rank was in flight (a gap that holds a collective,
      often a wait for it, is communication, which the twin charges apart; on a tensor-parallel grid
      most gaps hold one), median over steps, mean over ranks. free_mean_s: the mean of those gaps
      (what they sum to per op: a few are long, when more ranks than cores time-slice);
      busy_mean_s: the mean of the gaps during which a collective of the rank was in flight and none
      was issued or completed (free_mean_s where a rank has fewer than 5), busy_gaps their count per
      rank: with more ranks than cores the host's dispatch runs longer beside gloo's threads;
      busy_by_kind_s, busy_by_kind_gaps: the same per kind of collective, over the gaps during which
      collectives of that kind alone were in flight (free_mean_s where a rank has fewer than 5);
      all_gaps_s: the median of every gap; mean_s: the mean gap; step_s: the wall time of a recorded
      step (train_step's call to its return: the program's ops, the gaps between them, and what runs
      outside the program), mean over steps (`per_step`) and over ranks; free_step_s: the same of as many
      unrecorded steps, each run after a recorded one: recording lengthens a step (the recorder's
      bookkeeping per op and its completion callback per collective, on gloo's thread, where ranks
      time-slice the cores; mixtral-tiny on the 2-core development VM: recorded steps 1.14x the
      unrecorded ones on 2x1x1x4e2, 1.07x on 1x1x1x8e4, 1.01x on 1x1x1x2e2, docs/moe-backend.md),
      which calibration.measurements.unobserved takes out;
    - one row per program op {name, kind, role, stream, axis, bytes, flops, m, n, k, layout, seconds,
      covered, spread, cpu_s (compute ops on CPU), wake_s and issue_s (collectives)}: its span, mean over steps
      (`per_step`) and over ranks; `cpu_s`, the same of its on-CPU time (the recorder's cpu_us: where more ranks
      than cores time-slice, a rank descheduled inside an op leaves that op's span long and its
      on-CPU time as it was; the fit spreads the ranks' summed waits over their ops, as validation
      does); `covered`,
      the median fraction of a compute op's span during which a collective of its rank was in flight
      (0 for collectives). A collective's span runs from its issue (or the end of the previous one of
      its stream) to its completion, so it holds the wait for the group's last member. `wake_s`: from
      its completion to the start of the compute op that waited for it (the next compute op, where
      this collective completed last in the gap before it; 0 where no compute op waited): the rank's
      thread wakes up after gloo's, which takes a time slice when more ranks than cores share the node.
      `issue_s` (collectives): the host's wall time issuing it, from preparing its buffers to the
      return of the asynchronous call (the recorder's issue_us, backend/runtime/comm.py). `spread`: the
      coefficient of variation of its span over the ranks and the steps (standard deviation over
      mean): where ranks time-slice the cores, spans vary far more than their means show, and a
      collective overlapped with compute is exposed by more than its mean span implies.
    (None, []) when the backend has no program executor."""
    try:
        import backend.runtime.executor  # noqa: F401  (the program executor: before it, no such gaps to measure)
        from backend.models.build import make_model
        from backend.training.optim import make_optimizer, train_step
        from backend.runtime.recorder import NULL_RECORDER, Recorder
    except ImportError:
        return None, []
    spec = load_model(model)
    program = build_program(spec, ctx.grid, Options(), batch=batch)
    net = make_model(spec, ctx, program=program).to(ctx.device)
    opt = make_optimizer(net)
    seqs = program.batch // ctx.batch_shards
    gen = torch.Generator().manual_seed(ctx.rank)
    gaps: list[float] = []
    free: list[float] = []  # gaps no collective overlapped
    busy: list[float] = []  # gaps a collective in flight overlapped, none issued or completed in them
    busy_kind: dict[str, list[float]] = {}  # of those, the gaps with collectives of one kind in flight
    per_op: dict[str, list[float]] = {}
    per_cpu: dict[str, list[float]] = {}  # compute op -> on-CPU seconds (CPU only)
    cover: dict[str, list[float]] = {}
    wake: dict[str, list[float]] = {}  # collective -> delay from its completion to the compute op that waited on it
    issue: dict[str, list[float]] = {}  # collective -> the host's wall time issuing it (the recorder's issue_us)
    walls: list[float] = []  # each recorded step's wall time (s)
    free_walls: list[float] = []  # each unrecorded step's, one after each recorded step (s)
    for step in range(warmup + 2 * steps):
        tokens = torch.randint(0, spec.vocab, (seqs, program.seq_len + 1), generator=gen)
        recorded = is_recorded(step, warmup)
        rec = Recorder(device=ctx.device) if recorded else NULL_RECORDER
        if step >= warmup and world_group() is not None:
            # the ranks start each measured step together, as `backend run` starts its traced one: a
            # recorded step's analysis below ends at another time on each rank, which the next step's
            # first collectives would otherwise wait out
            dist.barrier(group=world_group())
        t0 = time.perf_counter()
        train_step(net, opt, [(tokens[:, :-1], tokens[:, 1:])], recorder=rec)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        if step < warmup:
            continue
        if not recorded:
            free_walls.append(time.perf_counter() - t0)
            continue
        walls.append(time.perf_counter() - t0)
        spans = rec.spans(ctx.rank)
        comp = sorted((sp for sp in spans if sp.stream == "compute"), key=lambda sp: sp.start_s)
        colls = rank_collectives(spans)
        waited: dict[str, float] = {}
        for g in host_gaps(comp, colls):
            gaps.append(g.seconds)
            if g.seconds > 0 and not g.in_flight:
                free.append(g.seconds)
            elif g.seconds > 0 and g.quiet:  # none issued or completed in it
                busy.append(g.seconds)
                if len(g.in_flight) == 1:
                    busy_kind.setdefault(next(iter(g.in_flight)), []).append(g.seconds)
            if g.waited is not None:
                waited[g.waited.name] = g.wake_s
        for sp in spans:
            per_op.setdefault(sp.name, []).append(sp.duration_s)
            if "cpu_us" in sp.args:
                per_cpu.setdefault(sp.name, []).append(sp.args["cpu_us"] / 1e6)
            cover.setdefault(sp.name, []).append(0.0 if sp.kind in COLLECTIVE_KINDS else covered_share(sp, colls))
            if sp.kind in COLLECTIVE_KINDS:
                wake.setdefault(sp.name, []).append(waited.get(sp.name, 0.0))
                if "issue_us" in sp.args:
                    issue.setdefault(sp.name, []).append(sp.args["issue_us"] / 1e6)
    net.recorder = NULL_RECORDER
    rows = []
    for op in program.ops:  # the same ops on every rank (one program): agree op by op, in program order
        cov = sorted(cover.get(op.name, [0.0]))
        rows.append({"name": op.name, "kind": op.kind, "role": op.role, "stream": op.stream,
                     "axis": op.axis or "", "bytes": op.bytes, "flops": op.flops, "m": op.m, "n": op.n,
                     "k": op.k, "layout": op.layout or "", "seconds": per_step(per_op.get(op.name, [0.0])),
                     "squares": per_step([x * x for x in per_op.get(op.name, [0.0])]),
                     "covered": cov[len(cov) // 2], "wake_s": per_step(wake.get(op.name, [0.0])),
                     "issue_s": per_step(issue.get(op.name, [0.0])),
                     # -1: not recorded (a collective, a GPU)
                     "cpu_s": per_step(per_cpu.get(op.name, [-1.0]))})
    keys = ("seconds", "squares", "covered", "wake_s", "issue_s", "cpu_s")
    group = world_group()
    if group is not None:
        t = torch.tensor([[r[k] for k in keys] for r in rows], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t /= dist.get_world_size()
        for r, values in zip(rows, t.tolist()):
            r.update(zip(keys, values))
    for r in rows:
        squares = r.pop("squares")  # mean over ranks and steps of the span squared
        if r["seconds"] > 0:
            r["spread"] = math.sqrt(max(squares - r["seconds"] ** 2, 0.0)) / r["seconds"]
        if r["kind"] not in COLLECTIVE_KINDS:
            del r["wake_s"]
        if r["kind"] not in COLLECTIVE_KINDS or r["issue_s"] <= 0:
            del r["issue_s"]
        if r["kind"] in COLLECTIVE_KINDS or r["cpu_s"] < 0:
            del r["cpu_s"]
        else:
            r["cpu_s"] = min(r["cpu_s"], r["seconds"])
    rows = kept_rows(rows, set(per_op))
    if not gaps:
        return None, rows
    gaps.sort()
    free.sort()
    median, mean = gaps[len(gaps) // 2], sum(gaps) / len(gaps)
    # every rank must take part in the means below: a rank without free gaps uses all of them
    host_s = free[len(free) // 2] if len(free) >= 5 else median
    free_mean = sum(free) / len(free) if len(free) >= 5 else mean
    busy_mean = sum(busy) / len(busy) if len(busy) >= 5 else free_mean
    by_kind = {k: mean_over_ranks(sum(v) / len(v) if len(v) >= 5 else free_mean)  # every rank, every kind
               for k, v in ((k, busy_kind.get(k, [])) for k in COLLECTIVE_KINDS)}
    kind_gaps = {k: mean_over_ranks(float(len(busy_kind.get(k, [])))) for k in COLLECTIVE_KINDS}
    host = {"op": "host", "numel": 0, "bytes": 0, "model": model, "ops": len(free) if len(free) >= 5 else len(gaps),
            "seconds": mean_over_ranks(host_s), "mean_s": mean_over_ranks(mean),
            "all_gaps_s": mean_over_ranks(median), "free_mean_s": mean_over_ranks(free_mean),
            "busy_mean_s": mean_over_ranks(busy_mean), "busy_gaps": mean_over_ranks(float(len(busy))),
            "busy_by_kind_s": by_kind, "busy_by_kind_gaps": kind_gaps,
            "step_s": mean_over_ranks(per_step(walls)), "free_step_s": mean_over_ranks(per_step(free_walls))}
    return host, rows
