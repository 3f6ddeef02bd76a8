"""Where each rank's parameter shards sit in the full tensors: the global placement that lets a
checkpoint written on one grid be loaded on any other (backend.runtime.dcp).

A 4D parameter shard is a flat chunk: the rank's block of a full matrix (k/G_x x n/G_y, or the
transposed split), flattened row-major and cut into G_z equal chunks (layer norms: a chunk over x).
Such a chunk is a union of at most three rectangles of the block (a partial first row, whole rows,
a partial last row), and each rectangle, cut at the block's column segments (qkv is [q | k | v] of
the rank's heads, a Llama's mlp_up [gate | up]), is a rectangle ("box") of one full tensor. Every
box is a strided view of the flat shard, so it is written and read in place.

The full tensors are named as the models' single-process references name them, so that a checkpoint
loaded with plain torch.distributed.checkpoint is a state dict one of them loads:
- GPT: ReferenceGPT's (`wte` [padded vocabulary, h], `wpe`, `blocks.3.qkv` [h, 3h] with columns
  [q | k | v], each head-major, ..., `lnf.bias`);
- Llama: Hugging Face LlamaForCausalLM's (`model.layers.3.self_attn.q_proj.weight`, ...; weights
  (out, in), the real vocabulary): its boxes are transposed views of the shards.

On a pipelined grid every rank holds the whole model's shards, and the copy of a parameter that is
trained is the one of its owner stage (backend.runtime.pipeline.owner_stage): only that stage's
ranks write it; every rank reads all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from backend.runtime.pipeline import owner_stage
from twin.program.grid import AXES
from twin.program.program import EMBEDDING_AXES, NORM_AXIS, linear_dims


@dataclass(frozen=True)
class Box:
    """One rectangle of a full tensor that a flat shard holds: `offsets` and `sizes` in the full
    tensor; the shard's elements are flat.as_strided(shape, strides, start), transposed when
    `transposed` (then shape is sizes reversed)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    transposed: bool = False

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        v = flat.as_strided(self.shape, self.strides, flat.storage_offset() + self.start)
        return v.t() if self.transposed else v


@dataclass(frozen=True)
class Placement:
    """A parameter's place: the full tensor (`name`, `shape`) and the boxes this rank's shard holds."""

    name: str
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    owner: int | None  # the pipeline stage whose copy is trained (None without a pipeline)


@dataclass(frozen=True)
class _Segment:
    """Block columns [c0, c0 + width) are columns [col, col + width) and rows [row, ...) of the full
    matrix `name` (or, transposed, its rows [col, ...) and columns [row, ...))."""

    name: str
    shape: tuple[int, ...]  # (rows, cols), or (n,) for a vector
    c0: int
    width: int
    row: int
    col: int
    transposed: bool = False
    row_limit: int | None = None  # full rows at or beyond this are padding, not saved (a Llama's vocabulary)


def flat_rectangles(rows: int, cols: int, a: int, b: int) -> list[tuple[int, int, int, int]]:
    """The flat range [a, b) of a row-major [rows, cols] block as rectangles (r0, r1, c0, c1), in
    order: a partial first row, whole rows, a partial last row (each present only if not empty)."""
    out = []
    if a >= b:
        return out
    r, c = divmod(a, cols)
    if c:
        end = min(b, (r + 1) * cols)
        out.append((r, r + 1, c, end - r * cols))
        a, r = end, r + 1
    whole = (b - a) // cols
    if whole:
        out.append((r, r + whole, 0, cols))
        a, r = a + whole * cols, r + whole
    if a < b:
        out.append((r, r + 1, 0, b - a))
    return out


def _boxes(block: tuple[int, int], z: tuple[int, int], segments: list[_Segment]) -> tuple[Box, ...]:
    """The boxes of the z-chunk (index, count) of a row-major block cut at `segments`."""
    rows, cols = block
    n = rows * cols // z[1]
    a = z[0] * n
    out = []
    for r0, r1, c0, c1 in flat_rectangles(rows, cols, a, a + n):
        for s in segments:
            lo, hi = max(c0, s.c0), min(c1, s.c0 + s.width)
            top = r1 if s.row_limit is None else min(r1, s.row_limit - s.row)
            if lo >= hi or top <= r0:
                continue
            start = r0 * cols + lo - a
            shape, strides = (top - r0, hi - lo), (cols, 1)
            offsets = (s.row + r0, s.col + lo - s.c0)
            sizes = shape
            if len(s.shape) == 1:  # a vector (a norm): the one row of its block
                offsets, sizes, shape, strides = offsets[1:], sizes[1:], shape[1:], strides[1:]
            elif s.transposed:
                offsets, sizes = offsets[::-1], sizes[::-1]
            out.append(Box(offsets, sizes, start, shape, strides, s.transposed))
    return tuple(out)


def placements(model) -> dict[str, list[Placement]]:
    """Parameter name (model.named_parameters) -> the places of this rank's shard, one per full
    tensor it holds a part of (a Llama's qkv shard holds parts of q, k and v)."""
    return placements_at(model, model.ctx.coords)


def placements_at(model, coords) -> dict[str, list[Placement]]:
    """placements() for the rank at `coords` (x, y, z, data) of the model's grid."""
    spec, g = model.spec, model.ctx.grid
    llama = getattr(spec, "is_llama", False)
    h, gz = spec.hidden, g.z

    def part(axis: str, total: int) -> tuple[int, int]:
        n = total // g.axis_size(axis)
        c = coords[AXES.index(axis)]
        return c * n, n

    zc = (coords[AXES.index("z")], gz)
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, list[Placement]] = {}

    def owner(ref: str) -> int | None:
        return owner_stage(model, ref) if g.pipe > 1 else None

    def add(param, ref: str, block: tuple[int, int], segments: list[_Segment], z=zc) -> None:
        by_name: dict[str, list[Box]] = {}
        shapes = {s.name: (s.shape[::-1] if s.transposed else s.shape) for s in segments}
        for seg in segments:
            by_name.setdefault(seg.name, []).extend(_boxes(block, z, [seg]))
        out[names[id(param)]] = [Placement(n, tuple(shapes[n]), tuple(bx), owner(ref))
                                 for n, bx in by_name.items() if bx]

    # embedding tables: rows (vocabulary or positions) over EMBEDDING_AXES[0], features over [1]
    (r0, rl), (c0, cl) = part(EMBEDDING_AXES[0], model.vocab), part(EMBEDDING_AXES[1], h)
    if llama:
        for p, name, ref in ((model.emb.wte, "model.embed_tokens.weight", "wte"), (model.head.weight, "lm_head.weight", "head")):
            add(p, ref, (rl, cl), [_Segment(name, (spec.vocab, h), 0, cl, r0, c0, row_limit=spec.vocab)])
    else:
        add(model.emb.wte, "wte", (rl, cl), [_Segment("wte", (model.vocab, h), 0, cl, r0, c0)])
        (p0, pl) = part(EMBEDDING_AXES[0], spec.seq_len)
        add(model.emb.wpe, "wpe", (pl, cl), [_Segment("wpe", (spec.seq_len, h), 0, cl, p0, c0)])
    for i, blk in enumerate(model.blocks):
        ref = f"blocks.{i}.x"
        for lname, k, n, transposed in spec.linear_shapes():
            if not hasattr(blk, lname):  # a layer this map does not know (experts): saved per rank
                continue
            kl, nl, in_axis, out_axis = linear_dims(g, k, n, transposed)
            row = coords[AXES.index(in_axis)] * kl
            out_c = coords[AXES.index(out_axis)]
            if llama:
                segs = _llama_segments(spec, i, lname, row, out_c, g, k, n, kl, nl)
            elif lname == "qkv":  # whole heads of q, k and v of y-shard j: columns [q_j | k_j | v_j]
                hq = nl // 3
                segs = [_Segment(f"blocks.{i}.qkv", (k, n), t * hq, hq, row, t * h + out_c * hq) for t in range(3)]
            else:
                segs = [_Segment(f"blocks.{i}.{lname}", (k, n), 0, nl, row, out_c * nl)]
            add(getattr(blk, lname).weight, ref, (kl, nl), segs)
        lns = (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"))
        for ln, hf in lns:
            for w in (("weight",) if llama else ("weight", "bias")):
                name = f"model.layers.{i}.{hf}.weight" if llama else f"blocks.{i}.{ln}.{w}"
                _norm(add, getattr(getattr(blk, ln), w), ref, name, h, coords, g)
    for w in (("weight",) if llama else ("weight", "bias")):
        _norm(add, getattr(model.lnf, w), "lnf", "model.norm.weight" if llama else f"lnf.{w}", h, coords, g)
    return out


def _norm(add, param, ref: str, name: str, h: int, coords, g) -> None:
    """A norm's x-chunk: one 1-D box of the full vector [h]."""
    n = h // g.axis_size(NORM_AXIS)
    c = coords[AXES.index(NORM_AXIS)]
    add(param, ref, (1, n), [_Segment(name, (h,), 0, n, 0, c * n)], z=(0, 1))


def _llama_segments(spec, i: int, lname: str, row: int, out_c: int, g, k: int, n: int, kl: int, nl: int):
    """A Llama linear's block columns as parts of Hugging Face tensors (weights (out, in): transposed)."""
    d, f, h = spec.head_dim, spec.ffn, spec.hidden
    pre = f"model.layers.{i}."
    if lname == "qkv":
        hq, kq = spec.heads // g.y * d, spec.n_kv_heads // g.y * d
        parts = [("self_attn.q_proj", spec.heads * d, hq), ("self_attn.k_proj", spec.n_kv_heads * d, kq),
                 ("self_attn.v_proj", spec.n_kv_heads * d, kq)]
    elif lname == "mlp_up":
        parts = [("mlp.gate_proj", f, f // g.y), ("mlp.up_proj", f, f // g.y)]
    elif lname == "attn_out":
        parts = [("self_attn.o_proj", n, nl)]
    else:
        parts = [("mlp.down_proj", n, nl)]
    segs, c0 = [], 0
    for hf, total, width in parts:
        segs.append(_Segment(pre + hf + ".weight", (k, total), c0, width, row, out_c * width, transposed=True))
        c0 += width
    return segs


def full_shapes(model) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every full tensor of the model's placement."""
    return {p.name: p.shape for places in placements(model).values() for p in places}


def numel(places: list[Placement]) -> int:
    return sum(math.prod(b.sizes) for p in places for b in p.boxes)
