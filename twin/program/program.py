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

from twin.program.blocks import Blocks
from twin.program.ends import Ends, grad_params, optimizer_sizes
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
                  batch: int | None = None, seq_len: int | None = None, stage: int = 0) -> Program:
    """Build the program of one iteration for one rank (the same for every rank of a pipeline stage;
    without a pipeline, for every rank).

    batch: global batch in sequences (default: the model's); seq_len: tokens per sequence; stage:
    the pipeline stage (0 <= stage < grid.pipe). Raises TwinError when the grid cannot run the model.
    """
    options = options or Options()
    batch = model.global_batch if batch is None else batch
    seq_len = model.seq_len if seq_len is None else seq_len
    if grid.pipe > 1:  # a pipeline stage's program
        from twin.program.pipeline import build_stage_program
        return build_stage_program(model, grid, options, batch, seq_len, stage)
    grid.validate(model, batch=batch, micro_batches=options.micro_batches, seq_len=seq_len)
    check_program_size(model, options)
    b = Builder(model, grid, options, batch, seq_len)
    blk = Blocks(b)
    ends = Ends(b, blk)
    layers = range(model.layers)
    for mb in range(options.micro_batches):
        b.prefix = f"mb{mb}." if options.micro_batches > 1 else ""
        b.ready, b.mb, b.phase = None, mb, "fwd"
        # forward
        b.start_pass(ends.fwd_order(layers, mb == 0))
        ends.emb_fwd()
        for i in layers:
            blk.fwd(i)
        ends.head_fwd()
        # backward
        b.phase = "bwd"
        b.start_pass(ends.bwd_order(reversed(layers)))
        ends.head_bwd()
        ends.blocks_bwd(reversed(layers))
        ends.emb_bwd()

    # end of step: after the backward pass, each gradient shard is all-reduced over data once its
    # reduce-scatter is done (in layer order), then the optimizer runs
    grad_ar = ends.grad_reductions(layers, ["emb", "head"] if model.is_llama else ["emb"])
    ends.optimizer(grad_ar, local_params(model, grid))
    return Program(model, grid, options, batch, seq_len, b.vocab, b.ops)


def same_ops_but_shards(a: Grid, b: Grid) -> bool:
    """Whether the programs of grids `a` and `b` (of one model, batch and switches) have the same ops,
    streams and deps, each op the same size except the data all-reduces of gradient shards and the
    optimizer's ops (`regrid` makes one from the other): equal G_x and G_y, equal G_z G_data, G_z > 1
    in both or neither, G_data > 1 in both or neither. G_z and G_data enter the program only through
    the tokens per rank (batch / (G_z G_data)), whether the z and data collectives exist, and the shard
    of each weight a rank holds (1 / (G_x G_y G_z))."""
    if a.pipe > 1 or b.pipe > 1:  # a stage's program: built for its own grid
        return a == b
    return (a.x, a.y, a.z * a.data, a.z > 1, a.data > 1, a.expert, a.edata > 1) == \
        (b.x, b.y, b.z * b.data, b.z > 1, b.data > 1, b.expert, b.edata > 1)


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
    params, P = grad_params(model, program.vocab, program.seq_len), grid.tensor_size
    sizes = optimizer_sizes(local_params(model, grid))
    ops = list(program.ops)
    for i, op in enumerate(ops):
        if op.phase == "grad" and op.axis == "edata":  # an expert linear's (twin/program/moe.py)
            from twin.program.moe import expert_grad_bytes
            k, n = {ln: (k, n) for ln, k, n, _ in model.linear_shapes()}["mlp_" + op.weight.rsplit("_", 1)[1]]
            ops[i] = changed(op, bytes=expert_grad_bytes(model, grid, op.weight, k, n))
        elif op.phase == "grad" and op.weight == "routers":
            from twin.program.moe import router_params
            ops[i] = changed(op, bytes=GRAD_AR_BYTES * router_params(model, grid, range(model.layers)))
        elif op.phase == "grad" and op.axis == "data" and op.weight != "norms":
            ops[i] = changed(op, bytes=GRAD_AR_BYTES * params[op.weight] // P)
        elif op.phase == "opt" and op.role in sizes:
            ops[i] = changed(op, **sizes[op.role])
    return Program(model, grid, program.options, program.batch, program.seq_len, program.vocab, ops)
