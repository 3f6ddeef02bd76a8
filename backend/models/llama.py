"""Llama on the 4D algorithm: the model on one rank (its shards, run by the program's executor), a
plain single-process ReferenceLlama with the same math as Hugging Face's LlamaForCausalLM, and the
maps between the two in Hugging Face's names and layout (slices in, full tensors out).

Math (Llama 2/3, as transformers' LlamaForCausalLM computes it): token embedding; `layers` pre-norm
blocks of RMSNorm (fp32, weight only), attention with rotary embeddings in the rotate-half
convention (q and k heads; "llama3" frequency scaling when the spec has rope_scaling) and grouped-
query attention (query head i uses kv head i // (heads/kv_heads)), RMSNorm, SwiGLU MLP
down(silu(gate(x)) * up(x)); a final RMSNorm and an untied head. No biases. The loss is the mean
cross-entropy over the tokens whose target is not IGNORE.

Layout of the 4D model (twin/program/program.py; W = (HF weight)^T, so y = x @ W; y-shard j, x-shard i):
- q/k/v -> the qkv layer (normal: W rows = input features over x, columns over y): y-shard j holds
  [q heads j*H/G_y.. | k heads j*KV/G_y.. | v heads j*KV/G_y..] of H/G_y and KV/G_y heads.
- o_proj -> attn_out (transposed: rows = attention features over y, columns = hidden over x).
- gate_proj, up_proj -> mlp_up (normal): y-shard j holds [gate rows j*F/G_y.. | up rows j*F/G_y..].
- down_proj -> mlp_down (transposed: rows = F over y, columns = hidden over x).
- embed_tokens and lm_head: [V/G_y, h/G_x] blocks of the (V, h) tensor as they are (vocabulary over
  y); V is padded to spec.padded_vocab(G_y): rows beyond the real vocabulary are zero, and the loss
  gives their logits no probability.
- each such block, flattened row-major, is cut into G_z equal chunks: rank z holds chunk z.
- RMSNorm weights: [h/G_x] chunk i (replicated over y, z and data).

Weights in (for `backend run --init-from`): `hf_slices(model)` -> [(hf_names, parameter, reader)];
`reader(get)` returns this rank's flat shard of `parameter`, where `get(name)` gives a view of the
Hugging Face tensor `name` that supports basic slicing, `view[r0:r1, c0:c1]` (1-D: `view[a:b]`):
a full torch tensor, or a safetensors `safe_open(path, "pt").get_slice(name)`. The reader reads only
the rows and columns this shard needs (never the whole tensor); most parameters come from one HF
tensor, qkv from three (q, k, v) and mlp_up from two (gate, up). `load_hf(model, get)` copies them all.

Weights out (for `backend export`): `iter_hf_tensors(model)` yields (hf_name, full tensor on CPU) one
Hugging Face tensor at a time, in HF layout and real vocabulary; a collective (all ranks call it, all
get the tensors). `gather_hf(model)` collects them into a dict (LlamaForCausalLM's state_dict);
`gather_hf(model, "grad")` the gradients, after the end-of-step reductions.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from backend.runtime.layers import IGNORE, rope_tables
from backend.runtime.pipeline import owner_stage
from backend.models.gpt import GPT, Params, add_linears, routers
from backend.models.moe import MixtralMoE, moe_hf_layout
from backend.runtime.moe import aux_coef_of, capacity_factor_of, experts_of, is_moe, moe_layer, top_k_of
from twin.program.grid import AXES
from twin.program.model import ModelSpec
from twin.program.program import EMBEDDING_AXES, NORM_AXIS, embedding_dims


class Llama(GPT):
    """The 4D-parallel Llama on one rank (GPT's interface: the executor sees the same methods).
    Parameters are this rank's fp32 shards; RMSNorm weights start at one, the rest N(0, 0.02)."""

    def _make_parameters(self) -> None:
        spec, ctx = self.spec, self.ctx
        grid, dev, gz, h = ctx.grid, ctx.device, ctx.size("z"), spec.hidden
        self.real_vocab = spec.vocab  # the loss masks the padding rows beyond it
        self.eps = spec.norm_eps
        self.wte_shape, self.wpe_shape = embedding_dims(grid, self.vocab, h), None
        self.emb = Params()
        self.emb.wte = nn.Parameter(torch.zeros(math.prod(self.wte_shape) // gz, device=dev))
        self.head = Params()
        self.head.weight = nn.Parameter(torch.zeros(math.prod(self.wte_shape) // gz, device=dev))
        features = h // ctx.size(NORM_AXIS)
        self.blocks = nn.ModuleList()
        self.shapes: dict[str, tuple[int, int]] = {}
        self.keys: dict[str, list[nn.Parameter]] = {"emb": [self.emb.wte], "head": [self.head.weight]}
        for i in range(spec.layers):
            blk = Params()
            for ln in ("ln1", "ln2"):
                setattr(blk, ln, _rms(features, dev))
                self.keys[f"L{i}.{ln}"] = [getattr(blk, ln).weight]
            for key, weight in add_linears(blk, spec, grid, i, self.shapes, dev).items():
                self.keys[key] = [weight]
            self.blocks.append(blk)
        self.lnf = _rms(features, dev)
        self.keys["lnf"] = [self.lnf.weight]
        if is_moe(spec):
            self.keys["routers"] = routers(self.blocks)
        self.keys["norms"] = self.norm_parameters()
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def sharded_parameters(self) -> list[nn.Parameter]:
        return self.linears() + [self.emb.wte, self.head.weight]

    def norm_parameters(self) -> list[nn.Parameter]:
        out = []
        for b in self.blocks:
            out += [b.ln1.weight, b.ln2.weight]
        return out + [self.lnf.weight]

    def unpack(self, key: str, flat: torch.Tensor):
        rows = flat.view(self.ctx.size("z"), -1)
        return rows.reshape(self.shapes.get(key, self.wte_shape))

    def embedding_shapes(self):
        return self.wte_shape, None

    def embedding_offsets(self) -> tuple[int, int]:
        return self.ctx.coord(EMBEDDING_AXES[0]) * self.wte_shape[0], 0

    def rope_tables(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [seq_len, head_dim] (fp32, on the model's device), computed once per length."""
        if seq_len not in self._rope:
            self._rope[seq_len] = rope_tables(self.spec, seq_len, self.ctx.device)
        return self._rope[seq_len]


def _rms(features: int, device) -> nn.Module:
    norm = Params()
    norm.weight = nn.Parameter(torch.ones(features, device=device))
    return norm


# -- the single-process reference -----------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _linear(k: int, n: int) -> nn.Linear:
    return nn.Linear(k, n, bias=False)


class ReferenceLlama(nn.Module):
    """The same Llama in one process, full tensors, with LlamaForCausalLM's parameter names and
    shapes (weights (out, in)), so `load_state_dict(hf_model.state_dict())` loads a Hugging Face
    model. The vocabulary is the spec's, not padded. forward(tokens, targets) -> mean loss;
    logits(tokens) -> [batch, s, vocab] (fp32)."""

    def __init__(self, spec: ModelSpec, seed: int = 0):
        super().__init__()
        self.spec = spec
        h, f, d, eps = spec.hidden, spec.ffn, spec.head_dim, spec.norm_eps
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(spec.vocab, h)
        self.model.layers = nn.ModuleList()
        for _ in range(spec.layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            for name, out in (("q_proj", spec.heads * d), ("k_proj", spec.n_kv_heads * d),
                              ("v_proj", spec.n_kv_heads * d)):
                setattr(layer.self_attn, name, _linear(h, out))
            layer.self_attn.o_proj = _linear(spec.heads * d, h)
            if moe_layer(spec, len(self.model.layers)):  # Mixtral's sparse MoE block in place of the MLP
                layer.block_sparse_moe = MixtralMoE(h, f, experts_of(spec), top_k_of(spec), capacity_factor_of(spec))
            else:
                layer.mlp = nn.Module()
                layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj = _linear(h, f), _linear(h, f), _linear(f, h)
            layer.input_layernorm, layer.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
            self.model.layers.append(layer)
        self.model.norm = RMSNorm(h, eps)
        self.lm_head = _linear(h, spec.vocab)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def logits(self, tokens: torch.Tensor, groups: int = 1, micro_batches: int = 1) -> torch.Tensor:
        """Logits [batch, s, vocab] in fp32 of token ids [batch, s]. MoE layers (Mixtral): their mean
        auxiliary loss is left in `self.aux` (capacity and the loss per group of tokens:
        backend.models.moe)."""
        B, s = tokens.shape
        auxes = []
        nh, kv, d = self.spec.heads, self.spec.n_kv_heads, self.spec.head_dim
        cos, sin = rope_tables(self.spec, s, tokens.device)

        def rotate(t):  # [B, heads, s, d]
            t1, t2 = t.chunk(2, -1)
            return t * cos.to(t.dtype) + torch.cat([-t2, t1], -1) * sin.to(t.dtype)

        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            a, hn = layer.self_attn, layer.input_layernorm(x)
            q = rotate(a.q_proj(hn).view(B, s, nh, d).transpose(1, 2))
            k = rotate(a.k_proj(hn).view(B, s, kv, d).transpose(1, 2))
            v = a.v_proj(hn).view(B, s, kv, d).transpose(1, 2)
            k, v = k.repeat_interleave(nh // kv, 1), v.repeat_interleave(nh // kv, 1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, s, nh * d)
            x = x + a.o_proj(o)
            hn = layer.post_attention_layernorm(x)
            if hasattr(layer, "block_sparse_moe"):
                y, aux = layer.block_sparse_moe(hn, groups, micro_batches)
                x, auxes = x + y, auxes + [aux]
                continue
            m = layer.mlp
            x = x + m.down_proj(F.silu(m.gate_proj(hn)) * m.up_proj(hn))
        self.aux = torch.stack(auxes).mean() if auxes else None
        return self.lm_head(self.model.norm(x)).float()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, groups: int = 1, micro_batches: int = 1) -> torch.Tensor:
        """Mean cross-entropy over all tokens [batch, s] whose target is not IGNORE, plus, for a MoE
        model, router_aux_coef times the auxiliary loss (mean over MoE layers and micro-batches; `groups`: backend.models.moe)."""
        logits = self.logits(tokens, groups, micro_batches)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)
        return loss if self.aux is None else loss + aux_coef_of(self.spec) * self.aux


# -- Hugging Face tensors <-> shards --------------------------------------------------------------
View = object  # anything with basic 2-D (1-D) slicing: a torch tensor, a safetensors slice
Reader = Callable[[Callable[[str], View]], torch.Tensor]


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Shapes of LlamaForCausalLM's (MixtralForCausalLM's) tensors for `spec`, by Hugging Face name as
    the safetensors files hold them (real vocabulary)."""
    h, f, d, V = spec.hidden, spec.ffn, spec.head_dim, spec.vocab
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (spec.heads * d, h),
                    p + "self_attn.k_proj.weight": (spec.n_kv_heads * d, h),
                    p + "self_attn.v_proj.weight": (spec.n_kv_heads * d, h),
                    p + "self_attn.o_proj.weight": (h, spec.heads * d),
                    p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if moe_layer(spec, i):  # Mixtral's names as its files hold them (w1 gate, w3 up, w2 down)
            out[p + "block_sparse_moe.gate.weight"] = (experts_of(spec), h)
            for e in range(experts_of(spec)):
                q = p + f"block_sparse_moe.experts.{e}."
                out.update({q + "w1.weight": (f, h), q + "w2.weight": (h, f), q + "w3.weight": (f, h)})
        else:
            out.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                        p + "mlp.down_proj.weight": (h, f)})
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (V, h)
    return out


def _z_range(numel: int, coords, gz: int) -> tuple[int, int]:
    n = numel // gz
    z = coords[AXES.index("z")]
    return z * n, (z + 1) * n


def _read(view, rows: tuple[int, int], cols: tuple[int, int], limit: int, like: torch.Tensor | None):
    """view[r0:r1, c0:c1] with rows at or beyond `limit` (the real vocabulary) as padding: zero, or
    -1 for an integer view (the index maps of the export)."""
    (r0, r1), (c0, c1) = rows, cols
    got = view[r0:min(r1, limit), c0:c1] if min(r1, limit) > r0 else None
    if got is not None and got.shape[0] == r1 - r0:
        return got
    ref = got if got is not None else like
    fill = 0 if ref.dtype.is_floating_point else -1
    pad = torch.full((r1 - max(r0, min(r1, limit)), c1 - c0), fill, dtype=ref.dtype)
    return pad if got is None else torch.cat([got, pad], 0)


def _linear_reader(parts: list[tuple[str, int, int]], cols: tuple[int, int], coords, gz: int) -> Reader:
    """W block = cat(HF rows of each part)[:, cols]^T ([k_local, n_local]), flattened, z-chunk."""
    nl = sum(r1 - r0 for _, r0, r1 in parts)
    kl = cols[1] - cols[0]
    zs, ze = _z_range(kl * nl, coords, gz)

    def reader(get):
        ra, rb = zs // nl, -(-ze // nl)  # the W rows (HF columns) this chunk touches
        c = (cols[0] + ra, cols[0] + rb)
        block = torch.cat([get(name)[r0:r1, c[0]:c[1]] for name, r0, r1 in parts], 0).t()
        return block.reshape(-1)[zs - ra * nl:ze - ra * nl]
    return reader


def _table_reader(name: str, rows: tuple[int, int], cols: tuple[int, int], limit: int, coords, gz: int) -> Reader:
    """Block rows x cols of a (V, h) table as it is, padding rows zero, flattened, z-chunk."""
    nc = cols[1] - cols[0]
    zs, ze = _z_range((rows[1] - rows[0]) * nc, coords, gz)

    def reader(get):
        ra, rb = zs // nc, -(-ze // nc)
        view = get(name)
        like = view[0:1, cols[0]:cols[0] + 1]
        block = _read(view, (rows[0] + ra, rows[0] + rb), cols, limit, like)
        return block.reshape(-1)[zs - ra * nc:ze - ra * nc]
    return reader


def hf_layout(model: Llama, coords) -> list[tuple[tuple[str, ...], nn.Parameter, Reader]]:
    """(HF names, parameter, reader) of every parameter, for the rank at `coords` (x, y, z, data)."""
    spec, g = model.spec, model.ctx.grid
    h, f, d, gz = spec.hidden, spec.ffn, spec.head_dim, g.z

    def part(axis: str, total: int) -> tuple[int, int]:
        n = total // g.axis_size(axis)
        c = coords[AXES.index(axis)]
        return c * n, (c + 1) * n

    out = []
    vrows, vcols = part(EMBEDDING_AXES[0], model.vocab), part(EMBEDDING_AXES[1], h)
    for name, p in (("model.embed_tokens.weight", model.emb.wte), ("lm_head.weight", model.head.weight)):
        out.append(((name,), p, _table_reader(name, vrows, vcols, spec.vocab, coords, gz)))
    for i, b in enumerate(model.blocks):
        pre = f"model.layers.{i}."
        q, k, v, o = (pre + f"self_attn.{n}_proj.weight" for n in "qkvo")
        gate, up, down = (pre + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
        qh, kh = part("y", spec.heads), part("y", spec.n_kv_heads)
        lins = {
            "qkv": ([(q, qh[0] * d, qh[1] * d), (k, kh[0] * d, kh[1] * d), (v, kh[0] * d, kh[1] * d)], part("x", h)),
            "attn_out": ([(o, *part("x", h))], part("y", h)),
            "mlp_up": ([(gate, *part("y", f)), (up, *part("y", f))], part("x", h)),
            "mlp_down": ([(down, *part("x", h))], part("y", f)),
        }
        if moe_layer(spec, i):
            out += moe_hf_layout(model, b, pre, coords, part)
        for name, *_ in spec.linear_shapes():
            if name not in lins or not hasattr(b, name):
                continue
            parts, cols = lins[name]
            out.append((tuple(p[0] for p in parts), getattr(b, name).weight, _linear_reader(parts, cols, coords, gz)))
        for ln, hf in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")):
            out.append(((pre + f"{hf}.weight",), getattr(b, ln).weight, _norm_reader(pre + f"{hf}.weight", part(NORM_AXIS, h))))
    out.append((("model.norm.weight",), model.lnf.weight, _norm_reader("model.norm.weight", part(NORM_AXIS, h))))
    return out


def _norm_reader(name: str, cols: tuple[int, int]) -> Reader:
    return lambda get: get(name)[cols[0]:cols[1]]


def hf_slices(model: Llama) -> list[tuple[tuple[str, ...], nn.Parameter, Reader]]:
    """(HF names, this rank's parameter, reader) for every parameter (module docstring)."""
    return hf_layout(model, model.ctx.coords)


def load_hf(model: Llama, get: Callable[[str], View]) -> None:
    """Copy the Hugging Face tensors that `get(name)` gives (full tensors or safetensors slices) into
    this rank's shards (reading only its slices)."""
    with torch.no_grad():
        for _, p, reader in hf_slices(model):
            p.copy_(reader(get).to(p.device, torch.float32).reshape(p.shape))


def iter_hf_tensors(model: Llama, what: str = "param") -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor on CPU) of every Hugging Face tensor, in HF layout and the real
    vocabulary, from every rank's shards: 'param' or 'grad' (after the gradient reductions).
    A collective over all ranks, one parameter at a time; every rank gets every tensor."""
    g = model.ctx.grid
    shapes = hf_shapes(model.spec)
    layouts = [hf_layout(model, g.coords(r)) for r in range(g.size)]
    for j, (names, p, _) in enumerate(layouts[0]):
        local = p.detach() if what == "param" else p.grad
        local = torch.zeros_like(p) if local is None else local
        parts = [torch.zeros_like(local) for _ in range(g.size)]
        dist.all_gather(parts, local.contiguous())
        offsets, total = {}, 0
        for name in names:
            offsets[name] = total
            total += math.prod(shapes[name])

        def index(name: str) -> torch.Tensor:
            return torch.arange(offsets[name], offsets[name] + math.prod(shapes[name])).view(shapes[name])

        full = torch.zeros(total, dtype=local.dtype)
        owner = owner_stage(model, names[0]) if g.pipe > 1 else None  # a pipeline: the copy its stage trains
        for r, part in enumerate(parts):
            if owner is not None and g.stage(r) != owner:
                continue
            idx = layouts[r][j][2](index).reshape(-1)
            keep = idx >= 0
            full[idx[keep]] = part.cpu().reshape(-1)[keep]
        for name in names:
            yield name, full[offsets[name]:offsets[name] + math.prod(shapes[name])].view(shapes[name])


def gather_hf(model: Llama, what: str = "param") -> dict[str, torch.Tensor]:
    """All of iter_hf_tensors in a dict: a LlamaForCausalLM state_dict (or its gradients)."""
    return dict(iter_hf_tensors(model, what))
