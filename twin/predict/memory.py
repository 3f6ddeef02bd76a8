"""Memory per GPU of a model under a 4D grid (bytes), and the check that it fits.

Static state per parameter of the rank's shard, by precision (`activation_bytes`, the profile's):
- bf16 mixed precision (2): bf16 weights (2 bytes), fp32 gradients (4), fp32 master weights and Adam's
  two moments (12): 18 bytes, as Megatron-LM counts it (distributed-optimizer documentation, 18 bytes
  per parameter without sharding the optimizer state);
- fp32 (4, the backend on CPU, backend/training/optim.py): fp32 parameter shards, fp32 gradients, AdamW's two
  fp32 moments: 16 bytes.
Activations are counted at `activation_bytes` per element. In fp32, the backend's own policy, the
peak is the one measured on the backend's executor (`_backend_peak`: a GELU or layer-norm backward of
the first or last layer, with the gradients made so far; 35 gpt-small CPU grids within 2.3 %).
In bf16 (GPUs, not yet measured) the peak is taken where the backward pass starts on the last block
(backend/runtime/executor.py, which drops each buffer after its last use): the rank then holds, term by term,
- activations: what every block saved (or, recomputing, every block's input) and the last block's
  stash, plus the backward working set: the gradient of the GELU output (tokens x ffn/G_y; a Llama's:
  the gradient of gate and up, tokens x 2 ffn/G_y), alive
  with the stash at the mlp_down backward GEMMs; without recomputation also the incoming gradient of
  the block (tokens x h/G_x);
- gathered_weights (G_z > 1): the block's z-gathered weights but mlp_down's (released after its
  dgrad), the next layer's weight prefetched (oag; one more otherwise in flight), the cached layers,
  the full-size weight gradient of mlp_down held until its deferred z reduce-scatter completes, and,
  on gloo (CPU, fp32), the copy that the reduce-scatter built from an all-reduce reduces (comm.py);
- logits: fp32 logits of the micro-batch.
On gloo (CPU) with G_data > 1 a second peak comes at the end-of-step gradient reductions: the
executor issues every data-axis all-reduce on a flat copy of its weight's gradients (model.flat_grads)
and waits for them together, so the static state plus one fp32 copy of the rank's gradients is held
(the activations are gone). `reduction_buffers` is what that peak adds over the backward one (0 when
the backward peak is higher). Measured with torch's memory tracker on gpt-small, data-parallel grids peak
there, at the static state plus one copy of the gradients, whatever the batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from topologies.common import TwinError
from twin.program.grid import Grid
from twin.program.model import ModelSpec
from twin.program.program import ACT_BYTES, Options, local_params
from twin.predict.moe_memory import block_weights as moe_block_weights, moe_activation_extra

GIB = 1024**3
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12  # bf16 mixed precision (Megatron-LM)
FP32_BYTES = (4, 4, 8)  # fp32 training: parameter shard, gradient, Adam m and v
LOGIT_BYTES = 4  # fp32 logits for the loss; their gradient is written in place


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU, by what holds them."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int       # saved for the backward pass, plus one block's working set
    gathered_weights: int  # z-gathered weights in flight (prefetch), cached layers, full-size wgrads
    logits: int
    reduction_buffers: int = 0  # the gradient-reduction peak over the backward one (gloo, data > 1)

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations
                + self.gathered_weights + self.logits + self.reduction_buffers)

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def memory_per_gpu(model: ModelSpec, grid: Grid, options: Options | None = None,
                   batch: int | None = None, seq_len: int | None = None,
                   activation_bytes: int = ACT_BYTES, gloo: bool | None = None) -> Memory:
    """Peak memory of one rank during an iteration (bytes); the grid must already be valid.
    activation_bytes: bytes per activation element (the profile's; 4 on CPU, fp32).
    gloo: collectives run on gloo (its reduce-scatter reduces a full-size copy); default: on fp32 (CPU)."""
    gloo = activation_bytes >= 4 if gloo is None else gloo
    options = options or Options()
    batch = model.global_batch if batch is None else batch
    s = model.seq_len if seq_len is None else seq_len
    if grid.pipe > 1:
        return max((stage_memory(model, grid, options, batch, s, k, activation_bytes, gloo) for k in range(grid.pipe)),
                   key=lambda mem: mem.total)
    h, gx, gy = model.hidden, grid.x, grid.y
    m = batch // (grid.z * grid.data) // options.micro_batches * s  # tokens per micro-batch
    n_local = local_params(model, grid)

    # activations a block saves when it is not recomputed: inputs of the two layer norms and of the
    # four GEMMs, q/k/v, the attention output and its softmax statistics, the GELU input
    per_block = activation_bytes * m * (4 * h // gx + (3 * h + h + 2 * model.ffn) // gy) \
        + 4 * (m // s) * (model.heads // gy) * s
    block_input = activation_bytes * m * h // gx
    working = activation_bytes * m * model.ffn // gy  # d(GELU output) at the mlp_down backward
    if model.is_llama:  # q, k, v and their rotated copy, the attention output, gate and up, SwiGLU's output;
        # the working set: d(gate, up) at the mlp_up backward
        q = model.qkv_width
        per_block = activation_bytes * m * (4 * h // gx + (2 * q + h + 3 * model.ffn) // gy) \
            + 4 * (m // s) * (model.heads // gy) * s
        working = activation_bytes * m * 2 * model.ffn // gy
    extra = moe_activation_extra(model, grid, options, m, activation_bytes)  # an MoE block's (moe_memory.py)
    per_block, working = per_block + extra[0], working + extra[1]
    if options.recompute:
        activations = model.layers * block_input + per_block + working
    else:
        activations = model.layers * per_block + working + block_input

    block_weights = moe_block_weights(model, grid)
    wgrad = block_weights[-1] * (2 if gloo else 1)  # mlp_down's full wgrad (and gloo's copy) before its reduce-scatter
    in_flight = sum(block_weights[:-1]) + (1 if options.oag else 0) * max(block_weights) + wgrad
    cached = min(options.cache_layers, model.layers) * sum(block_weights)
    gathered = activation_bytes * (in_flight + cached) if grid.z > 1 else 0

    if activation_bytes >= 4:  # the backend's own policy (fp32): the peak it was measured to reach
        return _backend_peak(model, grid, options, m, n_local, per_block, block_input, block_weights,
                             activation_bytes, gloo)
    weight, grad, opt = WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES
    logits = LOGIT_BYTES * m * model.padded_vocab(gy) // gy
    # the gradient reductions' peak (gloo, data > 1): static state + a flat fp32 copy of the gradients
    copies = GRAD_BYTES * n_local if gloo and grid.data > 1 else 0
    return Memory(
        parameters=weight * n_local,
        gradients=grad * n_local,
        optimizer=opt * n_local,
        activations=activations,
        gathered_weights=gathered,
        logits=logits,
        reduction_buffers=max(0, copies - (activations + gathered + logits)),
    )


def _backend_peak(model: ModelSpec, grid: Grid, options: Options, m: int, n_local: int, per_block: int,
                  block_input: int, block_weights: list[int], act: int, gloo: bool) -> Memory:
    """The peak of backend/runtime/executor.py in fp32 (bytes): the largest of
    - layer i's backward, for every i, at its GELU (SwiGLU) backward: the inputs that layers below i
      saved (their whole stash without recomputation), layer i's stash, the working set (the GELU's
      output gradient and the input gradient it is producing, the gradient flowing down the residual
      stream), layer i's z-gathered weights (with the next layer's prefetched when there is one), and
      the gradients accumulated so far: the optimizer sets them to None, the executor creates each at
      its first wgrad, so the layers below i, layer i's but its mlp_down, and the embedding table
      that only the embedding's backward reaches (a GPT's positions, a Llama's embedding) have none
      yet (all have them from the second micro-batch on);
    - the same layer at its second layer norm's backward, where the MLP's stash is gone but four
      residual-stream tensors (tokens x h/G_x) are alive: the norm's output gradient, the gradient
      flowing down, the input gradient it is producing and one temporary; with G_x small and G_y
      large (the residual stream wide, the MLP thin) this one is higher;
    - the loss: every layer's saved inputs, the fp32 logits and the probabilities of their gradient;
    - on gloo with G_data > 1, the gradient reductions: every gradient and a flat fp32 copy of them.
    Measured with torch's memory tracker on 35 gpt-small grids (`backend run`, `twin validate`; all
    within 2.3 %) and on llama-small with and without recomputation
    (benchmarks/llama_memory.py, within 1.7 %): the peak is at a GELU (SwiGLU) backward of the first
    layer (gradients dominate) or the last (saved inputs dominate), or, with G_x = 1 and G_y = 8, at
    the last layer's second layer-norm backward."""
    h, gy, layers = model.hidden, grid.y, model.layers
    # the MLP's stash (GELU's input and output; SwiGLU's gate|up and output) and its working set at the
    # GELU (SwiGLU) backward: the output gradient and the input gradient (GELU: one kernel; SwiGLU's
    # autograd: d(gate|up) and two temporaries of width ffn)
    ffn = model.ffn // gy
    mlp, mlp_work = (3 * ffn, 5 * ffn) if model.is_llama else (2 * ffn, 2 * ffn)
    if model.is_llama:  # rope's input is dropped after it: q, k and v are held once, rotated
        per_block -= act * m * model.qkv_width // gy
    gelu = per_block + act * m * mlp_work + block_input   # at the GELU (SwiGLU) backward
    norm = per_block - act * m * mlp + 4 * block_input   # at the second layer norm's backward
    stash, working = per_block, max(gelu, norm) - per_block
    # what a layer below keeps without recomputation: its stash, and in a Llama the silu(gate) that
    # SwiGLU's autograd graph saves for its product (width ffn; the running layer's is freed by its
    # own backward, inside the measured working set)
    saved = block_input if options.recompute else per_block + (act * m * ffn if model.is_llama else 0)
    tensor = grid.tensor_size
    block = sum(k * n for _, k, n, _ in model.linear_shapes()) // tensor
    down = block_weights[-1] // grid.z
    table = (model.padded_vocab(gy) if model.is_llama else model.seq_len) * h // tensor
    weight, grad, opt = FP32_BYTES
    wgrad = block_weights[-1] * (2 if gloo else 1)  # mlp_down's full wgrad (and gloo's copy) before its reduce-scatter
    cached = min(options.cache_layers, layers) * sum(block_weights)

    def gathered(prefetch: bool) -> int:
        if grid.z == 1:
            return 0
        ahead = max(block_weights) if prefetch and options.oag else 0
        return act * (sum(block_weights[:-1]) + ahead + wgrad + cached)

    best = None
    for i in sorted({0, min(1, layers - 1), layers - 1}):  # linear in i past the first: the ends suffice
        grads = n_local if options.micro_batches > 1 else max(0, n_local - (i + 1) * block + down - table)
        point = (grad * grads, i * saved + stash + working, gathered(i > 0), 0, 0)
        if best is None or sum(point) > sum(best):
            best = point
    logits = LOGIT_BYTES * m * model.padded_vocab(gy) // gy
    loss = (grad * n_local if options.micro_batches > 1 else 0, layers * saved, 0, 2 * logits, 0)
    if sum(loss) > sum(best):
        best = loss
    if gloo and grid.data > 1:  # every gradient and its flat copy, activations gone
        reduction = (grad * n_local, 0, 0, 0, GRAD_BYTES * n_local)
        if sum(reduction) > sum(best):
            best = reduction
    grads, activations, gath, logit_bytes, copies = best
    return Memory(parameters=weight * n_local, gradients=grads, optimizer=opt * n_local,
                  activations=activations, gathered_weights=gath, logits=logit_bytes,
                  reduction_buffers=copies)


def stage_memory(model: ModelSpec, grid: Grid, options: Options, batch: int, s: int, stage: int,
                 activation_bytes: int = ACT_BYTES, gloo: bool = False) -> Memory:
    """Peak memory of one rank of pipeline stage `stage` (bytes), counted as memory_per_gpu counts the
    bf16 peak (on CPU too: the fp32 executor's measured peak is for unpipelined grids), at the start
    of a backward pass with the most micro-batches in flight: the stage's own parameters, gradients
    and optimizer state (twin.program.pipeline.stage_params), and the activations that every unit
    whose forward ran and backward did not yet keeps (its chunk's block inputs, or every block's stash
    without recomputation) for the most units the stage's schedule holds at once
    (twin.program.pipeline.in_flight: GPipe M; 1F1B P - s, so P on the first stage; interleaved
    2 (P - s - 1) + (V - 1) P + 1 chunks of L / (P V) blocks, on the first stage L (1 + (P - 1) / (P V))
    blocks' worth, the (1 + (P - 1) / (P m)) of Korthikanti et al. 2022 for Megatron-LM's schedule),
    plus one block's stash and working set, the z-gathered weights, and the last stage's logits."""
    from twin.program.pipeline import chunk_layers, in_flight, schedule, stage_params
    h, gx, gy = model.hidden, grid.x, grid.y
    m = batch // (grid.z * grid.data) // options.micro_batches * s
    per_block = activation_bytes * m * (4 * h // gx + (3 * h + h + 2 * model.ffn) // gy) \
        + 4 * (m // s) * (model.heads // gy) * s
    working = activation_bytes * m * model.ffn // gy
    if model.is_llama:
        per_block = activation_bytes * m * (4 * h // gx + (2 * model.qkv_width + h + 3 * model.ffn) // gy) \
            + 4 * (m // s) * (model.heads // gy) * s
        working = activation_bytes * m * 2 * model.ffn // gy
    extra = moe_activation_extra(model, grid, options, m, activation_bytes)  # an MoE block's (moe_memory.py)
    per_block, working = per_block + extra[0], working + extra[1]
    block_input = activation_bytes * m * h // gx
    chunk = len(chunk_layers(model, grid, options, stage, 0))
    units = in_flight(schedule(options.schedule, grid.pipe, options.micro_batches, options.chunks, stage))
    saved = block_input if options.recompute else per_block
    activations = units * chunk * saved + per_block + working + 2 * block_input  # + a unit's received input and gradient
    n_local = stage_params(model, grid, options, stage, model.padded_vocab(gy))
    block_weights = moe_block_weights(model, grid)
    wgrad = block_weights[-1] * (2 if gloo else 1)
    in_fl = sum(block_weights[:-1]) + (1 if options.oag else 0) * max(block_weights) + wgrad
    cached = min(options.cache_layers, model.layers) * sum(block_weights)
    gathered = activation_bytes * (in_fl + cached) if grid.z > 1 else 0
    last = stage == grid.pipe - 1
    logits = LOGIT_BYTES * m * model.padded_vocab(gy) // gy if last else 0
    fp32 = activation_bytes >= 4
    weight, grad, opt = FP32_BYTES if fp32 else (WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES)
    copies = GRAD_BYTES * n_local if gloo and grid.data > 1 else 0
    return Memory(parameters=weight * n_local, gradients=grad * n_local, optimizer=opt * n_local,
                  activations=activations, gathered_weights=gathered, logits=logits,
                  reduction_buffers=max(0, copies - (activations + gathered + logits)))


def check_fits(mem: Memory, capacity_bytes: float, what: str = "") -> None:
    """Raise TwinError, saying by how much, when `mem` exceeds `capacity_bytes` per GPU."""
    if mem.total > capacity_bytes:
        over = (mem.total - capacity_bytes) / GIB
        raise TwinError(
            f"{what}does not fit: needs {mem.total / GIB:.1f} GiB per GPU, the GPU has "
            f"{capacity_bytes / GIB:.1f} GiB (over by {over:.1f} GiB); use a grid with a larger "
            "G_x*G_y*G_z, more micro-batches, or recomputation")
