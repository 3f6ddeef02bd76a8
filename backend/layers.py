"""The 3D-parallel layers: linear (normal and transposed), x-split layer norm, vocab-parallel embedding,
tied head and cross-entropy, and per-block activation recomputation.

Shapes are per rank: m tokens (this rank's sequences x sequence length, split over z and data),
features split over x (residual stream, replicated over y) or over y (attention and MLP inside,
replicated over x). A linear layer's W (k x n) is split k/G_in by n/G_out; the block is flattened
and sharded again over z: the parameter is the flat fp32 z-shard. Weights and activations travel in
the compute dtype (bf16 on GPU, fp32 on CPU); layer-norm and softmax statistics in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from backend.comm import MAX
from backend.schedule import Schedule
from twin.program import STAT_BYTES

IGNORE = -100  # a target left out of the loss (any negative target is)


# -- linear -------------------------------------------------------------------------------------------
class _LinearFn(Function):
    """y = all_reduce_in(x @ W); backward: dgrad + all_reduce_out, wgrad + reduce-scatter over z."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: torch.Tensor, layer: "ParallelLinear") -> torch.Tensor:
        s = layer.sched
        w = s.weight(layer.name)
        y = s.gemm(s.name(layer.name, "gemm"), x, w, "NN")
        s.comm.all_reduce(y, layer.in_axis, s.name(layer.name, f"ar_{layer.in_axis}"))
        ctx.layer = layer
        # the recomputed forward's gather (and a cached weight) is reused by the backward
        ctx.w = w if (s.phase == "rec" or layer.name in s.cache) else None
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        layer: ParallelLinear = ctx.layer
        s, (x,) = layer.sched, ctx.saved_tensors
        w = ctx.w if ctx.w is not None else s.weight(layer.name)
        ctx.w = None
        dy = dy.contiguous()
        dx = s.gemm(s.name(layer.name, "dgrad", "bwd"), dy, w.t(), "NT")
        ar = s.comm.all_reduce(dx, layer.out_axis, s.name(layer.name, f"ar_{layer.out_axis}", "bwd"),
                               async_op=s.options.oar)
        dw = s.gemm(s.name(layer.name, "wgrad", "bwd"), x.t(), dy, "TN")
        s.reduce_grad(s.name(layer.name, "rs_z", "bwd"), dw.reshape(s.ctx.size("z"), -1), [layer.weight])
        return ar.wait(), None, None


class ParallelLinear(nn.Module):
    """A bias-free linear layer W (k x n) of the 4D algorithm.

    normal: input features split over x, output over y (all-reduce over x in forward, over y in
    backward); transposed: the reverse. name: the program's layer name, e.g. 'L3.qkv'.
    """

    def __init__(self, sched: Schedule, name: str, k: int, n: int, transposed: bool):
        super().__init__()
        ctx = sched.ctx
        self.sched, self.name, self.k, self.n, self.transposed = sched, name, k, n, transposed
        self.in_axis, self.out_axis = ("y", "x") if transposed else ("x", "y")
        self.k_local, self.n_local = k // ctx.size(self.in_axis), n // ctx.size(self.out_axis)
        numel = self.k_local * self.n_local
        self.weight = nn.Parameter(torch.zeros(numel // ctx.size("z"), device=ctx.device))
        kl, nl = self.k_local, self.n_local
        sched.register(name, [self.weight], lambda flat: flat.reshape(kl, nl))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self)


# -- layer norm over x-split features ---------------------------------------------------------------
class _LayerNormFn(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer: "ParallelLayerNorm"):
        s = layer.sched
        xf = x.float()
        stats = torch.stack([xf.sum(-1), (xf * xf).sum(-1)], -1)  # per-token sum and sum of squares
        s.comm.all_reduce(stats, "x", s.name(layer.name, "ar_x"), width=STAT_BYTES)
        with s.compute(s.name(layer.name, ""), "elementwise"):
            mean = stats[:, 0] / layer.hidden
            var = (stats[:, 1] / layer.hidden - mean * mean).clamp_min(0.0)
            rstd = torch.rsqrt(var + layer.eps)
            xhat = (xf - mean[:, None]) * rstd[:, None]
            y = (xhat * weight + bias).to(x.dtype)
        ctx.layer = layer
        ctx.save_for_backward(xhat, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        layer: ParallelLayerNorm = ctx.layer
        s, (xhat, rstd, weight) = layer.sched, ctx.saved_tensors
        dyf = dy.float()
        g = dyf * weight
        sums = torch.stack([g.sum(-1), (g * xhat).sum(-1)], -1)
        s.comm.all_reduce(sums, "x", s.name(layer.name, "ar_x", "bwd"), width=STAT_BYTES)
        with s.compute(s.name(layer.name, "", "bwd"), "elementwise"):
            h = layer.hidden
            dx = rstd[:, None] * (g - sums[:, 0:1] / h - xhat * sums[:, 1:2] / h)
            dw, db = (dyf * xhat).sum(0), dyf.sum(0)
        return dx.to(dy.dtype), dw, db, None


class ParallelLayerNorm(nn.Module):
    """Layer norm of the residual stream, whose features are split over x (params too).

    With G_x = 1 the features are all here and there is nothing to all-reduce: torch's fused layer
    norm (in fp32) replaces the statistics built by hand, under the same op names.
    """

    def __init__(self, sched: Schedule, name: str, hidden: int, eps: float = 1e-5):
        super().__init__()
        self.sched, self.name, self.hidden, self.eps = sched, name, hidden, eps
        local = hidden // sched.ctx.size("x")
        self.weight = nn.Parameter(torch.ones(local, device=sched.ctx.device))
        self.bias = nn.Parameter(torch.zeros(local, device=sched.ctx.device))

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (self.hidden,), self.weight, self.bias, self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sched.ctx.size("x") == 1:
            return recorded(x, self._whole, self.sched, self.name, "elementwise")
        return _LayerNormFn.apply(x, self.weight, self.bias, self)


# -- recorded elementwise/attention ops -----------------------------------------------------------
class _RecordedFn(Function):
    """Run fn(x) recorded as `<layer>.<phase>` and its backward as `<layer>.bwd`. Parameters that fn
    uses (a layer norm's) get their gradients accumulated by that backward."""

    @staticmethod
    def forward(ctx, x, fn, sched: Schedule, layer: str, kind: str):
        with torch.enable_grad():
            xi = x.detach().requires_grad_(True)
            with sched.compute(sched.name(layer, ""), kind):
                y = fn(xi)
        ctx.sched, ctx.layer, ctx.kind, ctx.xi, ctx.y = sched, layer, kind, xi, y
        return y.detach()

    @staticmethod
    def backward(ctx, dy):
        s = ctx.sched
        with s.compute(s.name(ctx.layer, "", "bwd"), ctx.kind):
            torch.autograd.backward(ctx.y, dy)
        dx = ctx.xi.grad
        ctx.xi = ctx.y = None
        return dx, None, None, None, None


def recorded(x: torch.Tensor, fn, sched: Schedule, layer: str, kind: str) -> torch.Tensor:
    """fn(x) with its forward and backward recorded under the program's names."""
    if not torch.is_grad_enabled():
        with sched.compute(sched.name(layer, ""), kind):
            return fn(x)
    return _RecordedFn.apply(x, fn, sched, layer, kind)


def causal_attention(qkv: torch.Tensor, sequences: int, seq_len: int, heads: int) -> torch.Tensor:
    """Attention of this rank's heads: qkv [m, 3*heads*d] laid out [q | k | v] -> [m, heads*d]."""
    d = qkv.shape[1] // (3 * heads)
    q, k, v = qkv.view(sequences, seq_len, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(sequences * seq_len, heads * d)


# -- activation recomputation ---------------------------------------------------------------------
class _RecomputeFn(Function):
    """Run a block without keeping activations; in backward, recompute it (phase `rec`) and backprop."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block.body(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        s: Schedule = ctx.block.sched
        x = x.detach().requires_grad_(True)
        s.phase = "rec"
        with torch.enable_grad():
            y = ctx.block.body(x)
        s.phase = "bwd"
        torch.autograd.backward(y, dy)
        return x.grad, None


def recompute(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """block.body(x), recomputed in the backward pass (full activation recomputation)."""
    if not torch.is_grad_enabled():
        return block.body(x)
    return _RecomputeFn.apply(x, block)


# -- embedding, tied head, loss -------------------------------------------------------------------
class _EmbeddingFn(Function):
    """Token + position embedding, vocab- and position-parallel over y: lookup, all-reduce over y."""

    @staticmethod
    def forward(ctx, tokens, wte, wpe, emb: "ParallelEmbedding"):
        s = emb.sched
        te_w, pe_w = s.weight("emb")
        seqs, seq_len = tokens.shape
        ids = tokens.reshape(-1) - emb.vocab_start
        pos = torch.arange(seq_len, device=tokens.device).repeat(seqs) - emb.pos_start
        id_ok = (ids >= 0) & (ids < te_w.shape[0])
        pos_ok = (pos >= 0) & (pos < pe_w.shape[0])
        with s.compute(s.name("emb", ""), "embedding"):
            out = te_w[ids.clamp(0, te_w.shape[0] - 1)] * id_ok[:, None]
            out += pe_w[pos.clamp(0, pe_w.shape[0] - 1)] * pos_ok[:, None]
        s.comm.all_reduce(out, "y", s.name("emb", "ar_y"))
        ctx.emb = emb
        ctx.save_for_backward(ids, id_ok, pos, pos_ok)
        return out

    @staticmethod
    def backward(ctx, dout):
        emb: ParallelEmbedding = ctx.emb
        s, (ids, id_ok, pos, pos_ok) = emb.sched, ctx.saved_tensors
        with s.compute(s.name("emb", "", "bwd"), "embedding"):
            # sums over many tokens: accumulate in fp32, send in the compute dtype (as the program)
            d = dout.float()
            dte = torch.zeros(emb.wte_shape, dtype=torch.float32, device=d.device)
            dte.index_add_(0, ids[id_ok], d[id_ok])
            dpe = torch.zeros(emb.wpe_shape, dtype=torch.float32, device=d.device)
            dpe.index_add_(0, pos[pos_ok], d[pos_ok])
        gz = s.ctx.size("z")
        full = torch.cat([dte.reshape(gz, -1), dpe.reshape(gz, -1)], 1).to(dout.dtype)
        s.reduce_grad(s.name("emb", "rs_z", "bwd"), full, [emb.wte, emb.wpe])
        s.finish_grads()  # the last op of the micro-batch's backward
        return None, None, None, None


class ParallelEmbedding(nn.Module):
    """wte [V, h] split [V/G_y, h/G_x], wpe [s, h] split [s/G_y, h/G_x], both flat z-shards.

    Gathered together (`emb` key) for the lookup; wte alone (`head` key) for the tied head.
    """

    def __init__(self, sched: Schedule, vocab: int, seq_len: int, hidden: int):
        super().__init__()
        ctx = sched.ctx
        self.sched = sched
        gx, gy, gz = ctx.size("x"), ctx.size("y"), ctx.size("z")
        self.wte_shape = (vocab // gy, hidden // gx)
        self.wpe_shape = (seq_len // gy, hidden // gx)
        self.vocab_start = ctx.coord("y") * self.wte_shape[0]
        self.pos_start = ctx.coord("y") * self.wpe_shape[0]
        a, b = self.wte_shape[0] * self.wte_shape[1], self.wpe_shape[0] * self.wpe_shape[1]
        self.wte = nn.Parameter(torch.zeros(a // gz, device=ctx.device))
        self.wpe = nn.Parameter(torch.zeros(b // gz, device=ctx.device))
        te, pe = self.wte_shape, self.wpe_shape
        sched.register("emb", [self.wte, self.wpe],
                       lambda flat: (flat[:, :a // gz].reshape(te), flat[:, a // gz:].reshape(pe)))
        sched.register("head", [self.wte], lambda flat: flat.reshape(te))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _EmbeddingFn.apply(tokens, self.wte, self.wpe, self)


class _HeadFn(Function):
    """logits = all_reduce_x(x @ wte^T): the tied head, a normal layer with W = wte^T."""

    @staticmethod
    def forward(ctx, x, wte, emb: ParallelEmbedding):
        s = emb.sched
        w = s.weight("head")
        logits = s.gemm(s.name("head", "gemm"), x, w.t(), "NT")
        s.comm.all_reduce(logits, "x", s.name("head", "ar_x"))
        ctx.emb = emb
        ctx.save_for_backward(x)
        return logits

    @staticmethod
    def backward(ctx, dlogits):
        emb: ParallelEmbedding = ctx.emb
        s, (x,) = emb.sched, ctx.saved_tensors
        w = s.weight("head")
        dlogits = dlogits.contiguous()
        dx = s.gemm(s.name("head", "dgrad", "bwd"), dlogits, w, "NN")
        ar = s.comm.all_reduce(dx, "y", s.name("head", "ar_y", "bwd"), async_op=s.options.oar)
        dw = s.gemm(s.name("head", "wgrad", "bwd"), dlogits.t(), x, "TN")
        s.reduce_grad(s.name("head", "rs_z", "bwd"), dw.reshape(s.ctx.size("z"), -1), [emb.wte])
        return ar.wait(), None, None


def tied_head(x: torch.Tensor, emb: ParallelEmbedding) -> torch.Tensor:
    """Logits of this rank's vocabulary shard [m, V/G_y] (replicated over x)."""
    return _HeadFn.apply(x, emb.wte, emb)


class _CrossEntropyFn(Function):
    """Sum over this rank's tokens of the vocab-parallel cross-entropy, times `scale`; tokens whose
    target is negative (IGNORE) count zero."""

    @staticmethod
    def forward(ctx, logits, targets, emb: ParallelEmbedding, scale: float):
        s = emb.sched
        with s.compute(s.name("loss", ""), "loss"):
            lf = logits.float()
            lmax = lf.max(-1).values
        s.comm.all_reduce(lmax, "y", s.name("loss", "ar_y_max"), op=MAX, width=STAT_BYTES)
        e = torch.exp(lf - lmax[:, None])
        valid = targets.reshape(-1) >= 0
        tgt = targets.reshape(-1) - emb.vocab_start
        ok = valid & (tgt >= 0) & (tgt < lf.shape[1])
        tlogit = lf.gather(1, tgt.clamp(0, lf.shape[1] - 1)[:, None])[:, 0] * ok
        sums = torch.stack([e.sum(-1), tlogit], -1)
        s.comm.all_reduce(sums, "y", s.name("loss", "ar_y_sum"), width=STAT_BYTES)
        loss = ((torch.log(sums[:, 0]) + lmax - sums[:, 1]) * valid).sum() * scale
        ctx.emb, ctx.scale, ctx.dtype = emb, scale, logits.dtype
        ctx.save_for_backward(e / sums[:, 0:1] * valid[:, None], tgt, ok)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        s = ctx.emb.sched
        s.begin_backward()
        probs, tgt, ok = ctx.saved_tensors
        with s.compute(s.name("loss", "", "bwd"), "loss"):
            grad = probs.clone()
            rows = torch.nonzero(ok)[:, 0]
            grad[rows, tgt[rows]] -= 1.0
            grad = (grad * (dloss * ctx.scale)).to(ctx.dtype)
        return grad, None, None, None


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, emb: ParallelEmbedding,
                        scale: float) -> torch.Tensor:
    """scale * sum of the token losses of this rank (identical over x and y)."""
    return _CrossEntropyFn.apply(logits, targets, emb, scale)
