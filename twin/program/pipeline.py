"""Pipeline parallelism: the program of one pipeline stage (`build_stage_program`), its schedule, and
the checks of a pipelined grid.

A grid XxYxZxPxD has P stages (rank order: x fastest, then y, z, the stage, data;
twin/program/grid.py). Each stage holds V model chunks (`Options.chunks`, V > 1 only with the
interleaved schedule): virtual stage v = c * P + s is chunk c of stage s and holds blocks
[v * L / (P V), (v + 1) * L / (P V)). The first virtual stage also holds the embedding, the last the
final norm, the head and the loss. The layers must split evenly: P V must divide the layer count
(an uneven split is refused with one line, as are the schedule rules below).

Schedules (`Options.schedule`), the order of a stage's units F(j, c) (the forward of micro-batch j
through chunk c) and B(j, c) (its backward, with the recomputed forward):
- gpipe: every forward, then every backward (micro-batches in order);
- 1f1b (Megatron-LM, PipeDream-Flush): P - s - 1 warm-up forwards, then one forward one backward,
  then the remaining backwards; needs at least P micro-batches;
- interleaved (Megatron-LM's virtual stages, Narayanan et al. SC'21): 1F1B over the V P virtual
  stages, micro-batches in groups of P, 2 (P - s - 1) + (V - 1) P warm-up units; needs V >= 2 and a
  multiple of P micro-batches.

Point to point. A chunk that does not start the model receives its input `x:L<a>` from the
previous virtual stage (`mb<j>.L<a>.fwd.recv`) and one that does not end it sends its output
(`mb<j>.L<b>.fwd.send`); the backward sends and receives the gradients of the same buffers
(`mb<j>.L<b>.bwd.recv`, `mb<j>.L<a>.bwd.send`). A send and its receive have the same name on the two
stages; `peer` is the other stage. Sends, receives and the pipeline's one all-reduce (the clipping
norm over the stages, `opt.clip.ar_pipe`) run on stream `pipe`. A GPT's head is tied to its token
embedding: the first and the last stage each keep the table and exchange its gradient shards at the
end of the step (`emb.grad.send` from the first stage, `head.grad.send` from the last), each adding
the other's to its own (as Megatron-LM's embedding group does), so that both apply the same update.
"""

from __future__ import annotations

from topologies.common import TwinError
from twin.program.blocks import Blocks
from twin.program.ends import Ends, grad_params
from twin.program.grid import Grid
from twin.program.model import ModelSpec
from twin.program.ops import (ACT_BYTES, GRAD_AR_BYTES, STAT_BYTES, Builder, Options, Program, check_program_size,
                              grad_buffer as D)

SCHEDULES = ("gpipe", "1f1b", "interleaved")
PIPE = "pipe"        # the stream (and axis) of a stage's point-to-point ops and its pipeline all-reduce
P2P_KINDS = ("send", "recv")


def check_pipeline(model: ModelSpec, grid: Grid, options: Options) -> None:
    """Raise TwinError (one line) when the pipeline of `grid` cannot run `model` with `options`."""
    P, V, M, sched = grid.pipe, options.chunks, options.micro_batches, options.schedule
    if sched not in SCHEDULES:
        raise TwinError(f"--schedule {sched!r} is not one of {', '.join(SCHEDULES)}")
    if not isinstance(V, int) or V < 1:
        raise TwinError(f"--chunks must be a positive integer, got {V!r}")
    if V > 1 and sched != "interleaved":
        raise TwinError(f"--chunks {V} needs --schedule interleaved (the {sched} schedule holds one chunk per stage)")
    if P == 1:
        return
    if sched == "interleaved" and V < 2:
        raise TwinError("--schedule interleaved needs --chunks of at least 2 (model chunks per pipeline stage)")
    if model.layers % (P * V):
        what = f"G_pipe*chunks = {P}*{V} = {P * V} model chunks" if V > 1 else f"G_pipe = {P} stages"
        raise TwinError(f"{model.layers} layers of {model.name} do not split evenly over {what}: "
                        f"choose a pipeline size (and --chunks) whose product divides {model.layers}")
    if sched == "1f1b" and M < P:
        raise TwinError(f"the 1f1b schedule needs at least G_pipe = {P} micro-batches, got {M}: "
                        f"use --micro-batches {P} or more (or --schedule gpipe)")
    if sched == "interleaved" and M % P:
        raise TwinError(f"the interleaved schedule needs a multiple of G_pipe = {P} micro-batches, got {M}: "
                        f"use --micro-batches {P * max(1, M // P)}")


def chunk_layers(model: ModelSpec, grid: Grid, options: Options, stage: int, chunk: int) -> range:
    """The blocks of chunk `chunk` of `stage` (virtual stage chunk * P + stage)."""
    n = model.layers // (grid.pipe * options.chunks)
    v = chunk * grid.pipe + stage
    return range(v * n, (v + 1) * n)


def stage_layers(model: ModelSpec, grid: Grid, options: Options, stage: int) -> list[int]:
    """Every block a stage holds, in order."""
    return [i for c in range(options.chunks) for i in chunk_layers(model, grid, options, stage, c)]


def schedule(kind: str, P: int, M: int, V: int, stage: int) -> list[tuple[str, int, int]]:
    """The units of `stage` in order: ("F" or "B", micro-batch, chunk)."""
    if kind == "gpipe":
        return [("F", j, 0) for j in range(M)] + [("B", j, 0) for j in range(M)]
    if kind == "1f1b":
        warm = min(P - stage - 1, M)
        units = [("F", j, 0) for j in range(warm)]
        for i in range(M - warm):
            units += [("F", warm + i, 0), ("B", i, 0)]
        return units + [("B", j, 0) for j in range(M - warm, M)]

    def unit(k: int, fwd: bool) -> tuple[str, int, int]:
        group, r = divmod(k, P * V)
        c = r // P
        return ("F" if fwd else "B", group * P + r % P, c if fwd else V - 1 - c)

    total = M * V
    warm = min(2 * (P - stage - 1) + (V - 1) * P, total)
    units = [unit(k, True) for k in range(warm)]
    for i in range(total - warm):
        units += [unit(warm + i, True), unit(i, False)]
    return units + [unit(k, False) for k in range(total - warm, total)]


def in_flight(units: list[tuple[str, int, int]]) -> int:
    """The most units whose forward ran and backward did not yet (activations kept), in a schedule."""
    live = peak = 0
    for kind, _, _ in units:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def stage_params(model: ModelSpec, grid: Grid, options: Options, stage: int, vocab: int) -> int:
    """Parameters whose optimizer state one rank of `stage` holds (its blocks' 3D shards, the tables its
    ends hold, and its norms' share)."""
    layers = stage_layers(model, grid, options, stage)
    first, last = stage == 0, stage == grid.pipe - 1
    block = sum(k * n for _, k, n, _ in model.linear_shapes())
    tables = (vocab + (0 if model.is_llama else model.seq_len)) * first + vocab * last
    sharded = len(layers) * block + tables * model.hidden
    if model.is_moe:  # experts and routers (twin/program/moe.py)
        from twin.program.moe_spec import moe_local_params
        return sharded // grid.tensor_size + _norm_params(model, grid, layers, last) + moe_local_params(model, grid, layers)
    return sharded // grid.tensor_size + _norm_params(model, grid, layers, last)


def _norm_params(model: ModelSpec, grid: Grid, layers: list[int], last: bool) -> int:
    return (len(layers) * model.norm_params_per_layer + model.final_norm_params * last) // grid.x


def build_stage_program(model: ModelSpec, grid: Grid, options: Options, batch: int, seq_len: int,
                        stage: int) -> Program:
    """The program of one rank of pipeline stage `stage` (module docstring)."""
    P, V, M = grid.pipe, options.chunks, options.micro_batches
    if not (isinstance(stage, int) and 0 <= stage < P):
        raise TwinError(f"stage {stage!r} is not a stage of grid {grid} (0..{P - 1})")
    grid.validate(model, batch=batch, micro_batches=M, seq_len=seq_len)
    check_pipeline(model, grid, options)
    check_program_size(model, options)
    b = Builder(model, grid, options, batch, seq_len)
    blk = Blocks(b)
    ends = Ends(b, blk)
    nv = P * V
    m, h, gx = b.tokens, model.hidden, grid.x
    act_bytes = ACT_BYTES * m * h // gx  # x:L<i> and its gradient on one rank (features over x)
    ready_after_fwd: dict[tuple[int, int], int | None] = {}

    def p2p(name: str, kind: str, peer_v: int, buf: str, deps) -> int:
        return b._add(name, kind, PIPE, deps, {"bytes": act_bytes, "axis": PIPE, "peer": peer_v % P,
                                              "reads": (buf,) if kind == "send" else (),
                                              "writes": (buf,) if kind == "recv" else ()})

    for kind, j, c in schedule(options.schedule, P, M, V, stage):
        v = c * P + stage
        layers = chunk_layers(model, grid, options, stage, c)
        a, e = layers.start, layers.stop
        first, last = v == 0, v == nv - 1
        b.prefix = f"mb{j}." if M > 1 else ""
        b.mb = j
        if kind == "F":
            b.phase, b.ready = "fwd", None
            b.start_pass(ends.fwd_order(layers, j == 0, emb=first, head=last))
            if first:
                ends.emb_fwd()
            else:
                b.ready = p2p(f"L{a}.fwd.recv", "recv", v - 1, f"x:L{a}", ())
            for i in layers:
                blk.fwd(i)
            if last:
                ends.head_fwd()
            else:
                p2p(f"L{e}.fwd.send", "send", v + 1, f"x:L{e}", [b.ready])
            ready_after_fwd[(j, c)] = b.ready
        else:
            b.phase = "bwd"
            b.start_pass(ends.bwd_order(reversed(layers), head=last))
            if last:
                b.ready = ready_after_fwd[(j, c)]
                ends.head_bwd()
            else:
                b.ready = p2p(f"L{e}.bwd.recv", "recv", v + 1, D(f"x:L{e}"), ())
            ends.blocks_bwd(reversed(layers))
            if first:
                ends.emb_bwd()
            else:
                p2p(f"L{a}.bwd.send", "send", v - 1, D(f"x:L{a}"), [b.ready])

    # end of step: a GPT's tied table exchanged between the first and the last stage, the data
    # all-reduces of this stage's gradient shards, the clipping norm over the stages, the optimizer
    b.prefix, b.mb, b.phase = "", -1, "grad"
    first, last = stage == 0, stage == P - 1
    tied: list[str] = []
    after: dict[str, list[int]] = {}
    tied_bytes = GRAD_AR_BYTES * model.padded_vocab(grid.y) * h // grid.tensor_size
    if not model.is_llama and (first or last):
        mine, theirs = ("emb", "head") if first else ("head", "emb")
        waits = [b.last_rs.get(mine), b.ready]
        b._add(f"{mine}.grad.send", "send", PIPE, waits,
                      {"bytes": tied_bytes, "axis": PIPE, "peer": P - 1 - stage, "weight": "head"})
        recv = b._add(f"{theirs}.grad.recv", "recv", PIPE, [],  # posted before the send is waited for
                      {"bytes": tied_bytes, "axis": PIPE, "peer": P - 1 - stage, "weight": "head",
                       "accumulate": "head"})
        after[mine] = [recv]
    if first:
        tied.append("emb")
    if last and (model.is_llama or not first):
        tied.append("head")
    layers = stage_layers(model, grid, options, stage)
    grad_ar = ends.grad_reductions(layers, tied, after=after, norm_params=_norm_params(model, grid, layers, last))
    ends.optimizer(grad_ar, stage_params(model, grid, options, stage, b.vocab),
                   pipe=lambda deps: b._add("opt.clip.ar_pipe", "all_reduce", PIPE, deps,
                                            {"bytes": STAT_BYTES, "axis": PIPE, "reads": ("opt.norm",),
                                             "writes": ("opt.norm",)}))
    return Program(model, grid, options, batch, seq_len, b.vocab, b.ops, stage=stage)


def stage_programs(model: ModelSpec, grid: Grid, options: Options, batch: int | None = None,
                   seq_len: int | None = None) -> list[Program]:
    """The program of every stage, in stage order."""
    batch = model.global_batch if batch is None else batch
    seq_len = model.seq_len if seq_len is None else seq_len
    return [build_stage_program(model, grid, options, batch, seq_len, s) for s in range(grid.pipe)]


def tied_bytes_of(program: Program) -> int:
    """Bytes of the tied table's gradient shard a GPT's end stages exchange (0 for a Llama)."""
    return sum(op.bytes for op in program.ops if op.kind == "send" and op.phase == "grad")


__all__ = ["P2P_KINDS", "PIPE", "SCHEDULES", "build_stage_program", "check_pipeline", "chunk_layers", "grad_params",
           "in_flight", "schedule", "stage_layers", "stage_params", "stage_programs"]
