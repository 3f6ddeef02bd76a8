"""Mixture-of-experts routing on one rank: the math that the single-process references
(backend.models.moe) and the executor's MoE kernels share, so both compute the same numbers.

Router: softmax over the E experts in fp32, the top_k experts of each token, their probabilities
renormalised over the k chosen (Mixtral's rule). Capacity (capacity_factor c > 0): each expert takes
at most ceil(c * T * top_k / E) of the T tokens of a group, first come first served by position; c = 0
is dropless. Load-balancing loss of a micro-batch (Mixtral's form, as transformers computes it):
E * sum_i f_i P_i, f_i the fraction of the T tokens whose top-k include expert i (counted before any
drop; no gradient), P_i the mean router probability of expert i over the T tokens. Balanced routing
gives top_k. T is the micro-batch's tokens over all ranks: a rank adds its own tokens' share of P
(the loss is linear in P given the global counts).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# -- the spec's MoE fields (read with defaults: a spec without them is dense) ----------------------
def experts_of(spec) -> int:
    return int(getattr(spec, "experts", 0) or 0)


def is_moe(spec) -> bool:
    return experts_of(spec) > 0


def moe_layer(spec, i: int) -> bool:
    """Whether block i (0-based) has an MoE block in place of its MLP: (i + 1) % moe_every == 0."""
    return is_moe(spec) and (i + 1) % max(int(getattr(spec, "moe_every", 1) or 1), 1) == 0


def moe_layers(spec) -> list[int]:
    return [i for i in range(spec.layers) if moe_layer(spec, i)]


def top_k_of(spec) -> int:
    return int(getattr(spec, "top_k", 0) or 0)


def capacity_factor_of(spec) -> float:
    return float(getattr(spec, "capacity_factor", 0.0) or 0.0)


def aux_coef_of(spec) -> float:
    return float(getattr(spec, "router_aux_coef", 0.01))


def check_moe(spec, expert_parallel: int = 1) -> None:
    """Raise ValueError (one line) for MoE fields the backend cannot run."""
    e, k, c = experts_of(spec), top_k_of(spec), capacity_factor_of(spec)
    if e <= 0:
        return
    if not 1 <= k <= e:
        raise ValueError(f"model {spec.name!r}: top_k {k} must be in 1..{e} (the experts)")
    if c < 0 or not math.isfinite(c):
        raise ValueError(f"model {spec.name!r}: capacity_factor {c} must be > 0 (or 0 for dropless routing)")
    if e % expert_parallel:
        raise ValueError(f"model {spec.name!r}: {e} experts are not divisible by E_p={expert_parallel}: "
                         f"use an E_p that divides {e}")


# -- routing ---------------------------------------------------------------------------------------
def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (probabilities [T, E] fp32, chosen experts [T, k], their weights [T, k]
    fp32, renormalised over the k chosen)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.topk(probs, top_k, dim=-1)
    return probs, idx, top / top.sum(-1, keepdim=True)


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int | None:
    """Most tokens an expert takes from a group of `tokens` tokens: ceil(factor * tokens * top_k /
    experts); None when dropless (factor 0)."""
    if factor <= 0:
        return None
    return math.ceil(factor * tokens * top_k / experts)


def keep_mask(idx: torch.Tensor, experts: int, cap: int | None) -> torch.Tensor:
    """[T, k] bool: which choices an expert takes, first come first served by token position (a
    token never picks one expert twice, so the order among a token's own choices does not matter)."""
    if cap is None:
        return torch.ones_like(idx, dtype=torch.bool)
    onehot = F.one_hot(idx, experts)                      # [T, k, E]
    seen = onehot.sum(1).cumsum(0) - onehot.sum(1)        # [T, E] choices of each expert before token t
    before = seen.gather(1, idx)                          # [T, k]
    return before < cap


def expert_counts(idx: torch.Tensor, experts: int) -> torch.Tensor:
    """How many tokens chose each expert ([E], fp32: what the counts' all-reduces sum)."""
    return torch.bincount(idx.reshape(-1), minlength=experts).float()


def aux_loss(probs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The load-balancing loss of one group of T tokens alone: E * sum_i f_i * P_i (fp32 scalar;
    gradient through P)."""
    T, experts = probs.shape
    return experts * (expert_counts(idx, experts) / T * probs.mean(0)).sum()


def aux_grad(probs: torch.Tensor, counts: torch.Tensor, tokens: int, scale: float) -> torch.Tensor:
    """d(scale * E * sum_i f_i P_i)/d(router logits) of this rank's tokens [t, E] fp32, where f_i =
    counts_i / tokens and P_i sums over `tokens` tokens (these t and the other ranks'): through the
    softmax of dP_i/dp_ti = 1/tokens."""
    experts = probs.shape[-1]
    dp = (scale * experts / tokens ** 2) * counts.float()[None, :].expand(probs.shape[0], -1)
    return probs * (dp - (dp * probs).sum(-1, keepdim=True))


def combine_grad_weights(dy: torch.Tensor, expert_out: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(weight) of one choice: <dy of its token, the expert's output> (fp32)."""
    return (dy.float() * expert_out.float()).sum(-1)


def weights_grad_to_logits(probs: torch.Tensor, idx: torch.Tensor, dweights: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(router logits) [T, E] from d(loss)/d(renormalised weights) [T, k] (fp32)."""
    with torch.enable_grad():
        logits = torch.log(probs.detach()).requires_grad_(True)  # softmax(log p) = p: the same Jacobian
        p = torch.softmax(logits, -1)
        top = p.gather(1, idx)
        w = top / top.sum(-1, keepdim=True)
        (g,) = torch.autograd.grad(w, logits, dweights.float())
    return g
