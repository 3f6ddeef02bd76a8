"""Model specs (GPT and Llama decoders): loaded from TOML data files, with parameter and flop counts.

`arch` says which decoder a spec describes:
- "gpt" (the default): learned token and position embeddings, `layers` blocks of (layer norm,
  attention, layer norm, GELU MLP of width ffn_mult*hidden), a final layer norm and a head tied to
  the token embedding. Linear layers carry no bias (the 4D layer is bias-free); layer norms do.
- "llama" (Llama 2/3): token embedding only (rotary position embeddings, base `rope_theta`, optional
  "llama3" frequency scaling), `layers` pre-norm blocks of (RMSNorm, grouped-query attention with
  `kv_heads` key/value heads, RMSNorm, SwiGLU MLP with gate and up h -> ffn_size and down ffn_size ->
  h), a final RMSNorm and an untied output head. No biases; RMSNorm has a weight only (eps `norm_eps`).

The linear layers of a block, as the 4D algorithm splits them (`linear_shapes`): qkv (h -> q, k and v
heads; normal), attn_out (h -> h; transposed), mlp_up (h -> ffn, or for Llama gate and up fused into
one h -> 2*ffn GEMM; normal), mlp_down (ffn -> h; transposed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from topologies.datafile import read_spec, shipped
from topologies.common import TwinError
from topologies.schema import MODEL, check

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


@dataclass(frozen=True)
class ModelSpec:
    """One decoder model. Sizes are counts (layers, features, heads, tokens), not bytes."""

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
    arch: str = "gpt"         # "gpt" or "llama"
    kv_heads: int = 0         # llama: key/value heads (grouped-query attention); 0: as many as heads
    ffn_size: int = 0         # llama: SwiGLU intermediate size (gate and up h -> ffn_size); 0: ffn_mult*hidden
    rope_theta: float = 10000.0  # llama: base of the rotary frequencies
    norm_eps: float = 1e-5    # llama: RMSNorm epsilon
    rope_scaling: float = 0.0  # llama 3.1: "llama3" frequency scaling factor (0: none)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    # mixture of experts (twin/program/moe.py, docs/moe.md); experts = 0: a dense model
    experts: int = 0          # experts per MoE layer (E)
    top_k: int = 0            # experts per token, 1..experts when experts > 0
    moe_every: int = 1        # layer i has an MoE block in place of its MLP iff (i + 1) % moe_every == 0
    capacity_factor: float = 0.0  # 0: dropless; > 0: an expert takes at most ceil(cf * tokens * top_k / E) of a rank's tokens
    router_aux_coef: float = 0.01  # load-balancing loss E * sum_i f_i P_i, times this, added to the LM loss

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "vocab", "seq_len", "global_batch", "ffn_mult"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise TwinError(f"model {self.name!r}: {f} must be a positive integer, got {getattr(self, f)!r}")
        self._check_moe()
        if self.arch not in ("gpt", "llama"):
            raise TwinError(f"model {self.name!r}: arch must be \"gpt\" or \"llama\", got {self.arch!r}")
        if self.hidden % self.heads:
            raise TwinError(f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.arch == "gpt":
            if self.tied_embeddings is not True:
                raise TwinError(f"model {self.name!r}: a GPT has a tied head (set tied_embeddings = true)")
            if self.kv_heads not in (0, self.heads) or self.ffn_size:
                raise TwinError(f"model {self.name!r}: kv_heads and ffn_size are Llama fields (set arch = \"llama\")")
            return
        if self.tied_embeddings is not False:
            raise TwinError(f"model {self.name!r}: a Llama has an untied head (set tied_embeddings = false)")
        if self.heads % self.n_kv_heads:
            raise TwinError(f"model {self.name!r}: {self.heads} heads are not divisible by kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise TwinError(f"model {self.name!r}: rotary embeddings need an even head dimension, got {self.head_dim}")

    def _check_moe(self) -> None:
        """The mixture-of-experts fields, each checked with one line (TwinError)."""
        from twin.program.moe_spec import check_moe
        check_moe(self)

    @property
    def is_moe(self) -> bool:
        """Whether some layers have a mixture-of-experts block in place of their MLP."""
        return self.experts > 0

    def moe_layer(self, i: int) -> bool:
        """Whether block i (0-based) has an MoE block in place of its MLP."""
        return self.experts > 0 and (i + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        """How many blocks have an MoE block."""
        return self.layers // self.moe_every if self.experts > 0 else 0

    @property
    def total_params(self) -> int:
        """Every parameter (all experts), on the model's own vocabulary (not padded)."""
        return self.parameters(vocab=self.vocab)

    @property
    def active_params(self) -> int:
        """The parameters one token uses (top_k experts of each MoE layer, and the router), own vocabulary."""
        return self.parameters(vocab=self.vocab, active=True)

    @property
    def is_llama(self) -> bool:
        return self.arch == "llama"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads (grouped-query attention; a GPT has as many as query heads)."""
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        """Width of the MLP (Llama: the SwiGLU intermediate size, the output width of gate and of up)."""
        return self.ffn_size or self.ffn_mult * self.hidden

    @property
    def qkv_width(self) -> int:
        """Output features of the qkv layer: q heads plus k and v heads, times the head dimension."""
        return (self.heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def norm_params_per_layer(self) -> int:
        """Norm parameters of one block (two layer norms of weight and bias; two RMSNorm weights)."""
        return (2 if self.is_llama else 4) * self.hidden

    @property
    def final_norm_params(self) -> int:
        return (1 if self.is_llama else 2) * self.hidden

    @property
    def position_rows(self) -> int:
        """Rows of the learned position table (a Llama has none: rotary embeddings)."""
        return 0 if self.is_llama else self.seq_len

    def padded_vocab(self, multiple: int = 128) -> int:
        """Vocabulary rounded up to a multiple of `multiple` (and of 128), as Megatron pads it."""
        m = math.lcm(128, multiple)
        return -(-self.vocab // m) * m

    def linear_shapes(self) -> list[tuple[str, int, int, bool]]:
        """The four linear layers of a block: (name, k, n, transposed) with W of shape k x n
        (a Llama's mlp_up is gate and up fused: h x 2*ffn)."""
        h, f = self.hidden, self.ffn
        if self.is_llama:
            return [("qkv", h, self.qkv_width, False), ("attn_out", h, h, True),
                    ("mlp_up", h, 2 * f, False), ("mlp_down", f, h, True)]
        return [("qkv", h, 3 * h, False), ("attn_out", h, h, True),
                ("mlp_up", h, f, False), ("mlp_down", f, h, True)]

    def parameters(self, vocab: int | None = None, active: bool = False) -> int:
        """Exact parameter count (vocab defaults to the padded vocabulary); with MoE, every expert, or
        with `active` the top_k experts a token uses (the router counts in both)."""
        v = self.padded_vocab() if vocab is None else vocab
        h = self.hidden
        block = sum(k * n for _, k, n, _ in self.linear_shapes()) + self.norm_params_per_layer
        blocks = self.layers * block
        if self.is_moe:  # the MoE blocks' extra: router h x E, and E (or top_k) MLPs in place of one
            from twin.program.moe_spec import moe_block_extra
            blocks += self.moe_layers * moe_block_extra(self, active)
        if self.is_llama:  # embedding and untied head, final RMSNorm
            return blocks + 2 * v * h + self.final_norm_params
        return blocks + v * h + self.seq_len * h + 2 * h

    def reference_flops(self, batch: int | None = None, seq_len: int | None = None,
                        vocab: int | None = None, recompute: bool = True) -> float:
        """Flops of one iteration by Narayanan et al. (SC'21), in flop.

        96*B*s*l*h^2*(1 + s/(6h) + V/(16 l h)) with recomputation; without it the layer term
        has 72 instead of 96 (forward once, backward twice). V is the padded vocabulary.
        A Llama: the same count with its own matrices (Narayanan's 24 h^2 is 2 flops x the 12 h^2
        parameters of a GPT block's linears; a Llama block has h(h + 2 kv d) + h^2 + 3 h f, GQA's
        smaller k and v and the third MLP matrix), attention 4 s h per token and pass as in a GPT
        (every query head attends), and the untied head 6 B s h V.
        """
        b = self.global_batch if batch is None else batch
        s = self.seq_len if seq_len is None else seq_len
        v = self.padded_vocab() if vocab is None else vocab
        l, h = self.layers, self.hidden
        passes = 4 if recompute else 3  # forward (+ recomputed forward) + backward (2x)
        if self.is_moe:  # the linears a token runs through: the router and top_k experts in MoE blocks
            from twin.program.moe_spec import moe_block_extra
            linear = l * sum(k * n for _, k, n, _ in self.linear_shapes()) + self.moe_layers * moe_block_extra(self, True)
            return passes * b * s * (2 * linear + l * 4 * s * h) + 6 * b * s * h * v
        if self.is_llama:
            linear = sum(k * n for _, k, n, _ in self.linear_shapes())
            return passes * b * s * l * (2 * linear + 4 * s * h) + 6 * b * s * h * v
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
