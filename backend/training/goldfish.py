"""The goldfish loss (Hans et al., NeurIPS'24, arXiv 2406.10209): leave some tokens out of the loss so
that the model never learns to reproduce a training text verbatim.

A target token at position i is dropped when a hash of the `h` tokens before it, read as a number
u in [0, 1), falls below 1/k: about one token in k is dropped. The mask depends only on those h token
ids, so the same tokens are dropped for the same text every time: across epochs, duplicates, data
shards, ranks and grids, whatever the position of the text in a batch. Targets with fewer than h
tokens before them in the text are never dropped. The forward pass still runs on every token.

The mask is computed on the data side (numpy, CPU) from the token ids; dropped targets are set to
IGNORE, which the vocabulary-parallel loss leaves out on every rank of the grid.

Hash: a chain of the splitmix64 finalizer over the h ids, in unsigned 64-bit arithmetic (numpy uint64
wraps modulo 2^64 by definition), so any id below 2^63 (any vocabulary) hashes without overflow;
u is the top 53 bits of the hash times 2^-53 (exact in float64).
"""

from __future__ import annotations

import numpy as np

from topologies.common import TwinError

IGNORE = -100        # the loss's ignore index (backend.runtime.layers.IGNORE; any negative target is ignored)
DEFAULT_H = 13       # context width of the paper's experiments
_SEED = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def check(k: int, h: int) -> None:
    """Raise TwinError with one clear line unless k >= 1 and h >= 1 are integers."""
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise TwinError(f"--goldfish-k must be an integer >= 1 (one token in k is dropped), got {k!r}")
    if not isinstance(h, (int, np.integer)) or isinstance(h, bool) or h < 1:
        raise TwinError(f"--goldfish-h must be an integer >= 1 (tokens hashed per target), got {h!r}")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wraps modulo 2^64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def window_hash(tokens: np.ndarray, h: int) -> np.ndarray:
    """Hashes (uint64) of every window of h consecutive ids along the last axis: [..., n] -> [..., n-h+1].

    Entry j hashes tokens[..., j:j+h]."""
    ids = np.asarray(tokens)
    if ids.size and int(ids.min()) < 0:
        raise TwinError("goldfish: token ids must be >= 0")
    ids = ids.astype(np.uint64)
    n = ids.shape[-1] - h + 1
    acc = np.full(ids.shape[:-1] + (max(n, 0),), _SEED, dtype=np.uint64)
    if n <= 0:
        return acc
    with np.errstate(over="ignore"):
        for j in range(h):
            acc = _mix(acc ^ (ids[..., j:j + n] + _SEED))
    return acc


def drop_mask(tokens: np.ndarray, k: int, h: int = DEFAULT_H) -> np.ndarray:
    """Which tokens of a text the goldfish loss leaves out: [..., n] ids -> [..., n] bool.

    Token i is dropped when i >= h and u(hash of tokens[i-h:i]) < 1/k. k = 1 drops every token that
    has h tokens before it.
    """
    check(k, h)
    ids = np.asarray(tokens)
    mask = np.zeros(ids.shape, dtype=bool)
    if ids.shape[-1] <= h:
        return mask
    u = (window_hash(ids[..., :-1], h) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    mask[..., h:] = u < 1.0 / k
    return mask


def mask_rows(rows: np.ndarray, k: int, h: int = DEFAULT_H, context: int = 0) -> np.ndarray:
    """Targets of windows of a text with the goldfish mask applied.

    rows: [B, context + s + 1] token ids: `context` tokens that precede each window in the text
    (so that the mask of a target depends on the text, not on where the window starts), then the
    window's s+1 tokens. Returns targets [B, s] (int64): rows[:, context+1:] with dropped ones IGNORE.
    """
    rows = np.asarray(rows, dtype=np.int64)
    targets = rows[:, context + 1:].copy()
    targets[drop_mask(rows, k, h)[:, context + 1:]] = IGNORE
    return targets


def mask_targets(inputs: np.ndarray, targets: np.ndarray, k: int, h: int = DEFAULT_H) -> np.ndarray:
    """Goldfish-masked copy of targets [B, s] where targets[:, t] = text[t+1] and inputs[:, t] = text[t]
    (whole sequences: nothing precedes them)."""
    inputs, targets = np.asarray(inputs, dtype=np.int64), np.asarray(targets, dtype=np.int64)
    text = np.concatenate([inputs[:, :1], targets], axis=1)
    return mask_rows(text, k, h)
