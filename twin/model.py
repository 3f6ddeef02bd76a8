"""GPT model specs: loaded from TOML data files, with parameter and flop counts.

A model is a GPT-style decoder: learned token and position embeddings, `layers` blocks of
(layer norm, attention, layer norm, GELU MLP of width ffn_mult*hidden), a final layer norm and a head
tied to the token embedding. Linear layers carry no bias (the 4D layer is bias-free); layer norms do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from topologies.datafile import read_spec, shipped
from twin.common import TwinError
from twin.schema import MODEL, check

MODELS_DIR = Path(__file__).parent / "models"


@dataclass(frozen=True)
class ModelSpec:
    """One GPT model. Sizes are counts (layers, features, heads, tokens), not bytes."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    global_batch: int  # default global batch, in sequences
    ffn_mult: int = 4
    tied_embeddings: bool = True
    min_tensor_parallel: int = 1  # informational: smallest x*y*z the source reports as fitting

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "vocab", "seq_len", "global_batch", "ffn_mult"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise TwinError(f"model {self.name!r}: {f} must be a positive integer, got {getattr(self, f)!r}")
        if self.hidden % self.heads:
            raise TwinError(f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.tied_embeddings is not True:
            raise TwinError(f"model {self.name!r}: only tied embeddings are supported (set tied_embeddings = true)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_mult * self.hidden

    def padded_vocab(self, multiple: int = 128) -> int:
        """Vocabulary rounded up to a multiple of `multiple` (and of 128), as Megatron pads it."""
        m = math.lcm(128, multiple)
        return -(-self.vocab // m) * m

    def linear_shapes(self) -> list[tuple[str, int, int, bool]]:
        """The four linear layers of a block: (name, k, n, transposed) with W of shape k x n."""
        h, f = self.hidden, self.ffn
        return [("qkv", h, 3 * h, False), ("attn_out", h, h, True),
                ("mlp_up", h, f, False), ("mlp_down", f, h, True)]

    def parameters(self, vocab: int | None = None) -> int:
        """Exact parameter count (vocab defaults to the padded vocabulary)."""
        v = self.padded_vocab() if vocab is None else vocab
        h = self.hidden
        block = sum(k * n for _, k, n, _ in self.linear_shapes()) + 4 * h  # two layer norms
        return self.layers * block + v * h + self.seq_len * h + 2 * h

    def reference_flops(self, batch: int | None = None, seq_len: int | None = None,
                        vocab: int | None = None, recompute: bool = True) -> float:
        """Flops of one iteration by Narayanan et al. (SC'21), in flop.

        96*B*s*l*h^2*(1 + s/(6h) + V/(16 l h)) with recomputation; without it the layer term
        has 72 instead of 96 (forward once, backward twice). V is the padded vocabulary.
        """
        b = self.global_batch if batch is None else batch
        s = self.seq_len if seq_len is None else seq_len
        v = self.padded_vocab() if vocab is None else vocab
        l, h = self.layers, self.hidden
        passes = 4 if recompute else 3  # forward (+ recomputed forward) + backward (2x)
        layer = passes * 24 * b * s * l * h * h * (1 + s / (6 * h))
        head = 6 * b * s * h * v
        return layer + head


def list_models() -> list[str]:
    """Names of the models that ship with the twin."""
    return shipped(MODELS_DIR)


def load_model(name_or_path: str) -> ModelSpec:
    """Load a model by name (a shipped spec) or from a TOML file path."""
    path, data = read_spec(name_or_path, MODELS_DIR, "model")
    check(data, MODEL, path, "model")
    data.setdefault("name", path.stem)
    try:
        return ModelSpec(**data)
    except TwinError as e:  # what relates keys to each other (heads divide hidden): name the file too
        raise TwinError(f"model file {path}: {e}") from None
