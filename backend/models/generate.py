"""Decoding from a checkpoint of any grid: gather the shards into full weights, decode in one process.

    weights = load_weights("ckpt/")                     # full tensors, ReferenceGPT names
    out = generate(weights, prompt_ids, new_tokens=32)   # greedy; temperature > 0 samples

The full weights of a sharded checkpoint are assembled with the model's own shard map
(backend.models.reference.shard_map: which block of each full tensor a rank of the grid holds), so decoding is
exact whatever grid trained the model: the weights are bit for bit those of the training run, and the
math is ReferenceGPT's (learned positions, pre-norm blocks, causal attention, GELU MLP, tied head).
Decoding keeps a KV cache: each new token costs one position's forward pass. Padded vocabulary rows
(the grid pads the vocabulary) are never generated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from topologies.common import TwinError
from twin.program.grid import Grid
from twin.program.model import ModelSpec, load_model

LN_EPS = 1e-5  # torch.nn.LayerNorm's default, as ReferenceGPT uses


@dataclass
class Weights:
    """Full (unsharded) weights of a GPT: ReferenceGPT state_dict names -> tensors, and the spec."""

    spec: ModelSpec
    tensors: dict[str, torch.Tensor]
    grid: str = "1x1x1x1"   # the grid of the checkpoint they were gathered from
    step: int = 0           # its training step

    @property
    def vocab(self) -> int:
        """The model's real vocabulary (without the padding rows)."""
        return self.spec.vocab


def checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint step directory: `path` itself, or the latest checkpoint of a checkpoint root."""
    from backend.runtime import checkpoint

    p = Path(path)
    if (p / "meta.json").is_file():
        return p
    if not p.exists():
        raise TwinError(f"checkpoint {path} does not exist (give a --ckpt-dir of `backend run` or one "
                        "of its step_* directories)")
    latest = checkpoint.latest(p)
    if latest is None:
        raise TwinError(f"{path} holds no checkpoint (no meta.json and no 'latest' pointer)")
    return latest


def read_checkpoint(path: str | Path) -> tuple[Path, dict, ModelSpec, Grid]:
    """(step directory, meta.json, model spec, grid) of the checkpoint at `path` (checkpoint_dir)."""
    from backend.runtime import checkpoint

    ckpt = checkpoint_dir(path)
    meta = checkpoint.read_meta(ckpt)
    try:
        spec, grid = ModelSpec(**meta["model"]), Grid.parse(meta["grid"])
    except (TypeError, KeyError) as e:
        raise TwinError(f"checkpoint {ckpt}: meta.json lacks a valid model or grid ({e})") from None
    if grid.pipe > 1 and meta["format"] != checkpoint.FORMAT:
        raise TwinError(f"checkpoint {ckpt} is of the pipelined grid {grid}: decoding and export read 4D "
                        "checkpoints only (resume it with `backend run`, or train on a grid of four fields)")
    return ckpt, meta, spec, grid


def load_weights(path: str | Path, model: str | None = None) -> Weights:
    """Gather the full weights of the checkpoint at `path` (a step directory or a checkpoint root).

    model: a model name or file the checkpoint must have been written for (raises TwinError when not).
    """
    from backend.runtime import checkpoint
    from backend.runtime.dist import ParallelContext
    from backend.models.gpt import GPT
    from backend.models.reference import full_shapes, shard_map

    ckpt, meta, spec, grid = read_checkpoint(path)
    if getattr(spec, "is_llama", False):
        raise TwinError(f"checkpoint {ckpt} is of a Llama ({spec.name}): backend generate decodes GPT checkpoints; "
                        "write it as a Hugging Face directory with `backend export` and decode it with transformers")
    if getattr(spec, "is_moe", False):
        raise TwinError(f"checkpoint {ckpt} is of a mixture-of-experts GPT ({spec.name}): backend generate decodes "
                        "dense GPT checkpoints only")
    if model is not None:
        want = load_model(model)
        if want != spec:
            raise TwinError(f"checkpoint {ckpt} was written for model {spec.name!r} ({spec.layers} layers, "
                            f"hidden {spec.hidden}), not {want.name!r}: give the matching --model or none")
    if meta["format"] == checkpoint.FORMAT:  # DCP: the full tensors under ReferenceGPT's names
        from backend.runtime import dcp
        checkpoint.verify(ckpt)
        layout = GPT(spec, ParallelContext(grid, 0, torch.device("cpu"), "gloo", {}))
        shapes = full_shapes(layout)
        tensors = dcp.read_weights(ckpt, set(shapes))
        if set(tensors) != set(shapes):
            raise TwinError(f"checkpoint {ckpt} has no {sorted(set(shapes) - set(tensors))[0]}: it does not match "
                            f"its model {spec.name}")
        return Weights(spec, {k: t.float().view(shapes[k]) for k, t in tensors.items()}, str(grid), int(meta["step"]))
    # one rank's model, built only for its shard map (which block of each full tensor rank r holds)
    layout = GPT(spec, ParallelContext(grid, 0, torch.device("cpu"), "gloo", {}))
    key = {id(p): name for name, p in layout.named_parameters()}
    entries = [(ref, key[id(p)], tuple(p.shape), fn) for ref, p, fn in shard_map(layout)]
    shapes = full_shapes(layout)
    full = {ref: torch.zeros(math.prod(shapes[ref])) for ref, *_ in entries}
    index = {ref: torch.arange(math.prod(shapes[ref])).view(shapes[ref]) for ref, *_ in entries}
    for rank in range(grid.size):
        file = ckpt / checkpoint.rank_file_name(rank)
        state = checkpoint.read_rank(ckpt, rank).get("model", {})  # checks the file's checksum
        coords = grid.coords(rank)
        for ref, name, shape, fn in entries:
            t = state.get(name)
            if t is None or tuple(t.shape) != shape:
                got = "missing" if t is None else f"shape {tuple(t.shape)}"
                raise TwinError(f"checkpoint {file}: tensor {name} is {got}, model {spec.name} on grid {grid} "
                                f"expects shape {shape}: the checkpoint does not match its model")
            full[ref][fn(index[ref], coords).reshape(-1)] = t.detach().float().reshape(-1)
    return Weights(spec, {ref: t.view(shapes[ref]) for ref, t in full.items()}, str(grid), int(meta["step"]))


# -- the forward pass with a KV cache ---------------------------------------------------------------
def _ln(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], LN_EPS)


def forward(weights: Weights, tokens: torch.Tensor, cache: list | None = None) -> torch.Tensor:
    """Logits [B, s, padded vocab] of tokens [B, s] that follow the positions held in `cache`.

    cache: a list (one entry per layer, filled here) of (keys, values) [B, heads, t, head_dim] of the
    t tokens before; None or [] for a sequence that starts with `tokens`.
    """
    w, spec = weights.tensors, weights.spec
    B, s = tokens.shape
    past = cache[0][0].shape[2] if cache else 0
    if past + s > spec.seq_len:
        raise TwinError(f"{past + s} tokens exceed the context of {spec.name} ({spec.seq_len} positions)")
    nh, hd = spec.heads, spec.head_dim
    x = w["wte"][tokens] + w["wpe"][past:past + s]
    # query i (position past+i) sees keys 0..past+i
    mask = None if s == 1 else torch.ones(s, past + s, dtype=torch.bool).tril(past)
    for i in range(spec.layers):
        b = f"blocks.{i}"
        q, k, v = (_ln(x, w, f"{b}.ln1") @ w[f"{b}.qkv"]).view(B, s, 3, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)
        if cache is not None:
            if len(cache) > i:
                k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
                cache[i] = (k, v)
            else:
                cache.append((k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, s, -1)
        x = x + a @ w[f"{b}.attn_out"]
        x = x + F.gelu(_ln(x, w, f"{b}.ln2") @ w[f"{b}.mlp_up"]) @ w[f"{b}.mlp_down"]
    return _ln(x, w, "lnf") @ w["wte"].t()


def generate(weights: Weights, prompt: torch.Tensor, new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, use_cache: bool = True) -> torch.Tensor:
    """Continue each prompt [B, p] (or [p]) by `new_tokens` tokens: [B, new_tokens] (or [new_tokens]).

    temperature 0: greedy (argmax); else sample from softmax(logits / temperature), restricted to the
    top_k most likely tokens when top_k > 0, with a generator seeded by `seed`. use_cache=False runs
    the whole sequence again for every token (the check of the cache).
    """
    if new_tokens < 0 or temperature < 0 or top_k < 0:
        raise TwinError("new tokens, temperature and top-k must be >= 0")
    single = prompt.dim() == 1
    ids = (prompt[None] if single else prompt).long()
    if ids.shape[1] < 1:
        raise TwinError("the prompt is empty: give at least one token")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weights.vocab):
        raise TwinError(f"prompt token ids must be in [0, {weights.vocab}) for {weights.spec.name}")
    if ids.shape[1] + new_tokens > weights.spec.seq_len:
        raise TwinError(f"a prompt of {ids.shape[1]} tokens plus {new_tokens} new ones exceeds the context "
                        f"of {weights.spec.name} ({weights.spec.seq_len} positions)")
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(ids.shape[0], new_tokens, dtype=torch.long)
    cache: list = []
    with torch.no_grad():
        nxt = ids
        seq = ids
        for t in range(new_tokens):
            if use_cache:
                logits = forward(weights, nxt, cache)[:, -1, :weights.vocab]
            else:
                logits = forward(weights, seq)[:, -1, :weights.vocab]
            tok = _pick(logits, temperature, top_k, gen)
            out[:, t] = tok
            nxt = tok[:, None]
            seq = torch.cat([seq, nxt], 1)
    return out[0] if single else out


def _pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]


# -- text <-> ids -------------------------------------------------------------------------------------
def encode(text: str, spec: ModelSpec) -> list[int]:
    """Token ids of `text` for a byte-level model (vocabulary 256): its UTF-8 bytes."""
    if spec.vocab != 256:
        raise TwinError(f"{spec.name} has a vocabulary of {spec.vocab}, not bytes: give --prompt-ids "
                        "(comma-separated token ids) instead of --prompt")
    return list(text.encode("utf-8"))


def decode(ids: list[int], spec: ModelSpec) -> str | None:
    """Text of ids for a byte-level model (invalid UTF-8 replaced); None for other vocabularies."""
    if spec.vocab != 256:
        return None
    return bytes(ids).decode("utf-8", errors="replace")
