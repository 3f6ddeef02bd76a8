"""Measuring what a model memorized: prompt with a training sequence's prefix, decode greedily, and
score the continuation against the true one (Carlini et al.'s extraction test, as the goldfish paper
uses it).

Per sequence: exact match (every one of the S decoded tokens equals the true suffix) and ROUGE-L
(the F1 of the longest common subsequence of the decoded and the true suffix, over tokens). Overall:
the exact-match rate and the mean ROUGE-L.

Sequence files (`load_sequences`): a `.npy` array of token ids [N, L]; a `.bin` of uint16 token ids
or any other file (its bytes), cut into consecutive sequences of `seq_len` tokens (a last partial one
is left out).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from topologies.common import TwinError


def lcs_length(a, b) -> int:
    """Length of the longest common subsequence of two sequences (dynamic programming, O(len a * len b))."""
    a, b = list(a), list(b)
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate, reference) -> float:
    """ROUGE-L F1 (Lin, 2004, with beta = 1) of two token sequences: 2PR/(P+R) with P = LCS/len(candidate),
    R = LCS/len(reference); 0 when either is empty or nothing is shared."""
    lcs = lcs_length(candidate, reference)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(candidate), lcs / len(reference)
    return 2 * p * r / (p + r)


@dataclass
class SequenceScore:
    index: int
    exact: bool
    rouge_l: float
    matched_prefix: int  # decoded tokens equal to the truth before the first mismatch


@dataclass
class MemorizationReport:
    """What a model reproduces of its training sequences: per sequence and overall."""

    prefix: int
    suffix: int
    sequences: list[SequenceScore] = field(default_factory=list)

    @property
    def exact_match(self) -> float:
        """Fraction of sequences whose whole suffix was reproduced."""
        return sum(s.exact for s in self.sequences) / max(len(self.sequences), 1)

    @property
    def rouge_l(self) -> float:
        """Mean ROUGE-L over the sequences."""
        return sum(s.rouge_l for s in self.sequences) / max(len(self.sequences), 1)

    def summary(self) -> dict:
        return {"sequences": len(self.sequences), "prefix": self.prefix, "suffix": self.suffix,
                "exact_match": self.exact_match, "rouge_l": self.rouge_l}

    def to_dict(self) -> dict:
        return {**self.summary(), "per_sequence": [asdict(s) for s in self.sequences]}

    def table(self, limit: int = 20) -> str:
        """A plain-text table: the first `limit` sequences, then the overall figures."""
        lines = [f"{'seq':>5}  {'exact':>5}  {'rouge-l':>7}  {'matched':>7}"]
        for s in self.sequences[:limit]:
            lines.append(f"{s.index:>5}  {'yes' if s.exact else 'no':>5}  {s.rouge_l:>7.3f}  "
                         f"{s.matched_prefix:>4}/{self.suffix}")
        if len(self.sequences) > limit:
            lines.append(f"  ... {len(self.sequences) - limit} more")
        lines.append(f"overall: {len(self.sequences)} sequences, prefix {self.prefix}, suffix {self.suffix}: "
                     f"exact match {100 * self.exact_match:.1f}%, ROUGE-L {self.rouge_l:.3f}")
        return "\n".join(lines)


def check_lengths(length: int, prefix: int, suffix: int | None) -> int:
    """The suffix length to decode (default: the rest of the sequence); raises TwinError on bad lengths."""
    if prefix < 1:
        raise TwinError(f"--prefix must be >= 1 token, got {prefix}")
    if prefix >= length:
        raise TwinError(f"--prefix {prefix} is not shorter than the sequences ({length} tokens): "
                        "leave at least one token to decode")
    suffix = length - prefix if suffix is None else suffix
    if suffix < 1 or prefix + suffix > length:
        raise TwinError(f"--suffix must be between 1 and {length - prefix} (sequences of {length} tokens "
                        f"with a prefix of {prefix}), got {suffix}")
    return suffix


def score(decoded: np.ndarray, truth: np.ndarray, prefix: int, first_index: int = 0) -> MemorizationReport:
    """Score decoded suffixes [N, S] against the true ones [N, S]."""
    rep = MemorizationReport(prefix, truth.shape[1])
    for i, (d, t) in enumerate(zip(decoded.tolist(), truth.tolist())):
        match = next((j for j, (a, b) in enumerate(zip(d, t)) if a != b), len(t))
        rep.sequences.append(SequenceScore(first_index + i, d == t, rouge_l(d, t), match))
    return rep


def measure(weights, sequences: np.ndarray, prefix: int, suffix: int | None = None,
            batch: int = 64) -> MemorizationReport:
    """Prompt with each sequence's first `prefix` tokens, decode `suffix` tokens greedily, score.

    weights: backend.models.generate.Weights; sequences: [N, L] token ids.
    """
    import torch

    from backend.models.generate import generate

    seqs = np.asarray(sequences, dtype=np.int64)
    if seqs.ndim != 2 or len(seqs) == 0:
        raise TwinError("memorization needs a non-empty set of sequences [N, L]")
    suffix = check_lengths(seqs.shape[1], prefix, suffix)
    if prefix + suffix > weights.spec.seq_len:
        raise TwinError(f"--prefix {prefix} + --suffix {suffix} exceeds the context of {weights.spec.name} "
                        f"({weights.spec.seq_len} positions)")
    truth = seqs[:, prefix:prefix + suffix]
    decoded = np.concatenate([
        generate(weights, torch.from_numpy(seqs[i:i + batch, :prefix]), suffix).numpy()
        for i in range(0, len(seqs), batch)])
    return score(decoded, truth, prefix)


def load_sequences(path: str | Path, seq_len: int, vocab: int) -> np.ndarray:
    """Sequences [N, L] from a file (see the module docstring); raises TwinError on bad input."""
    p = Path(path)
    if not p.is_file():
        raise TwinError(f"sequence file {path} does not exist (give a .npy of token ids [N, L], a .bin of "
                        "uint16 ids or any file read as bytes)")
    if p.suffix == ".npy":
        try:
            seqs = np.load(p, allow_pickle=False)
        except ValueError as e:
            raise TwinError(f"sequence file {path}: not a numpy array of token ids ({e})") from None
        if seqs.ndim != 2 or not np.issubdtype(seqs.dtype, np.integer):
            raise TwinError(f"sequence file {path}: expected a 2-D integer array [N, L], got "
                            f"{seqs.dtype} of shape {seqs.shape}")
    else:
        raw = np.fromfile(p, dtype=np.uint16 if p.suffix == ".bin" else np.uint8)
        if seq_len < 2:
            raise TwinError(f"--seq-len must be >= 2, got {seq_len}")
        n = len(raw) // seq_len
        if n == 0:
            raise TwinError(f"sequence file {path} holds {len(raw)} tokens, fewer than one sequence of {seq_len}")
        seqs = raw[:n * seq_len].reshape(n, seq_len)
    seqs = seqs.astype(np.int64)
    if seqs.size and (seqs.min() < 0 or seqs.max() >= vocab):
        raise TwinError(f"sequence file {path}: token ids must be in [0, {vocab}), found {seqs.min()}..{seqs.max()}")
    if len(seqs) == 0:
        raise TwinError(f"sequence file {path} holds no sequences")
    return seqs
