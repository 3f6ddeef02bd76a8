"""The schedule of one training iteration for one rank: the contract between twin and backend.

`build_program(model, grid, options)` returns the ordered list of ops that every rank runs. Each op
has a stable name (e.g. `L12.mlp_up.bwd.dgrad`), a kind, a stream (`compute` or the communication
stream of an axis: `x`, `y`, `z`, `data`), the indices of the ops it waits for, and its sizes.
Ops on one stream run in program order; `deps` holds only the waits across streams.

Naming: `[mb<j>.]<layer>.<pass>.<what>`; layers are `emb`, `L<i>.{ln1,qkv,attn,attn_out,ln2,mlp_up,
gelu,mlp_down}`, `lnf`, `head`, `loss` (a Llama block: `L<i>.{ln1,qkv,rope,attn,attn_out,ln2,mlp_up,
swiglu,mlp_down}`, its `ln*` RMSNorms); passes are `fwd`, `rec` (recomputed forward), `bwd`, `grad`
(gradient all-reduces at the end of the step) and `opt`. Collectives end in `ag_z`, `rs_z`, `ar_<axis>`.
The micro-batch prefix `mb<j>.` appears only with more than one micro-batch. A collective over an
axis of size 1 is left out.

Sharding (see docs/architecture.md): a linear layer's W (k x n) is split k/G_in by n/G_out and the block is
sharded again over z. Attention heads split over y: with grouped-query attention (a Llama) each y-shard
holds heads/G_y query heads and kv_heads/G_y key/value heads (so G_y divides kv_heads; the qkv layer's
columns of y-shard j are [q | k | v] of its heads), and mlp_up is gate and up fused into one GEMM whose
y-shard j holds [gate_j | up_j] (so G_y divides ffn); RoPE and SwiGLU are elementwise ops on y-split
tensors. A Llama's head is its own weight (untied), laid out as the embedding: vocabulary over y.
A normal layer has input features split over x and output over y; a transposed
layer the reverse. Tokens are split over z and data by whole sequences. Attention and the
elementwise ops on y-split activations are computed identically by the G_x ranks of an x-group
(`replicas`), so model flops are sum(flops / replicas) over ops, times the number of ranks.

Dataflow (what the backend's executor runs; the twin uses only kinds, streams, deps and sizes): each
op names the buffers it `reads` and `writes` (activations such as `x:L3` the input of block 3,
`L3.qkv.out`; `d:<buffer>` its gradient; `w:<weight>` a weight gathered over z; `g:<weight>` a weight
gradient before its reduce-scatter; `tokens`, `targets` the micro-batch), the parameters it uses
(`weight`, a key such as `L3.qkv`, `emb`, `head`, `L3.ln1`, `norms`), its `role` (the kernel of a
compute op, e.g. `layer_norm`, `attention_bwd`, `adamw`; what an all-reduce reduces: `ln_stats`,
`loss_sums`, `max`, `grad`, or its buffer in place), a buffer to `add` to its output (a residual) and
the weight whose gradients its output `accumulate`s into. `phase` (`fwd`, `rec`, `bwd`, `grad`, `opt`)
and `micro_batch` (-1 for the end of the step) say which part of the step it belongs to.

Code: twin/program/ops.py holds the pieces (Options, Op, Program, the Builder with the overlap switches, the
sharding helpers), twin/program/blocks.py the ops of a block (GPT or Llama), and this module the step around
the blocks (embedding, head, loss, the end-of-step gradient reductions, the optimizer); the names of
twin/program/ops.py are importable from here too.
"""

from __future__ import annotations

import math

from twin.program.blocks import Blocks
from twin.program.grid import Grid
from twin.program.model import ModelSpec
from twin.program.ops import (ACT_BYTES, ADAMW_BYTES_PER_PARAM, ADAMW_FLOPS_PER_PARAM, COLLECTIVES,
                      COMPUTE_KINDS, EMBEDDING_AXES, GRAD_AR_BYTES, MAX_PROGRAM_OPS, NORM_AXIS, STAT_BYTES,
                      STREAMS, Builder, Op, Options, Program, local_params, changed, check_program_size, embedding_dims,
                      grad_buffer, linear_dims, weight_buffer)

__all__ = ["ACT_BYTES", "ADAMW_BYTES_PER_PARAM", "ADAMW_FLOPS_PER_PARAM", "COLLECTIVES", "COMPUTE_KINDS",
           "EMBEDDING_AXES", "GRAD_AR_BYTES", "MAX_PROGRAM_OPS", "NORM_AXIS", "STAT_BYTES", "STREAMS", "Builder",
           "Op", "Options", "Program", "build_program", "check_program_size", "embedding_dims", "grad_buffer",
           "linear_dims", "regrid", "same_ops_but_shards", "weight_buffer"]


def build_program(model: ModelSpec, grid: Grid, options: Options | None = None,
                  batch: int | None = None, seq_len: int | None = None) -> Program:
    """Build the program of one iteration for one rank (the same for every rank).

    batch: global batch in sequences (default: the model's); seq_len: tokens per sequence.
    Raises TwinError when the grid cannot run the model.
    """
    options = options or Options()
    batch = model.global_batch if batch is None else batch
    seq_len = model.seq_len if seq_len is None else seq_len
    grid.validate(model, batch=batch, micro_batches=options.micro_batches, seq_len=seq_len)
    check_program_size(model, options)
    b = Builder(model, grid, options, batch, seq_len)
    h, gx, gy = model.hidden, grid.x, grid.y
    m, V, s = b.tokens, b.vocab, seq_len
    llama = model.is_llama
    wte_bytes = ACT_BYTES * math.prod(embedding_dims(grid, V, h))  # the head's bytes too (tied or not)
    emb_bytes = wte_bytes + (0 if llama else ACT_BYTES * math.prod(embedding_dims(grid, s, h)))
    linears = model.linear_shapes()
    W, D = weight_buffer, grad_buffer
    blk = Blocks(b)

    wbytes = {ln: ACT_BYTES * math.prod(linear_dims(grid, k, n, t)[:2]) for ln, k, n, t in linears}

    def cached(i: int, first_mb: bool) -> bool:
        return i < options.cache_layers and not first_mb

    def fwd_order(first_mb: bool) -> list[tuple[str, str, int]]:
        order = [("emb", "emb.fwd.ag_z", emb_bytes)]
        for i in range(model.layers):
            if not cached(i, first_mb):
                order += [(f"L{i}.{ln}", f"L{i}.{ln}.fwd.ag_z", wbytes[ln]) for ln, _, _, _ in linears]
        return order + [("head", "head.fwd.ag_z", wte_bytes)]

    def bwd_order() -> list[tuple[str, str, int]]:
        order = [("head", "head.bwd.ag_z", wte_bytes)]
        for i in reversed(range(model.layers)):
            if i < options.cache_layers:
                continue
            lin = linears if options.recompute else linears[::-1]
            order += [(f"L{i}.{ln}", f"L{i}.{ln}.bwd.ag_z", wbytes[ln]) for ln, _, _, _ in lin]
        return order

    x0, xl = "x:L0", f"x:L{model.layers}"
    for mb in range(options.micro_batches):
        b.prefix = f"mb{mb}." if options.micro_batches > 1 else ""
        b.ready, b.mb, b.phase = None, mb, "fwd"
        # forward
        b.start_pass(fwd_order(mb == 0))
        ag = b.gather("emb")
        b.main(b.compute("emb.fwd", "embedding", deps=[ag], flops=float(m * h // gx),
                         bytes=ACT_BYTES * 3 * m * h // gx, role="embedding", weight="emb",
                         reads=("tokens", W("emb")), writes=("emb.out",)))
        b.allreduce_ready("emb.fwd.ar_y", "y", ACT_BYTES * m * h // gx, "emb.out", x0)
        for i in range(model.layers):
            blk.fwd(i)
        blk.norm("lnf", xl, "lnf.out")
        ag = b.gather("head")
        b.main(b.gemm("head.fwd.gemm", m, V // gy, h // gx, "NT", "lnf.out", W("head"), "head.out", deps=[ag],
                      weight="head"))
        b.allreduce_ready("head.fwd.ar_x", "x", ACT_BYTES * m * V // gy, "head.out", "logits")
        if options.goldfish_h:  # the goldfish mask: integer hashing of h ids per target, no flops; the
            # data loader applies it to the targets (backend.training.goldfish), the loss still runs over every token
            b.compute("loss.fwd.mask", "elementwise", flops=0.0, bytes=8 * 2 * m, replicas=gx * gy,
                      role="goldfish_mask", reads=("targets",))
        local_sums = grid.y == 1  # nothing to reduce over y: the loss's sums are this rank's own
        b.compute("loss.fwd", "loss", flops=5.0 * m * V / gy, bytes=4 * m * V // gy, replicas=gx, role="loss",
                  reads=("logits", "targets"), writes=("loss.max",) + (("loss.sums",) if local_sums else ()))
        b.allreduce_ready("loss.fwd.ar_y_max", "y", STAT_BYTES * m, "loss.max", role="max")
        ar = b.collective("loss.fwd.ar_y_sum", "all_reduce", "y", STAT_BYTES * 2 * m, deps=[b.ready],
                          role="loss_sums", reads=("logits", "loss.max", "targets"), writes=("loss.sums",))
        b.ready = ar if ar is not None else b.ready
        # backward
        b.phase = "bwd"
        b.start_pass(bwd_order())
        b.compute("loss.bwd", "loss", flops=3.0 * m * V / gy, bytes=4 * m * V // gy, replicas=gx, role="loss_bwd",
                  reads=("logits", "targets", "loss.max", "loss.sums"), writes=(D("logits"),))
        # the head is a normal layer whose weight is wte^T: dgrad is NN, wgrad produces wte's layout
        kl, nl = h // gx, V // gy
        ag = b.gather("head")
        dgrad = b.main(b.gemm("head.bwd.dgrad", m, kl, nl, "NN", D("logits"), W("head"), D("lnf.out"), deps=[ag],
                              weight="head"))
        ar = b.collective("head.bwd.ar_y", "all_reduce", "y", ACT_BYTES * m * kl, deps=[dgrad],
                          reads=(D("lnf.out"),), writes=(D("lnf.out"),))
        wgrad = b.gemm("head.bwd.wgrad", nl, kl, m, "TN", D("logits"), "lnf.out", "g:head",
                       deps=[] if options.oar else [ar], weight="head")
        b.reduce_scatter("head", "head.bwd.rs_z", ACT_BYTES * kl * nl, wgrad)
        b.ready = ar if ar is not None else dgrad
        blk.norm_bwd("lnf", D("lnf.out"), D(xl))
        for i in reversed(range(model.layers)):
            if options.recompute:
                b.phase = "rec"
                blk.fwd(i)
                b.phase = "bwd"
            blk.bwd(i)
        b.compute("emb.bwd", "embedding", flops=float(m * h // gx), bytes=ACT_BYTES * 3 * m * h // gx,
                  role="embedding_bwd", weight="emb", reads=(D(x0), "tokens"), writes=("g:emb",))
        b.reduce_scatter("emb", "emb.bwd.rs_z", emb_bytes, b.ready)

    # end of step: after the backward pass, each gradient shard is all-reduced over data once its
    # reduce-scatter is done (in layer order), then the optimizer runs
    b.prefix, b.mb, b.phase = "", -1, "grad"
    grad_ar = []
    P = grid.tensor_size
    end_of_backward = b.ready
    params = _grad_params(model, V, s)
    for i in range(model.layers):
        for ln, k, n, _ in linears:
            key = f"L{i}.{ln}"
            grad_ar.append(b.collective(f"{key}.grad.ar_data", "all_reduce", "data",
                                        GRAD_AR_BYTES * params[key] // P, deps=[b.last_rs[key], end_of_backward],
                                        role="grad", weight=key))
    if llama:  # the untied head has its own gradient
        for key in ("emb", "head"):
            grad_ar.append(b.collective(f"{key}.grad.ar_data", "all_reduce", "data", GRAD_AR_BYTES * params[key] // P,
                                        deps=[b.last_rs[key], end_of_backward], role="grad", weight=key))
    else:
        grad_ar.append(b.collective("emb.grad.ar_data", "all_reduce", "data",
                                    GRAD_AR_BYTES * params["emb"] // P,
                                    deps=[b.last_rs["emb"], b.last_rs["head"], end_of_backward], role="grad",
                                    weight="emb"))
    norm_params = (model.layers * model.norm_params_per_layer + model.final_norm_params) // gx
    nz = b.collective("norms.grad.ar_z", "all_reduce", "z", STAT_BYTES * norm_params, deps=[b.ready],
                      role="grad", weight="norms")
    grad_ar.append(b.collective("norms.grad.ar_data", "all_reduce", "data", STAT_BYTES * norm_params,
                                deps=[nz if nz is not None else b.ready], role="grad", weight="norms"))
    sizes = _optimizer_sizes(local_params(model, grid))
    b.phase = "opt"
    clip = ()
    if options.grad_clip:
        b.compute("opt.norm", "elementwise", deps=grad_ar, role="grad_norm", writes=("opt.norm",),
                  **sizes["grad_norm"])
        for axis in ("x", "y", "z"):
            b.allreduce_ready(f"opt.clip.ar_{axis}", axis, STAT_BYTES, "opt.norm")
        grad_ar, clip = [], ("opt.norm",)
    b.compute("opt.step", "optimizer", deps=grad_ar, role="adamw", reads=clip, **sizes["adamw"])
    return Program(model, grid, options, batch, seq_len, b.vocab, b.ops)


def _grad_params(model: ModelSpec, vocab: int, seq_len: int) -> dict[str, int]:
    """Parameters of each weight whose gradient shards are all-reduced over data (a GPT's `emb`: its
    token and position tables, which the head shares; a Llama's `emb` and `head` apart)."""
    params = {f"L{i}.{ln}": k * n for i in range(model.layers) for ln, k, n, _ in model.linear_shapes()}
    if model.is_llama:
        params["emb"] = params["head"] = vocab * model.hidden
    else:
        params["emb"] = (vocab + seq_len) * model.hidden
    return params


def _optimizer_sizes(n_local: int) -> dict[str, dict]:
    """Flops and bytes of the optimizer's compute ops (by role) for `n_local` parameters on a rank."""
    return {"grad_norm": {"flops": 2.0 * n_local, "bytes": GRAD_AR_BYTES * n_local},
            "adamw": {"flops": float(ADAMW_FLOPS_PER_PARAM * n_local), "bytes": ADAMW_BYTES_PER_PARAM * n_local}}


def same_ops_but_shards(a: Grid, b: Grid) -> bool:
    """Whether the programs of grids `a` and `b` (of one model, batch and switches) have the same ops,
    streams and deps, each op the same size except the data all-reduces of gradient shards and the
    optimizer's ops (`regrid` makes one from the other): equal G_x and G_y, equal G_z G_data, G_z > 1
    in both or neither, G_data > 1 in both or neither. G_z and G_data enter the program only through
    the tokens per rank (batch / (G_z G_data)), whether the z and data collectives exist, and the shard
    of each weight a rank holds (1 / (G_x G_y G_z))."""
    return (a.x, a.y, a.z * a.data, a.z > 1, a.data > 1) == (b.x, b.y, b.z * b.data, b.z > 1, b.data > 1)


def regrid(program: Program, grid: Grid) -> Program:
    """The program `build_program` returns on `grid` (same model, batch and switches), made from
    `program`, the program of a grid with `same_ops_but_shards`: only the data all-reduces of gradient
    shards and the optimizer's ops are resized (a search builds one program per class of grids instead
    of one per grid; tests/test_program.py checks the result equals the built program)."""
    old = program.grid
    if not same_ops_but_shards(old, grid):
        raise ValueError(f"the program of grid {old} cannot be made the program of grid {grid}")
    model = program.model
    grid.validate(model, batch=program.batch, micro_batches=program.options.micro_batches, seq_len=program.seq_len)
    if old == grid:
        return program
    params, P = _grad_params(model, program.vocab, program.seq_len), grid.tensor_size
    sizes = _optimizer_sizes(local_params(model, grid))
    ops = list(program.ops)
    for i, op in enumerate(ops):
        if op.phase == "grad" and op.axis == "data" and op.weight != "norms":
            ops[i] = changed(op, bytes=GRAD_AR_BYTES * params[op.weight] // P)
        elif op.phase == "opt" and op.role in sizes:
            ops[i] = changed(op, **sizes[op.role])
    return Program(model, grid, program.options, program.batch, program.seq_len, program.vocab, ops)
