"""The GPT of the 4D algorithm, a plain single-process ReferenceGPT with the same math, and the maps
between the two (weights in, gradients out).

GPT: learned token and position embeddings, `layers` pre-norm blocks (layer norm, causal attention,
layer norm, GELU MLP of width ffn), a final layer norm and a head tied to the token embedding; linear
layers without bias, layer norms with. The loss is the mean cross-entropy over all tokens of the
global batch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from backend.dist import ParallelContext
from backend.layers import (IGNORE, ParallelEmbedding, ParallelLayerNorm, ParallelLinear, causal_attention,
                            recompute, recorded, tied_head, vocab_parallel_loss)
from backend.recorder import NULL_RECORDER, Recorder
from backend.schedule import LINEARS, Schedule
from twin.model import ModelSpec
from twin.program import Options


class Block(nn.Module):
    """One transformer block on this rank's shards: x [m, h/G_x] -> [m, h/G_x]."""

    def __init__(self, sched: Schedule, spec: ModelSpec, i: int):
        super().__init__()
        self.sched, self.name = sched, f"L{i}"
        self.local_heads = spec.heads // sched.ctx.size("y")
        h = spec.hidden
        self.ln1 = ParallelLayerNorm(sched, f"L{i}.ln1", h)
        self.ln2 = ParallelLayerNorm(sched, f"L{i}.ln2", h)
        for name, k, n, transposed in spec.linear_shapes():
            setattr(self, name, ParallelLinear(sched, f"L{i}.{name}", k, n, transposed))

    def _attention(self, qkv: torch.Tensor) -> torch.Tensor:
        return causal_attention(qkv, *self.sched.shape, self.local_heads)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        s, L = self.sched, self.name
        a = recorded(self.qkv(self.ln1(x)), self._attention, s, f"{L}.attn", "attention")
        x = x + self.attn_out(a)
        u = recorded(self.mlp_up(self.ln2(x)), F.gelu, s, f"{L}.gelu", "elementwise")
        return x + self.mlp_down(u)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recompute(self, x) if self.sched.options.recompute else self.body(x)


class GPT(nn.Module):
    """The 4D-parallel GPT on one rank. Parameters are this rank's fp32 shards.

    vocab: padded vocabulary (default spec.padded_vocab(G_y)). Initialization: N(0, 0.02) shards
    (load_from_reference for exact copies of a ReferenceGPT). tune_gemms: time the GEMM layouts
    once per shape and keep the fastest (default: on GPU only). The position table has spec.seq_len
    rows: build the program with the same seq_len (or a spec replaced with the run's seq_len).
    """

    def __init__(self, spec: ModelSpec, ctx: ParallelContext, options: Options | None = None,
                 recorder: Recorder = NULL_RECORDER, vocab: int | None = None, seed: int = 0,
                 tune_gemms: bool | None = None):
        super().__init__()
        self.spec, self.ctx, self.options = spec, ctx, options or Options()
        self.vocab = vocab or spec.padded_vocab(ctx.size("y"))
        self.sched = Schedule(ctx, self.options, spec.layers, recorder, tune_gemms)
        self.emb = ParallelEmbedding(self.sched, self.vocab, spec.seq_len, spec.hidden)
        self.blocks = nn.ModuleList(Block(self.sched, spec, i) for i in range(spec.layers))
        self.lnf = ParallelLayerNorm(self.sched, "lnf", spec.hidden)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + ctx.rank % ctx.grid.tensor_size)
        with torch.no_grad():
            for p in self.sharded_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    @property
    def recorder(self) -> Recorder:
        return self.sched.recorder

    @recorder.setter
    def recorder(self, rec: Recorder) -> None:
        self.sched.recorder = rec

    def linears(self) -> list[ParallelLinear]:
        """The linear layers in the program's order (L0.qkv, L0.attn_out, ..., L1.qkv, ...)."""
        return [getattr(b, ln) for b in self.blocks for ln in LINEARS]

    def sharded_parameters(self) -> list[nn.Parameter]:
        """Parameters split over x, y and z (one copy per tensor-parallel rank): linears, wte, wpe."""
        return [lin.weight for lin in self.linears()] + [self.emb.wte, self.emb.wpe]

    def norm_parameters(self) -> list[nn.Parameter]:
        """Layer-norm parameters (split over x, replicated over y and z) in the program's order."""
        out = []
        for b in self.blocks:
            out += [b.ln1.weight, b.ln1.bias, b.ln2.weight, b.ln2.bias]
        return out + [self.lnf.weight, self.lnf.bias]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, micro_batch: int = 0,
                total_tokens: int | None = None, reduce_loss: bool = True) -> torch.Tensor:
        """Loss of this rank's sequences: tokens, targets [seqs, s] -> scalar.

        Targets equal to IGNORE (-100; any negative) are left out of the loss (goldfish loss).
        The value is (sum of this rank's token losses) / total_tokens, so that gradients are those
        of the mean over the global batch. total_tokens default: the tokens counted in the loss
        over all z and data shards (a scalar all-reduce outside the program, not recorded).
        reduce_loss: also sum the value over z and data (outside the program, not recorded) so that
        it is the global mean on every rank; gradients are unchanged.
        """
        tokens, targets = tokens.to(self.ctx.device), targets.to(self.ctx.device)
        seqs, seq_len = tokens.shape
        if seq_len > self.spec.seq_len:
            raise ValueError(f"sequences of {seq_len} tokens exceed the position table ({self.spec.seq_len})")
        if total_tokens is None:
            counted = (targets >= 0).sum().to(torch.float32)
            total_tokens = int(sum_over_batch_shards(counted, self.ctx).item())
        self.sched.begin_forward(micro_batch, seqs, seq_len)
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        logits = tied_head(self.lnf(x), self.emb)
        loss = vocab_parallel_loss(logits, targets, self.emb, 1.0 / max(total_tokens, 1))
        if reduce_loss:
            loss = loss + (sum_over_batch_shards(loss.detach(), self.ctx) - loss.detach())
        return loss


def sum_over_batch_shards(value: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum a tensor over the z and data axes (not part of the program; not recorded)."""
    value = value.clone()
    for axis in ("z", "data"):
        if ctx.groups.get(axis) is not None:
            dist.all_reduce(value, group=ctx.groups[axis])
    return value


# -- the single-process reference ---------------------------------------------------------------
class ReferenceGPT(nn.Module):
    """The same GPT in one process, full tensors. Linear weights are W [k, n] (y = x @ W);
    qkv's columns are [q | k | v], each head-major."""

    def __init__(self, spec: ModelSpec, vocab: int | None = None, seed: int = 0):
        super().__init__()
        self.spec = spec
        self.vocab = vocab or spec.padded_vocab()
        h = spec.hidden
        gen = torch.Generator().manual_seed(seed)

        def w(*shape):
            return nn.Parameter(torch.randn(shape, generator=gen) * 0.02)

        self.wte, self.wpe = w(self.vocab, h), w(spec.seq_len, h)
        self.blocks = nn.ModuleList()
        for _ in range(spec.layers):
            b = nn.Module()
            b.ln1, b.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            for name, k, n, _ in spec.linear_shapes():
                setattr(b, name, w(k, n))
            self.blocks.append(b)
        self.lnf = nn.LayerNorm(h)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all tokens [batch, s] whose target is not IGNORE."""
        B, s = tokens.shape
        nh, hd = self.spec.heads, self.spec.head_dim
        x = self.wte[tokens] + self.wpe[:s]
        for b in self.blocks:
            q, k, v = (b.ln1(x) @ b.qkv).view(B, s, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, s, -1)
            x = x + a @ b.attn_out
            x = x + F.gelu(b.ln2(x) @ b.mlp_up) @ b.mlp_down
        logits = self.lnf(x) @ self.wte.t()
        return F.cross_entropy(logits.reshape(-1, self.vocab).float(), targets.reshape(-1), ignore_index=IGNORE)


# -- reference <-> shards ---------------------------------------------------------------------------
def _qkv_perm(h: int, gy: int) -> torch.Tensor:
    """Column order of qkv that puts whole heads of q, k and v of y-shard j into column block j."""
    hq = h // gy
    return torch.cat([torch.arange(part * h + j * hq, part * h + (j + 1) * hq)
                      for j in range(gy) for part in range(3)])


def _block_shard(full: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int], z: tuple[int, int]) -> torch.Tensor:
    """Block (row index, row splits) x (col index, col splits) of a 2-D tensor, flattened, z-chunk."""
    (ri, rn), (ci, cn), (zi, zn) = rows, cols, z
    kr, kc = full.shape[0] // rn, full.shape[1] // cn
    block = full[ri * kr:(ri + 1) * kr, ci * kc:(ci + 1) * kc].reshape(-1)
    n = block.numel() // zn
    return block[zi * n:(zi + 1) * n]


def shard_map(model: GPT) -> list[tuple[str, nn.Parameter, callable]]:
    """(reference name, local parameter, fn(full tensor, coords) -> that rank's shard) for every
    parameter of `model`. coords = (x, y, z, data) of any rank."""
    g = model.ctx.grid
    h = model.spec.hidden
    out = []

    def emb(t, c):  # wte / wpe: rows (vocabulary or positions) over y, features over x
        x, y, z, _ = c
        return _block_shard(t, (y, g.y), (x, g.x), (z, g.z))

    out.append(("wte", model.emb.wte, emb))
    out.append(("wpe", model.emb.wpe, emb))
    perm = _qkv_perm(h, g.y)
    for i, b in enumerate(model.blocks):
        for name, _, _, transposed in model.spec.linear_shapes():
            def fn(t, c, name=name, transposed=transposed):
                x, y, z, _ = c
                if name == "qkv":
                    t = t[:, perm]
                rows, cols = ((y, g.y), (x, g.x)) if transposed else ((x, g.x), (y, g.y))
                return _block_shard(t, rows, cols, (z, g.z))
            out.append((f"blocks.{i}.{name}", getattr(b, name).weight, fn))
    norms = [(f"blocks.{i}.{ln}.{w}", getattr(getattr(b, ln), w))
             for i, b in enumerate(model.blocks) for ln in ("ln1", "ln2") for w in ("weight", "bias")]
    norms += [("lnf.weight", model.lnf.weight), ("lnf.bias", model.lnf.bias)]
    for ref_name, p in norms:
        out.append((ref_name, p, lambda t, c: t[c[0] * (h // g.x):(c[0] + 1) * (h // g.x)]))
    return out


def load_from_reference(model: GPT, ref_state: dict[str, torch.Tensor]) -> None:
    """Copy a ReferenceGPT's state_dict (full tensors) into this rank's shards."""
    coords = model.ctx.coords
    with torch.no_grad():
        for name, p, fn in shard_map(model):
            p.copy_(fn(ref_state[name].detach().to(p.device, torch.float32), coords))


def reference_shards(model: GPT, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's shard of each full tensor (e.g. the reference's gradients), keyed by reference name."""
    coords = model.ctx.coords
    return {name: fn(full[name].detach().to(p.device, torch.float32), coords) for name, p, fn in shard_map(model)}


def full_shapes(model: GPT) -> dict[str, tuple[int, ...]]:
    """Shapes of the full (reference) tensors, keyed by ReferenceGPT parameter name."""
    spec, h = model.spec, model.spec.hidden
    out: dict[str, tuple[int, ...]] = {"wte": (model.vocab, h), "wpe": (spec.seq_len, h)}
    for i in range(spec.layers):
        for name, k, n, _ in spec.linear_shapes():
            out[f"blocks.{i}.{name}"] = (k, n)
        for ln in ("ln1", "ln2"):
            out[f"blocks.{i}.{ln}.weight"] = out[f"blocks.{i}.{ln}.bias"] = (h,)
    out["lnf.weight"] = out["lnf.bias"] = (h,)
    return out


def gather_full(model: GPT, what: str = "param") -> dict[str, torch.Tensor]:
    """Full tensors (on CPU) from every rank's shards: 'param' (a ReferenceGPT state_dict) or 'grad'.

    A collective over all ranks; every rank gets the result. Gradients: call after the gradient
    reductions (data, norms), when the replicas agree.
    """
    g = model.ctx.grid
    shapes = full_shapes(model)
    out = {}
    for name, p, fn in shard_map(model):
        local = p.detach() if what == "param" else p.grad
        local = torch.zeros_like(p) if local is None else local
        parts = [torch.zeros_like(local) for _ in range(g.size)]
        dist.all_gather(parts, local.contiguous())
        shape = shapes[name]
        index = torch.arange(math.prod(shape)).view(shape)
        full = torch.zeros(math.prod(shape), dtype=local.dtype)
        for r, part in enumerate(parts):
            full[fn(index, g.coords(r)).reshape(-1)] = part.cpu().reshape(-1)
        out[name] = full.view(shape)
    return out


def gather_full_grads(model: GPT) -> dict[str, torch.Tensor]:
    """Full gradients, keyed by ReferenceGPT parameter name (see gather_full)."""
    return gather_full(model, "grad")
