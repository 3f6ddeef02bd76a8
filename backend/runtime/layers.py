"""The kernels of the program's compute ops, and the payloads of its reductions: what each op *computes*.

The executor (backend/runtime/executor.py) looks an op up here by its `role` (a GEMM by its kind) and calls
`kernel(run, op, *inputs) -> outputs`, with the inputs the op `reads` and the outputs it `writes`
(twin/program/program.py). Nothing here knows when an op runs, on which axis, or under which name: the
program says that. `run` gives a kernel its rank's context: the model's parameters (`run.model`),
the GEMM layout tuner, the compute dtype, and the step's scalars (loss scale, clipping norm, optimizer).

Precision: activations and their gradients in the compute dtype (bf16 on GPU, fp32 on CPU);
layer-norm and softmax statistics, the loss and parameter gradients in fp32.
A kernel's "ctx" output is what its backward needs (normalized input, or the autograd graph of a
local function whose backward is computed by a vector-Jacobian product).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE = -100  # a target left out of the loss (any negative target is)


# -- GEMM ------------------------------------------------------------------------------------------
def gemm(run, op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C[m,n] = op(A) op(B): layout NN, NT (B transposed) or TN (A transposed), as the program says."""
    a = a.t() if op.layout[0] == "T" else a
    b = b.t() if op.layout[1] == "T" else b
    out, used = run.tuner.matmul(a, b)
    if used and run.record is not None:
        run.record.args["impl"] = used
    return out


# -- layer norm over x-split features --------------------------------------------------------------
def ln_stats(run, op, x: torch.Tensor) -> torch.Tensor:
    """Per-token [sum, sum of squares] of this rank's features (fp32), summed over x by the reduction."""
    xf = x.float()
    return torch.stack([xf.sum(-1), (xf * xf).sum(-1)], -1)


def layer_norm(run, op, x: torch.Tensor, stats: torch.Tensor | None = None):
    """Normalize with the features' statistics (given: summed over x; absent: all features are here,
    torch's fused layer norm). Returns the output and the ctx of the backward."""
    weight, bias = run.model.norm_params(op.weight)
    hidden, eps = run.model.spec.hidden, run.model.eps
    if stats is None:
        with torch.enable_grad():
            xi = x.detach().float().requires_grad_(True)
            y = F.layer_norm(xi, (hidden,), weight, bias, eps)
        return y.detach().to(x.dtype), ("graph", xi, y)
    xf = x.float()
    mean = stats[:, 0] / hidden
    var = (stats[:, 1] / hidden - mean * mean).clamp_min(0.0)
    rstd = torch.rsqrt(var + eps)
    xhat = (xf - mean[:, None]) * rstd[:, None]
    return (xhat * weight + bias).to(x.dtype), ("stats", xhat, rstd)


def ln_grad_stats(run, op, dy: torch.Tensor, ctx) -> torch.Tensor:
    """Per-token [sum g, sum g*xhat] with g = dy * weight, summed over x by the reduction."""
    weight, _ = run.model.norm_params(op.weight)
    g = dy.float() * weight
    return torch.stack([g.sum(-1), (g * ctx[1]).sum(-1)], -1)


def layer_norm_bwd(run, op, dy: torch.Tensor, ctx, sums: torch.Tensor | None = None) -> torch.Tensor:
    """Input gradient of a layer norm; its weight and bias gradients are accumulated here."""
    weight, bias = run.model.norm_params(op.weight)
    if ctx[0] == "graph":
        _, xi, y = ctx
        dx, dw, db = torch.autograd.grad(y, (xi, weight, bias), dy.float())
    else:
        _, xhat, rstd = ctx
        dyf = dy.float()
        g = dyf * weight
        if sums is None:
            sums = torch.stack([g.sum(-1), (g * xhat).sum(-1)], -1)
        h = run.model.spec.hidden
        dx = rstd[:, None] * (g - sums[:, 0:1] / h - xhat * sums[:, 1:2] / h)
        dw, db = (dyf * xhat).sum(0), dyf.sum(0)
    run.model.accumulate_params([weight, bias], [dw, db])
    return dx.to(dy.dtype)


# -- attention and GELU (backward: a vector-Jacobian product of the saved local graph) --------------
def _local(fn, x: torch.Tensor):
    with torch.enable_grad():
        xi = x.detach().requires_grad_(True)
        y = fn(xi)
    return y.detach(), (xi, y)


def _vjp(dy: torch.Tensor, ctx) -> torch.Tensor:
    xi, y = ctx
    (dx,) = torch.autograd.grad(y, xi, dy)
    return dx


def attention(run, op, qkv: torch.Tensor):
    """Causal attention of this rank's heads: qkv [m, (heads + 2*kv_heads)*d] laid out [q | k | v] ->
    [m, heads*d]. The op's sizes say the shape: m = sequences x heads, n = sequence length, k = head
    dim; kv heads are the rest of qkv's width (fewer than the query heads: grouped-query attention,
    query head i attending with kv head i // (heads/kv_heads), as Llama's repeat_kv)."""
    s, d = op.n, op.k
    seqs = qkv.shape[0] // s
    heads = op.m // seqs
    kv = (qkv.shape[1] // d - heads) // 2

    def fn(t):
        t = t.view(seqs, s, heads + 2 * kv, d).transpose(1, 2)
        q, k, v = t.split([heads, kv, kv], 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
        return o.transpose(1, 2).reshape(seqs * s, heads * d)

    return _local(fn, qkv)


def gelu(run, op, x: torch.Tensor):
    return _local(F.gelu, x)


def local_bwd(run, op, dy: torch.Tensor, ctx) -> torch.Tensor:
    """Backward of attention, GELU or SwiGLU: the vector-Jacobian product of the forward's local graph."""
    return _vjp(dy, ctx)


def swiglu(run, op, x: torch.Tensor):
    """silu(gate) * up of this rank's y-shard of the fused gate|up output [m, 2*ffn/G_y] -> [m, ffn/G_y]."""
    def fn(t):
        gate, up = t.chunk(2, -1)
        return F.silu(gate) * up
    return _local(fn, x)


# -- rotary position embeddings (Llama) ------------------------------------------------------------
def rope_tables(spec, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq_len, head_dim] of the rotary embedding (fp32), in the rotate-half convention:
    frequencies theta^(-2i/d) for i < d/2, repeated for both halves of a head; with spec.rope_scaling,
    the "llama3" rescaling of the low frequencies (Llama 3.1: wavelengths longer than
    original_context/low_freq_factor divided by the factor, shorter than original_context/
    high_freq_factor kept, a smooth blend between)."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if spec.rope_scaling:
        factor, lo, hi, ctx = (spec.rope_scaling, spec.rope_low_freq_factor, spec.rope_high_freq_factor,
                               spec.rope_original_context)
        wavelen = 2 * math.pi / inv
        blend = ((ctx / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)  # 0: long wavelengths, 1: short
        inv = (1 - blend) * inv / factor + blend * inv
    angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(device), angles.sin().to(device)


def _rope_apply(run, op, x: torch.Tensor, sign: float) -> torch.Tensor:
    """Rotate the q and k heads of qkv [m, (heads + 2 kv)*d] (v passes through); sign -1: the inverse."""
    s, d = op.n, op.k
    cos, sin = run.model.rope_tables(s)
    width = x.shape[1] // d
    kv = (width - run.model.spec.heads // run.model.ctx.size("y")) // 2
    rot = width - kv  # q and k heads
    t = x.view(-1, s, width, d)
    qk = t[:, :, :rot].float()
    x1, x2 = qk.chunk(2, -1)
    c, si = cos[None, :, None, :], sign * sin[None, :, None, :]
    out = qk * c + torch.cat([-x2, x1], -1) * si
    return torch.cat([out.to(x.dtype), t[:, :, rot:]], 2).reshape(x.shape)


def rope(run, op, qkv: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of this rank's q and k heads; positions restart with each sequence of op.n tokens."""
    return _rope_apply(run, op, qkv, 1.0)


def rope_bwd(run, op, dy: torch.Tensor) -> torch.Tensor:
    """The gradient of a rotation is the inverse rotation (v's gradient passes through)."""
    return _rope_apply(run, op, dy, -1.0)


# -- RMSNorm over x-split features (Llama) ---------------------------------------------------------
def rms_stats(run, op, x: torch.Tensor) -> torch.Tensor:
    """Per-token sum of squares of this rank's features (fp32), summed over x by the reduction."""
    xf = x.float()
    return (xf * xf).sum(-1)


def rms_norm(run, op, x: torch.Tensor, sumsq: torch.Tensor | None = None):
    """weight * x / sqrt(mean(x^2) + eps), in fp32 (as Llama computes it); returns the output and the
    ctx of the backward (normalized input, 1/rms)."""
    (weight,) = run.model.norm_params(op.weight)
    xf = x.float()
    if sumsq is None:
        sumsq = (xf * xf).sum(-1)
    rstd = torch.rsqrt(sumsq / run.model.spec.hidden + run.model.spec.norm_eps)
    xhat = xf * rstd[:, None]
    return (weight * xhat).to(x.dtype), (xhat, rstd)


def rms_grad_stats(run, op, dy: torch.Tensor, ctx) -> torch.Tensor:
    """Per-token sum of g * xhat (g = dy * weight) over this rank's features, summed over x."""
    (weight,) = run.model.norm_params(op.weight)
    return (dy.float() * weight * ctx[0]).sum(-1)


def rms_norm_bwd(run, op, dy: torch.Tensor, ctx, sums: torch.Tensor | None = None) -> torch.Tensor:
    """dx = rstd * (g - xhat * mean(g * xhat)); the weight's gradient sum(dy * xhat) is accumulated."""
    (weight,) = run.model.norm_params(op.weight)
    xhat, rstd = ctx
    dyf = dy.float()
    g = dyf * weight
    if sums is None:
        sums = (g * xhat).sum(-1)
    dx = rstd[:, None] * (g - xhat * (sums / run.model.spec.hidden)[:, None])
    run.model.accumulate_params([weight], [(dyf * xhat).sum(0)])
    return dx.to(dy.dtype)


# -- embedding ------------------------------------------------------------------------------------
def _positions(run, tokens: torch.Tensor, wte_rows: int, wpe_rows: int):
    """Token and position ids relative to this rank's rows of wte and wpe, and which are here."""
    seqs, seq_len = tokens.shape
    vstart, pstart = run.model.embedding_offsets()
    ids = tokens.reshape(-1) - vstart
    pos = torch.arange(seq_len, device=tokens.device).repeat(seqs) - pstart
    return ids, (ids >= 0) & (ids < wte_rows), pos, (pos >= 0) & (pos < wpe_rows)


def embedding(run, op, tokens: torch.Tensor, weights) -> torch.Tensor:
    """Token + position embedding of this rank's rows (summed over the rows' axis by the reduction);
    a model without a position table (Llama) gives its token table alone."""
    te, pe = weights if isinstance(weights, tuple) else (weights, None)
    ids, id_ok, pos, pos_ok = _positions(run, tokens, te.shape[0], 0 if pe is None else pe.shape[0])
    out = te[ids.clamp(0, te.shape[0] - 1)] * id_ok[:, None]
    if pe is not None:
        out += pe[pos.clamp(0, pe.shape[0] - 1)] * pos_ok[:, None]
    return out


def embedding_bwd(run, op, dout: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Gradients of this rank's wte and wpe rows, flattened as their z-shards are: [G_z, shard sizes]."""
    te_shape, pe_shape = run.model.embedding_shapes()
    ids, id_ok, pos, pos_ok = _positions(run, tokens, te_shape[0], 0 if pe_shape is None else pe_shape[0])
    d = dout.float()  # sums over many tokens: accumulate in fp32, send in the compute dtype
    dte = torch.zeros(te_shape, dtype=torch.float32, device=d.device)
    dte.index_add_(0, ids[id_ok], d[id_ok])
    gz = run.model.ctx.size("z")
    if pe_shape is None:
        return dte.reshape(gz, -1).to(dout.dtype)
    dpe = torch.zeros(pe_shape, dtype=torch.float32, device=d.device)
    dpe.index_add_(0, pos[pos_ok], d[pos_ok])
    return torch.cat([dte.reshape(gz, -1), dpe.reshape(gz, -1)], 1).to(dout.dtype)


# -- vocabulary-parallel cross-entropy -------------------------------------------------------------
def _real(run, logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits, with the columns of padding rows beyond the model's real vocabulary at -inf (a
    model with `real_vocab`, Llama: its reference is not padded), so they take no probability."""
    lf = logits.float()
    limit = getattr(run.model, "real_vocab", None)
    start = run.model.embedding_offsets()[0]
    if limit is not None and start + lf.shape[1] > limit:
        lf = lf.clone()
        lf[:, max(limit - start, 0):] = float("-inf")
    return lf


def loss(run, op, logits: torch.Tensor, targets: torch.Tensor):
    """Per-token maximum logit of this rank's vocabulary shard (and, when the shard is the whole
    vocabulary, the sums too)."""
    lmax = _real(run, logits).max(-1).values
    if len(op.writes) == 1:
        return lmax
    return lmax, loss_sums(run, op, logits, lmax, targets)


def _targets(run, logits: torch.Tensor, targets: torch.Tensor):
    valid = targets.reshape(-1) >= 0
    tgt = targets.reshape(-1) - run.model.embedding_offsets()[0]
    ok = valid & (tgt >= 0) & (tgt < logits.shape[1])
    return valid, tgt, ok


def loss_sums(run, op, logits: torch.Tensor, lmax: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token [sum of exp(logit - max), target logit] over this rank's shard (fp32)."""
    lf = _real(run, logits)
    _, tgt, ok = _targets(run, logits, targets)
    tlogit = torch.where(ok, lf.gather(1, tgt.clamp(0, lf.shape[1] - 1)[:, None])[:, 0], 0.0)
    return torch.stack([torch.exp(lf - lmax[:, None]).sum(-1), tlogit], -1)


def loss_value(run, logits, targets, lmax, sums) -> torch.Tensor:
    """scale * the sum of this rank's token losses (IGNORE targets count zero), fp32 scalar."""
    valid, _, _ = _targets(run, logits, targets)
    return ((torch.log(sums[:, 0]) + lmax - sums[:, 1]) * valid).sum() * run.scale


def loss_bwd(run, op, logits, targets, lmax, sums) -> torch.Tensor:
    """d(loss)/d(logits) of this rank's shard, times the loss's scale and the incoming gradient."""
    valid, tgt, ok = _targets(run, logits, targets)
    grad = torch.exp(_real(run, logits) - lmax[:, None]) / sums[:, 0:1] * valid[:, None]
    rows = torch.nonzero(ok)[:, 0]
    grad[rows, tgt[rows]] -= 1.0
    return (grad * (run.dloss * run.scale)).to(logits.dtype)


def goldfish_mask(run, op, targets: torch.Tensor) -> None:
    """The goldfish mask: the data loader (backend.training.goldfish) has already set the dropped targets to
    IGNORE, which the loss leaves out; the op stands for that work in the program (no flops here)."""


# -- optimizer ------------------------------------------------------------------------------------
def grad_norm(run, op) -> torch.Tensor:
    """Sum of squares of this rank's unique gradients (summed over x, y, z by the reductions)."""
    sq = torch.zeros(1, dtype=torch.float32, device=run.model.ctx.device)
    for p in run.model.unique_parameters():
        if p.grad is not None:
            sq += p.grad.float().pow(2).sum()
    return sq


def adamw(run, op, sq: torch.Tensor | None = None) -> None:
    """Clip by the global norm (when the program computes it), then the optimizer's step."""
    if sq is not None:
        norm = float(sq.sqrt())
        run.grad_norm = norm
        if not math.isfinite(norm):
            return  # a NaN or infinite gradient is never applied (every rank sees this same norm)
        coef = run.max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in run.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
    if run.optimizer is not None:
        run.optimizer.step()


COMPUTE = {"": gemm, "layer_norm": layer_norm, "layer_norm_bwd": layer_norm_bwd, "attention": attention,
           "attention_bwd": local_bwd, "gelu": gelu, "gelu_bwd": local_bwd, "embedding": embedding,
           "embedding_bwd": embedding_bwd, "loss": loss, "loss_bwd": loss_bwd, "goldfish_mask": goldfish_mask, "grad_norm": grad_norm,
           "adamw": adamw, "rms_norm": rms_norm, "rms_norm_bwd": rms_norm_bwd, "rope": rope, "rope_bwd": rope_bwd,
           "swiglu": swiglu, "swiglu_bwd": local_bwd}
PAYLOADS = {"ln_stats": ln_stats, "ln_grad_stats": ln_grad_stats, "loss_sums": loss_sums,
            "rms_stats": rms_stats, "rms_grad_stats": rms_grad_stats}

from backend.runtime.moe import MOE_COMPUTE  # noqa: E402 - the MoE block's kernels (mixture of experts)

COMPUTE.update(MOE_COMPUTE)
