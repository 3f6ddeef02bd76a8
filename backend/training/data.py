"""Training data: token files, byte files and synthetic tokens, sharded over z and data.

Sources (chosen by `open_source(spec, vocab, seed)`):
- `synthetic` (or `synthetic:<n_tokens>`): a seeded corpus with learnable bigram structure, so the loss
  falls; identical on every rank for a given seed.
- a path ending in `.bin`: nanoGPT-style token ids, little-endian uint16.
- any other path: the file's bytes, one token per byte (vocabulary 256).

Batches are a pure function of (seed, step): step t draws the global batch of B windows of seq_len+1
tokens at offsets from a generator seeded by (seed, t), so every rank computes the same offsets and a
resumed run continues exactly. The global batch is split by whole sequences over the z x data shards;
a rank with coordinates (z, d) reads shard z + G_z*d, i.e. sequences [shard*b, (shard+1)*b) with
b = B / (G_z*G_data). Ranks that differ only in x or y read the same sequences.

Goldfish loss (backend.training.goldfish; goldfish_k > 0): targets that the goldfish hash drops are IGNORE. The
loader reads the h tokens before each window too, so a target's fate depends only on the text before
it in the source, never on where a window starts, which rank reads it or which grid runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from topologies import caches
from topologies.common import TwinError

SYNTHETIC_TOKENS = 1 << 16  # default length of the synthetic corpus (tokens)
SUCCESSORS = 4              # each synthetic token is followed by one of this many tokens


class DataError(TwinError):
    """Bad data input (missing file, token id out of range, file too short)."""


class TokenSource:
    """A 1D array of token ids (numpy, possibly memory-mapped) with its origin."""

    def __init__(self, tokens: np.ndarray, name: str):
        self.tokens = tokens
        self.name = name

    def __len__(self) -> int:
        return len(self.tokens)


def synthetic_corpus(n_tokens: int, vocab: int, seed: int) -> np.ndarray:
    """A seeded token stream where each token has SUCCESSORS possible successors (a bigram chain).

    Its entropy is log(SUCCESSORS) nats per token, so a model's loss can fall from log(vocab) toward it.
    """
    rng = np.random.default_rng([seed, 0x5EED])
    succ = rng.integers(0, vocab, size=(vocab, SUCCESSORS))
    choice = rng.integers(0, SUCCESSORS, size=n_tokens)
    out = np.empty(n_tokens, dtype=np.int64)
    t = int(rng.integers(0, vocab))
    for i in range(n_tokens):  # 65k steps: a few ms
        out[i] = t
        t = int(succ[t, choice[i]])
    return out


# (path, size, mtime, vocab) of files already scanned in this process
_checked: set[tuple] = caches.register("backend.training.data.checked", set())


def open_source(spec: str, vocab: int, seed: int = 0) -> TokenSource:
    """Open a data source and check it against the model's vocabulary (raises DataError)."""
    if spec == "synthetic" or spec.startswith("synthetic:"):
        n = SYNTHETIC_TOKENS
        if ":" in spec:
            try:
                n = int(spec.split(":", 1)[1])
            except ValueError:
                raise DataError(f"data source {spec!r}: expected synthetic:<number of tokens>") from None
            if not 1 <= n <= 1 << 27:
                raise DataError(f"data source {spec!r}: the number of tokens must be in 1..{1 << 27}")
        return TokenSource(synthetic_corpus(n, vocab, seed), f"synthetic({n} tokens, seed {seed})")
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"data file {spec} does not exist (give a .bin of uint16 token ids, "
                        "any file to read as bytes, or 'synthetic')")
    if path.suffix == ".bin":
        if path.stat().st_size % 2:
            raise DataError(f"data file {spec}: size {path.stat().st_size} is odd, not uint16 token ids")
        tokens = np.memmap(path, dtype=np.uint16, mode="r") if path.stat().st_size else np.zeros(0, np.uint16)
        kind = "uint16 token ids"
    else:
        tokens = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
        kind = "bytes"
    key = (str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns, vocab)
    if len(tokens) and key not in _checked:
        top = int(tokens.max())
        if top >= vocab:
            pos = int(np.argmax(np.asarray(tokens) >= vocab))
            raise DataError(f"data file {spec}: token id {top} (first out-of-range id at position {pos}) "
                            f"is >= the model's vocabulary {vocab}")
        _checked.add(key)
    return TokenSource(tokens, f"{path} ({kind})")


@dataclass
class Batch:
    """One micro-batch of one rank: inputs and targets of shape (sequences, seq_len), int64."""

    inputs: torch.Tensor
    targets: torch.Tensor


class StepLoader:
    """What the loaders share: the position is just the next step (`state_dict`/`load_state_dict`
    save and restore it), `next()` returns that step's micro-batches and advances, and a rank's
    rows split into `micro_batches` equal micro-batches. A subclass sets global_batch, seq_len,
    micro_batches, seed and step, and defines `batches(step, device)` and `source_name`."""

    global_batch: int
    seq_len: int
    micro_batches: int
    seed: int
    step: int

    @property
    def source_name(self) -> str:
        raise NotImplementedError

    def batches(self, step: int, device: torch.device | str = "cpu") -> list[Batch]:
        raise NotImplementedError

    def split(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[Batch]:
        """A rank's rows (sequences, seq_len) as its micro-batches."""
        per = inputs.shape[0] // self.micro_batches
        return [Batch(inputs[j * per:(j + 1) * per].contiguous(), targets[j * per:(j + 1) * per].contiguous())
                for j in range(self.micro_batches)]

    def next(self, device: torch.device | str = "cpu") -> list[Batch]:
        """The micro-batches of the current step; advances the position."""
        out = self.batches(self.step, device)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "source": self.source_name,
                "global_batch": self.global_batch, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "global_batch", "seq_len"):
            if state[key] != getattr(self, key):
                raise DataError(f"data position was saved with {key}={state[key]}, this run has "
                                f"{getattr(self, key)}")
        self.step = int(state["step"])


class ShardedLoader(StepLoader):
    """Deterministic, resumable batches for one rank.

    global_batch: sequences per step over all ranks; seq_len: tokens per sequence;
    shard, shards: this rank's shard index z + G_z*d and the shard count G_z*G_data.
    The position is just the next step; `state_dict`/`load_state_dict` save and restore it.
    """

    def __init__(self, source: TokenSource, global_batch: int, seq_len: int, shard: int, shards: int,
                 micro_batches: int = 1, seed: int = 0, goldfish_k: int = 0, goldfish_h: int = 13):
        if global_batch % shards or (global_batch // shards) % micro_batches:
            raise DataError(f"global batch {global_batch} does not split into {shards} shards "
                            f"of {micro_batches} micro-batches")
        if len(source) < seq_len + 2:
            raise DataError(f"data source {source.name} has {len(source)} tokens, fewer than one "
                            f"sequence of {seq_len}+1")
        self.source, self.global_batch, self.seq_len = source, global_batch, seq_len
        self.shard, self.shards, self.micro_batches, self.seed = shard, shards, micro_batches, seed
        self.goldfish_k, self.goldfish_h = goldfish_k, goldfish_h  # goldfish loss (k = 0: off)
        self.step = 0

    @property
    def local_batch(self) -> int:
        """Sequences this rank reads per step."""
        return self.global_batch // self.shards

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the global batch of `step` (tokens), the same on every rank."""
        rng = np.random.default_rng([self.seed, step, 0xDA7A])
        return rng.integers(0, len(self.source) - self.seq_len - 1, size=self.global_batch)

    def batches(self, step: int, device: torch.device | str = "cpu") -> list[Batch]:
        """The micro-batches of this rank at `step` (a pure function of step)."""
        b = self.local_batch
        mine = self.offsets(step)[self.shard * b:(self.shard + 1) * b]
        s = self.seq_len
        rows = np.stack([np.asarray(self.source.tokens[o:o + s + 1], dtype=np.int64) for o in mine])
        targets = rows[:, 1:]
        if self.goldfish_k:  # the mask of a target depends on the h tokens before it in the source
            from backend.training.goldfish import mask_rows
            h = self.goldfish_h
            targets = np.stack([mask_rows(np.asarray(self.source.tokens[o - min(h, o):o + s + 1])[None],
                                          self.goldfish_k, h, context=min(h, o))[0] for o in mine])
        import torch  # here, so that checking a data file does not import torch
        return self.split(torch.from_numpy(rows[:, :-1]).to(device), torch.from_numpy(targets).to(device))

    @property
    def source_name(self) -> str:
        return self.source.name
