"""A large pipeline's iteration from one unit of each kind (`simulate_by_units`): what lets the twin
simulate Megatron-LM's 3,072-GPU run (64 stages, 512 micro-batches) in about a second.

The op-level path (twin.predict.pipelined) builds every stage's program, M micro-batches x V chunks
of ops, and runs them all. Here every stage's units (twin.engine.units) are timed from one unit of
each kind, built by twin.program.pipeline.build_stage_program with `units`:
- kinds: the forward or the backward of chunk c, on the first stage, the last, or any other (the
  middle stages do the same work), of the first micro-batch, the last, or any other (the first
  gathers what later ones reuse; the last leaves the gradients for the end of the step);
- a kind's UnitCost is its ops alone on its stage through the op-level engine (twin.engine.pipeline):
  compute, the collectives of its axes and their overlap, its sends and receives left out;
- twin.engine.units places all 2 M V units of every stage, with the sends between stages;
- the end of the step (the tied table's exchange, the data all-reduces, the clipping norm over the
  stages, the optimizer) runs op by op as in the op-level path, each stage starting it when its last
  unit ended;
- where the program makes compute wait for a send (Megatron-LM's synchronous sends), a stage's next
  unit waits for its sends too.

`use_units` says when: above UNITS_ABOVE ops in all the stage programs together.
"""

from __future__ import annotations

from dataclasses import replace

from twin.costs.p2p import pipeline_timers
from twin.engine.pipeline import PipelineResult, simulate_pipeline
from twin.engine.units import UnitCost, run_units
from twin.program.grid import AXES, Grid
from twin.program.ops import Op, Program
from twin.program.pipeline import P2P_KINDS, PIPE, build_stage_program, schedule
from twin.program.trace import Span

UNITS_ABOVE = 100_000  # ops in all stage programs (about 60 per block per micro-batch) above which units are used


def estimated_ops(model, options) -> int:
    """About how many ops the stage programs of a pipeline hold together (as check_program_size counts)."""
    return options.micro_batches * (60 * model.layers + 30)


def use_units(model, options) -> bool:
    """Whether a pipeline is simulated by units (module docstring)."""
    return estimated_ops(model, options) > UNITS_ABOVE


def _kinds(P: int, M: int) -> tuple[list[int], list[int]]:
    """The stages and micro-batches that stand for the others: first, one in the middle, last."""
    return sorted({0, min(1, P - 1), P - 1}), sorted({0, min(1, M - 1), M - 1})


def _stands_for(i: int, n: int) -> int:
    return i if i in (0, n - 1) else 1


def _sub_program(prog: Program, ops: list[Op], lead: bool) -> Program:
    """A program of `ops` (a slice of prog's, in order) alone: deps outside the slice dropped, sends and
    receives dropped unless `lead`; with `lead`, a first op `units` (its time: the stage's units) that
    every op without a dep left waits for."""
    keep = [op for op in ops if lead or op.kind not in P2P_KINDS]
    new = {op.index: i + lead for i, op in enumerate(keep)}
    out = [Op(0, "units", "elementwise", "compute")] if lead else []
    for op in keep:
        deps = tuple(new[d] for d in op.deps if d in new)
        out.append(replace(op, index=new[op.index], deps=deps or ((0,) if lead else ())))
    return replace(prog, ops=out)


def simulate_by_units(study, grid: Grid, cm, compute_times, record: bool = False):
    """One iteration of the study's pipelined `grid` by units (module docstring). cm: the collective
    model (twin.costs.p2p.PipelineModel or a stand-in); compute_times(program) -> seconds of each of
    its ops alone (0 for communication). Returns (PipelineResult, spans or None, padded vocabulary)."""
    o, P, V, M = study.options, grid.pipe, study.options.chunks, study.options.micro_batches
    stages, mbs = _kinds(P, M)
    units = [("F", j, c) for j in mbs for c in range(V)] + [("B", j, c) for j in mbs for c in reversed(range(V))]
    built: dict[int, tuple[Program, list[int], list[float]]] = {}
    for s in stages:
        bounds: list[int] = []
        prog = build_stage_program(study.model, grid, o, study.batch, study.seq_len, s, units=units, bounds=bounds)
        built[s] = (prog, bounds, compute_times(prog))
    costs: dict[tuple[int, tuple], UnitCost] = {}
    sim_ops = 0

    def cost(k: int, unit) -> UnitCost:
        nonlocal sim_ops
        kind, j, c = unit
        key = (_stands_for(k, P), (kind, _stands_for(j, M), c))
        hit = costs.get(key)
        if hit is None:
            prog, bounds, cs = built[key[0]]
            at = units.index(key[1])
            ops = prog.ops[bounds[at - 1] if at else 0:bounds[at]]
            sub = _sub_program(prog, ops, lead=False)
            sub_cs = [[cs[op.index] for op in ops if op.kind not in P2P_KINDS]]
            collective_s, p2p_s = pipeline_timers([sub], cm)
            r = simulate_pipeline([sub], sub_cs, collective_s, p2p_s, overlap_slowdown=study.profile.overlap_slowdown)
            sim_ops += r.simulated_ops
            hit = costs[key] = UnitCost(r.iteration_s, r.compute_s, {a: r.exposed_s[a] for a in AXES})
        return hit

    act_bytes = {s: next(op.bytes for op in built[s][0].ops if op.kind == "send" and op.phase != "grad")
                 for s in stages}  # an activation (or its gradient) sent between stages
    send_times: dict[tuple[int, int], float] = {}

    def send_s(k: int, peer: int) -> float:
        t = send_times.get((k, peer))
        if t is None:
            t = send_times[(k, peer)] = float(cm.p2p_time(k, peer, act_bytes[_stands_for(k, P)]))
        return t

    plans = [schedule(o.schedule, P, M, V, k) for k in range(P)]
    prog = built[stages[-1]][0]
    sends = {op.index for op in prog.ops if op.kind == "send"}
    blocking = any(d in sends for op in prog.ops if op.kind not in P2P_KINDS for d in op.deps)
    lines = run_units(plans, V, cost, send_s, record=record, blocking_sends=blocking)

    # the end of the step, op by op, each stage's starting when its units ended
    tails, tail_cs = [], []
    for k in range(P):
        prog, bounds, cs = built[_stands_for(k, P)]
        ops = [replace(op, peer=(P - 1 - k) if op.kind in P2P_KINDS else op.peer) for op in prog.ops[bounds[-1]:]]
        sub = _sub_program(replace(prog, stage=k), ops, lead=True)
        tails.append(sub)
        tail_cs.append([lines[k].end_s] + [0.0 if (op.is_collective or op.kind in P2P_KINDS) else cs[op.index]
                                           for op in prog.ops[bounds[-1]:]])
    collective_s, p2p_s = pipeline_timers(tails, cm)
    tail = simulate_pipeline(tails, tail_cs, collective_s, p2p_s, overlap_slowdown=study.profile.overlap_slowdown,
                             record=record, stage_rank=lambda k: k)
    it = tail.iteration_s
    mean = lambda xs: sum(xs) / P  # noqa: E731
    exposed = {a: mean([ln.exposed_s.get(a, 0.0) for ln in lines]) + tail.exposed_s[a] for a in AXES}
    exposed[PIPE] = mean([ln.pipe_s for ln in lines]) + tail.exposed_s[PIPE]
    rows = []
    for k, ln in enumerate(lines):
        c_tail, b_tail, i_tail = tail.stage_s[k]
        unit_idle = ln.end_s - ln.compute_s - sum(ln.exposed_s.values()) - ln.bubble_s - ln.pipe_s
        rows.append((ln.compute_s + c_tail - ln.end_s, ln.bubble_s + b_tail, unit_idle + i_tail))
    res = PipelineResult(iteration_s=it, compute_s=mean([r[0] for r in rows]), exposed_s=exposed,
                         idle_s=mean([r[2] for r in rows]),
                         simulated_ops=sim_ops + sum(len(p) for p in plans) + tail.simulated_ops - P,
                         ranks=P, classes=P, bubble_s=mean([r[1] for r in rows]), stage_s=rows)
    spans = None
    if record:
        spans = []
        for k, ln in enumerate(lines):
            rank = grid.rank(0, 0, 0, 0, pipe=k)
            for (kind, j, c), start, dur in ln.spans:
                name = f"mb{j}.chunk{c}.{'fwd' if kind == 'F' else 'bwd'}"
                spans.append(Span(rank, name, "unit", "compute", start, dur,
                                  {"micro_batch": j, "chunk": c, "unit": kind}))
        for k, i, start, dur in tail.spans:
            if i == 0:
                continue  # the stand-in for the units
            op = tails[k].ops[i]
            spans.append(Span(grid.rank(0, 0, 0, 0, pipe=k), op.name, op.kind, op.stream, start, dur, {}))
        spans.sort(key=lambda sp: (sp.rank, sp.start_s))
    return res, spans, built[0][0].vocab


__all__ = ["UNITS_ABOVE", "estimated_ops", "simulate_by_units", "use_units"]
