"""Mixture-of-experts fields of a model spec (twin/program/model.py): their checks and counts.

An MoE block replaces the MLP of layer i when (i + 1) % moe_every == 0: a router (linear h -> E, no
bias; softmax over the E experts in fp32; the top_k largest kept and renormalised over the k, as
Mixtral does), E experts each the model's own MLP (Llama: SwiGLU h -> 2 ffn_size fused, ffn_size -> h;
GPT: GELU h -> ffn, ffn -> h), and the load-balancing loss router_aux_coef * E * sum_i f_i P_i (f_i the
fraction of the tokens that chose expert i among their top_k, so sum_i f_i = top_k, as in Mixtral's Hugging Face code; P_i the mean router probability of expert i over the tokens; Switch
Transformer, Fedus et al. 2022, eq. 4; Mixtral's Hugging Face implementation) averaged over MoE layers.

Counts per MoE block (h hidden, f the MLP width, E experts, k top_k):
- parameters: attention and norms as a dense block, router h E, experts E * mlp (mlp = 3 h f for
  SwiGLU, 2 h f for GELU); active: router h E + k * mlp.
- forward flops per token of its linears: 2 (attention linears + h E + k mlp).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from topologies.common import TwinError

if TYPE_CHECKING:
    from twin.program.model import ModelSpec


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_moe(m: "ModelSpec") -> None:
    """Raise TwinError (one line) when the model's MoE fields do not make a model."""
    who = f"model {m.name!r}"
    for f in ("experts", "top_k"):
        v = getattr(m, f)
        if not _int(v) or v < 0:
            raise TwinError(f"{who}: {f} must be a non-negative integer, got {v!r}")
    if not _int(m.moe_every) or m.moe_every < 1:
        raise TwinError(f"{who}: moe_every must be a positive integer, got {m.moe_every!r}")
    for f in ("capacity_factor", "router_aux_coef"):
        v = getattr(m, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise TwinError(f"{who}: {f} must be a finite number >= 0 (capacity_factor 0: dropless), got {v!r}")
    if m.experts == 0:
        if m.top_k:
            raise TwinError(f"{who}: top_k {m.top_k} is set but experts is 0 (set experts, or leave top_k out)")
        return
    if not 1 <= m.top_k <= m.experts:
        raise TwinError(f"{who}: top_k {m.top_k} must be between 1 and the {m.experts} experts")
    if m.moe_every > m.layers:
        raise TwinError(f"{who}: moe_every {m.moe_every} is more than the {m.layers} layers (no layer would be MoE)")


def mlp_params(m: "ModelSpec") -> int:
    """Parameters of one MLP (one expert): SwiGLU 3 h f, GELU 2 h f."""
    return (3 if m.is_llama else 2) * m.hidden * m.ffn


def moe_block_extra(m: "ModelSpec", active: bool) -> int:
    """Parameters an MoE block has beyond a dense block's (router h E, and E - 1 more MLPs; with
    `active`, top_k - 1 more)."""
    n = m.top_k if active else m.experts
    return m.hidden * m.experts + (n - 1) * mlp_params(m)


def check_imbalance(m: "ModelSpec", f: float) -> None:
    """Raise TwinError (one line) unless `f` is a routing imbalance the model can have: 1 (balanced)
    up to experts / top_k (every token chooses the busiest expert); 1 for a dense model."""
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f):
        raise TwinError(f"--moe-imbalance must be a finite number, got {f!r}")
    if not m.is_moe:
        if f != 1:
            raise TwinError(f"--moe-imbalance {f:g} is for mixture-of-experts models; {m.name} has no experts")
        return
    top = m.experts / m.top_k
    if not 1 <= f <= top:
        raise TwinError(f"--moe-imbalance {f:g} must be between 1 (balanced) and {top:g} (experts / top_k: every "
                        f"token of {m.name} routed to the busiest expert)")


def stretch(m: "ModelSpec", local: int, f: float) -> float:
    """Rows the rank of the busiest expert receives, over balanced, when that expert takes f times its
    balanced share and the other experts share the rest evenly: (f + (n - 1)(E - f)/(E - 1)) / n with
    n = local experts per rank (1 with E_p = E: f; E_p = 1: 1, the rank holds every expert). With a
    capacity factor the buffers are padded to capacity: 1."""
    E = m.experts
    if f == 1 or m.capacity_factor > 0 or E == 1:
        return 1.0
    return (f + (local - 1) * (E - f) / (E - 1)) / local


def capacity(m: "ModelSpec", tokens: int) -> int:
    """Rows an expert takes from one rank's `tokens` tokens (capacity_factor > 0):
    ceil(capacity_factor * tokens * top_k / experts)."""
    return math.ceil(m.capacity_factor * tokens * m.top_k / m.experts)


def routed_rows(m: "ModelSpec", tokens: int) -> int:
    """Rows a rank sends in a dispatch for `tokens` tokens, and receives into its experts, when
    routing is balanced: tokens * top_k dropless, experts * capacity with a capacity (the buffers
    padded to capacity)."""
    if m.capacity_factor > 0:
        return m.experts * capacity(m, tokens)
    return tokens * m.top_k


def forward_flops_per_token(m: "ModelSpec", active: bool = True, seq_len: int | None = None) -> float:
    """Forward flops of one token (flop): 2 x the linear parameters it runs through (every expert's
    with active=False, as if each token went to all of them), attention 4 s h per layer, the head 2 h V."""
    s = m.seq_len if seq_len is None else seq_len
    linear = m.layers * sum(k * n for _, k, n, _ in m.linear_shapes())
    if m.is_moe:
        linear += m.moe_layers * moe_block_extra(m, active)
    return 2.0 * linear + m.layers * 4.0 * s * m.hidden + 2.0 * m.hidden * m.padded_vocab()


def local_experts(model, grid) -> int:
    """Experts of an MoE block on one rank: E / E_p."""
    return model.experts // grid.expert


def moe_local_params(model, grid, layers) -> int:
    """Parameters a rank holds in the MoE blocks of `layers` beyond what their dense MLPs would be:
    its E/E_p experts less one MLP, over G_x G_y G_z; the routers over G_x."""
    moe = sum(1 for i in layers if model.moe_layer(i))
    if not moe:
        return 0
    extra = (local_experts(model, grid) - 1) * mlp_params(model) // grid.tensor_size
    return moe * (extra + model.hidden * model.experts // grid.x)


def router_params(model, grid, layers) -> int:
    """Router parameters one rank holds for `layers` (h/G_x x E each)."""
    return sum(1 for i in layers if model.moe_layer(i)) * model.hidden * model.experts // grid.x
