"""The GPT of backend.models.gpt in one process: ReferenceGPT, plain full tensors with the same math, and
the maps between it and the 4D GPT's shards (weights in: load_from_reference; weights or gradients
out: gather_full). Tests check the 4D model against it; backend.models.generate gathers checkpoints with
its maps.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from backend.models.moe import GPTMoE
from backend.runtime.layers import IGNORE
from backend.runtime.moe import aux_coef_of, capacity_factor_of, experts_of, moe_layer, top_k_of
from backend.runtime.pipeline import owner_stage
from twin.program.grid import AXES
from twin.program.model import ModelSpec
from twin.program.program import EMBEDDING_AXES, NORM_AXIS, linear_dims

if TYPE_CHECKING:
    from backend.models.gpt import GPT


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
        for i in range(spec.layers):
            b = nn.Module()
            b.ln1, b.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            for name, k, n, _ in spec.linear_shapes():
                if not (moe_layer(spec, i) and name.startswith("mlp")):
                    setattr(b, name, w(k, n))
            if moe_layer(spec, i):  # experts (each this MLP) and a router in place of the MLP
                b.moe = GPTMoE(h, spec.ffn, experts_of(spec), top_k_of(spec), capacity_factor_of(spec), init=w)
            self.blocks.append(b)
        self.lnf = nn.LayerNorm(h)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, groups: int = 1, micro_batches: int = 1) -> torch.Tensor:
        """Mean cross-entropy over all tokens [batch, s] whose target is not IGNORE (plus, with MoE
        layers, router_aux_coef times their auxiliary loss, its mean over layers and `groups`:
        backend.models.moe)."""
        B, s = tokens.shape
        auxes = []
        nh, hd = self.spec.heads, self.spec.head_dim
        x = self.wte[tokens] + self.wpe[:s]
        for b in self.blocks:
            q, k, v = (b.ln1(x) @ b.qkv).view(B, s, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, s, -1)
            x = x + a @ b.attn_out
            if hasattr(b, "moe"):
                y, aux = b.moe(b.ln2(x), groups, micro_batches)
                x, auxes = x + y, auxes + [aux]
            else:
                x = x + F.gelu(b.ln2(x) @ b.mlp_up) @ b.mlp_down
        logits = self.lnf(x) @ self.wte.t()
        loss = F.cross_entropy(logits.reshape(-1, self.vocab).float(), targets.reshape(-1), ignore_index=IGNORE)
        return loss + aux_coef_of(self.spec) * torch.stack(auxes).mean() if auxes else loss


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

    def split(c, axis: str) -> tuple[int, int]:
        return c[AXES.index(axis)], g.axis_size(axis)

    def emb(t, c):  # wte / wpe: rows (vocabulary or positions) and features as EMBEDDING_AXES say
        return _block_shard(t, split(c, EMBEDDING_AXES[0]), split(c, EMBEDDING_AXES[1]), split(c, "z"))

    out.append(("wte", model.emb.wte, emb))
    out.append(("wpe", model.emb.wpe, emb))
    perm = _qkv_perm(h, g.y)  # heads split over y: the qkv layer's outputs, a normal layer's
    for i, b in enumerate(model.blocks):
        if moe_layer(model.spec, i):
            out += _moe_map(model, b, i, split)
        for name, k, n, transposed in model.spec.linear_shapes():
            if not hasattr(b, name):
                continue
            _, _, in_axis, out_axis = linear_dims(g, k, n, transposed)

            def fn(t, c, name=name, in_axis=in_axis, out_axis=out_axis):
                if name == "qkv":
                    t = t[:, perm]
                return _block_shard(t, split(c, in_axis), split(c, out_axis), split(c, "z"))
            out.append((f"blocks.{i}.{name}", getattr(b, name).weight, fn))
    norms = [(f"blocks.{i}.{ln}.{w}", getattr(getattr(b, ln), w))
             for i, b in enumerate(model.blocks) for ln in ("ln1", "ln2") for w in ("weight", "bias")]
    norms += [("lnf.weight", model.lnf.weight), ("lnf.bias", model.lnf.bias)]
    for ref_name, p in norms:
        out.append((ref_name, p, lambda t, c: t.view(g.axis_size(NORM_AXIS), -1)[c[AXES.index(NORM_AXIS)]]))
    return out


def _moe_map(model: GPT, b, i: int, split) -> list[tuple[str, nn.Parameter, callable]]:
    """shard_map's entries of an MoE block: the router [h, E] (rows over x, not cut over z) and the
    stacked experts [E, k, n] (the rank's E/E_p experts, each split as the MLP's layer, stacked,
    flattened, cut over z)."""
    g, spec = model.ctx.grid, model.spec
    n_local = spec.experts // g.expert
    out = [(f"blocks.{i}.moe.router", b.router.weight,
            lambda t, c: t.view(g.x, -1, t.shape[1])[c[AXES.index("x")]])]
    lin = {name: (k, n, tr) for name, k, n, tr in spec.linear_shapes()}
    for name, ref in (("expert_up", "mlp_up"), ("expert_down", "mlp_down")):
        _, _, in_axis, out_axis = linear_dims(g, *lin[ref])

        def fn(t, c, in_axis=in_axis, out_axis=out_axis):
            first = c[AXES.index("data")] % g.expert * n_local
            flat = torch.cat([_block_shard(t[e], split(c, in_axis), split(c, out_axis), (0, 1))
                              for e in range(first, first + n_local)])
            zi, zn = split(c, "z")
            n = flat.numel() // zn
            return flat[zi * n:(zi + 1) * n]
        out.append((f"blocks.{i}.moe.{ref}", getattr(b, name).weight, fn))
    return out


def load_from_reference(model: GPT, ref_state: dict[str, torch.Tensor]) -> None:
    """Copy a ReferenceGPT's state_dict (full tensors) into this rank's shards."""
    coords = model.ctx.coords
    with torch.no_grad():
        for name, p, fn in shard_map(model):
            p.copy_(fn(ref_state[name].detach().to(p.device, torch.float32), coords))


def full_shapes(model: GPT) -> dict[str, tuple[int, ...]]:
    """Shapes of the full (reference) tensors, keyed by ReferenceGPT parameter name."""
    spec, h = model.spec, model.spec.hidden
    out: dict[str, tuple[int, ...]] = {"wte": (model.vocab, h), "wpe": (spec.seq_len, h)}
    for i in range(spec.layers):
        for name, k, n, _ in spec.linear_shapes():
            if moe_layer(spec, i) and name.startswith("mlp"):  # stacked experts and the router
                out[f"blocks.{i}.moe.{name}"] = (spec.experts, k, n)
                out[f"blocks.{i}.moe.router"] = (h, spec.experts)
            else:
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
        owner = owner_stage(model, name) if g.pipe > 1 else None  # a pipeline: the copy its stage trains
        for r, part in enumerate(parts):
            if owner is None or g.stage(r) == owner:
                full[fn(index, g.coords(r)).reshape(-1)] = part.cpu().reshape(-1)
        out[name] = full.view(shape)
    return out


def gather_full_grads(model: GPT) -> dict[str, torch.Tensor]:
    """Full gradients, keyed by ReferenceGPT parameter name (see gather_full)."""
    return gather_full(model, "grad")
