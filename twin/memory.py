"""Memory per GPU of a model under a 4D grid (bytes), and the check that it fits.

Static state per parameter of the rank's shard, by precision (`activation_bytes`, the profile's):
- bf16 mixed precision (2): bf16 weights (2 bytes), fp32 gradients (4), fp32 master weights and Adam's
  two moments (12): 18 bytes, as Megatron-LM counts it (distributed-optimizer documentation, 18 bytes
  per parameter without sharding the optimizer state);
- fp32 (4, the backend on CPU, backend/optim.py): fp32 parameter shards, fp32 gradients, AdamW's two
  fp32 moments: 16 bytes.
Activations are counted at `activation_bytes` per element. The peak is where the backward pass starts
on the last block (backend/executor.py, which drops each buffer after its last use): the rank then
holds, term by term,
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
the backward peak is higher). Measured (calibration/measurements/cpu-2026-12-01, torch's memory
tracker, gpt-small): 1x1x1x4 and 1x1x1x8 both peaked at 64.98 MB = 51.98 MB of static state + 13.0 MB,
one copy of the 3.25 M gradients, whatever their batch; the backward-peak model gave 58.5 MB for 1x1x1x8.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from twin.common import TwinError
from twin.grid import Grid
from twin.model import ModelSpec
from twin.program import ACT_BYTES, Options, _local_params

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
    h, gx, gy = model.hidden, grid.x, grid.y
    m = batch // (grid.z * grid.data) // options.micro_batches * s  # tokens per micro-batch
    n_local = _local_params(model, grid)

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
    if options.recompute:
        activations = model.layers * block_input + per_block + working
    else:
        activations = model.layers * per_block + working + block_input

    block_weights = [k * n // (gx * gy) for _, k, n, _ in model.linear_shapes()]
    wgrad = block_weights[-1] * (2 if gloo else 1)  # mlp_down's full wgrad (and gloo's copy) before its reduce-scatter
    in_flight = sum(block_weights[:-1]) + (1 if options.oag else 0) * max(block_weights) + wgrad
    cached = min(options.cache_layers, model.layers) * sum(block_weights)
    gathered = activation_bytes * (in_flight + cached) if grid.z > 1 else 0

    weight, grad, opt = FP32_BYTES if activation_bytes >= 4 else (WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES)
    logits = LOGIT_BYTES * m * model.padded_vocab(gy) // gy
    # the gradient reductions' peak (gloo, data > 1): static state + a flat fp32 copy of the gradients
    copies = GRAD_BYTES * n_local if gloo and grid.data > 1 else 0
    extra = max(0, copies - (activations + gathered + logits))
    return Memory(
        parameters=weight * n_local,
        gradients=grad * n_local,
        optimizer=opt * n_local,
        activations=activations,
        gathered_weights=gathered,
        logits=logits,
        reduction_buffers=extra,
    )


def check_fits(mem: Memory, capacity_bytes: float, what: str = "") -> None:
    """Raise TwinError, saying by how much, when `mem` exceeds `capacity_bytes` per GPU."""
    if mem.total > capacity_bytes:
        over = (mem.total - capacity_bytes) / GIB
        raise TwinError(
            f"{what}does not fit: needs {mem.total / GIB:.1f} GiB per GPU, the GPU has "
            f"{capacity_bytes / GIB:.1f} GiB (over by {over:.1f} GiB); use a grid with a larger "
            "G_x*G_y*G_z, more micro-batches, or recomputation")
