"""Mixture of experts in PyTorch: the routing math (shared by the single-process references and the
executor's kernels) and the reference MoE blocks that replace a block's MLP.

A MoE block (the fields are ModelSpec's, pinned in docs/moe-backend.md):
- router: a linear layer hidden -> E (no bias); softmax over the E experts in fp32; the top_k experts
  of each token; their probabilities renormalised to sum to one over the k chosen (Mixtral's rule);
- E experts, each the model's own MLP: SwiGLU down(silu(gate x) * up x) of width ffn_size for
  arch "llama", GELU mlp_down(gelu(x mlp_up)) of width ffn_mult*hidden for arch "gpt";
- the output of a token is sum over its kept choices of weight * expert(x);
- capacity: with capacity_factor c > 0 each expert takes at most ceil(c * T * top_k / E) of the T
  tokens of a group (a rank's micro-batch), first come first served by the token's position; a
  dropped choice contributes zero (the residual carries the token). c = 0: dropless;
- the load-balancing loss of a micro-batch, E * sum_i f_i * P_i, with f_i the fraction of its T
  tokens whose top-k include expert i (before any drop; no gradient) and P_i the mean router
  probability of expert i over them (Mixtral's form: balanced routing gives top_k). The model adds
  router_aux_coef times its mean over micro-batches and MoE layers to the language-model loss.

`groups`, `micro_batches`: the reference computes over the whole batch, a 4D run over each rank's
micro-batch; so capacity is taken per group, the batch's tokens cut into `groups` equal contiguous
chunks in batch order (G_z * G_data * micro-batches: a rank's shard of whole sequences, then its
micro-batches), and the auxiliary loss per micro-batch (group g is in micro-batch g % micro_batches),
which gives the 4D run's numbers exactly.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backend.runtime.moe import capacity, expert_counts, keep_mask, route
from twin.program.grid import AXES


# -- the reference block ---------------------------------------------------------------------------
def moe_forward(x: torch.Tensor, router: Callable[[torch.Tensor], torch.Tensor],
                expert: Callable[[int, torch.Tensor], torch.Tensor], experts: int, top_k: int,
                capacity_factor: float = 0.0, groups: int = 1, micro_batches: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE block on tokens x [T, h] (autograd-friendly): (output [T, h], auxiliary loss).
    router(x) -> logits [T, E]; expert(e, x_e) -> its MLP's output.

    The T tokens are `groups` equal contiguous groups (a rank's micro-batch each, in batch order:
    shard-major, micro-batch minor): capacity applies per group. Group g belongs to micro-batch
    g % micro_batches; the auxiliary loss is E * sum_i f_i P_i over each micro-batch's tokens (all
    its groups), averaged over the micro-batches."""
    T = x.shape[0]
    if T % groups or groups % micro_batches:
        raise ValueError(f"{T} tokens do not split into {groups} equal groups of {micro_batches} micro-batches")
    outs, counts, psums = [], [], []
    for chunk in x.split(T // groups):
        probs, idx, weights = route(router(chunk), top_k)
        keep = keep_mask(idx, experts, capacity(chunk.shape[0], top_k, experts, capacity_factor))
        counts.append(expert_counts(idx, experts))
        psums.append(probs.sum(0))
        y = torch.zeros_like(chunk)
        for e in range(experts):
            tok, slot = torch.where((idx == e) & keep)
            if tok.numel():
                ye = expert(e, chunk[tok]) * weights[tok, slot, None].to(chunk.dtype)
                y = y.index_add(0, tok, ye.to(y.dtype))
        outs.append(y)
    aux = x.new_zeros((), dtype=torch.float32)
    tokens = T // micro_batches
    for j in range(micro_batches):
        f = sum(counts[g] for g in range(j, groups, micro_batches)) / tokens
        p = sum(psums[g] for g in range(j, groups, micro_batches)) / tokens
        aux = aux + experts * (f * p).sum()
    return torch.cat(outs), aux / micro_batches


class MixtralMoE(nn.Module):
    """A Llama's MoE block with Hugging Face Mixtral's names and shapes as its files hold them:
    `gate.weight` [E, h] (the router), `experts.<e>.w1.weight` (gate) and `w3.weight` (up) [F, h],
    `w2.weight` (down) [h, F]."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, capacity_factor: float = 0.0):
        super().__init__()
        self.top_k, self.capacity_factor, self.n_experts = top_k, capacity_factor, experts
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList()
        for _ in range(experts):
            e = nn.Module()
            e.w1, e.w3, e.w2 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False), \
                nn.Linear(ffn, hidden, bias=False)
            self.experts.append(e)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        m = self.experts[e]
        return m.w2(F.silu(m.w1(x)) * m.w3(x))

    def forward(self, x: torch.Tensor, groups: int = 1, micro_batches: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., h] -> (output of the same shape, auxiliary loss): moe_forward."""
        y, aux = moe_forward(x.reshape(-1, x.shape[-1]), self.gate, self._expert, self.n_experts, self.top_k,
                             self.capacity_factor, groups, micro_batches)
        return y.view_as(x), aux


class GPTMoE(nn.Module):
    """A GPT's MoE block in ReferenceGPT's layout (y = x @ W): `router` [h, E], the experts stacked,
    `mlp_up` [E, h, F] and `mlp_down` [E, F, h], GELU between."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, capacity_factor: float = 0.0,
                 init: Callable[..., nn.Parameter] | None = None):
        super().__init__()
        init = init or (lambda *shape: nn.Parameter(torch.randn(shape) * 0.02))
        self.top_k, self.capacity_factor, self.n_experts = top_k, capacity_factor, experts
        self.router = init(hidden, experts)
        self.mlp_up, self.mlp_down = init(experts, hidden, ffn), init(experts, ffn, hidden)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.mlp_up[e]) @ self.mlp_down[e]

    def forward(self, x: torch.Tensor, groups: int = 1, micro_batches: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        y, aux = moe_forward(x.reshape(-1, x.shape[-1]), lambda t: t @ self.router, self._expert,
                             self.n_experts, self.top_k, self.capacity_factor, groups, micro_batches)
        return y.view_as(x), aux


# -- Hugging Face Mixtral tensors <-> the 4D model's shards ----------------------------------------
def moe_hf_layout(model, b, pre: str, coords, part) -> list:
    """backend.models.llama.hf_layout's entries (HF names, parameter, reader) of an MoE block's router
    and stacked experts (Mixtral's names); part(axis, total) -> this rank's (start, end).

    router [h/G_x, E] = gate.weight^T's x-rows, not cut over z. expert_up: local expert l (global
    e = (d % E_p) * E/E_p + l) is w1|w3 as mlp_up is gate|up; expert_down: w2 as down_proj; the
    rank's experts' blocks stacked, flattened, cut over z. Names list every expert (the same on every
    rank, for the export); a rank reads only its own experts' blocks."""
    spec, g = model.spec, model.ctx.grid
    h, f, E = spec.hidden, spec.ffn, spec.experts
    n_local = E // g.expert
    first = coords[AXES.index("data")] % g.expert * n_local
    q = pre + "block_sparse_moe."
    gate = q + "gate.weight"
    xs = part("x", h)
    out = [((gate,), b.router.weight, lambda get, xs=xs: get(gate)[0:E, xs[0]:xs[1]].t())]
    w = {n: [q + f"experts.{e}.{n}.weight" for e in range(E)] for n in ("w1", "w2", "w3")}
    mine = range(first, first + n_local)
    up = [[(w["w1"][e], *part("y", f)), (w["w3"][e], *part("y", f))] for e in mine]
    down = [[(w["w2"][e], *part("x", h))] for e in mine]
    names_up = tuple(n for e in range(E) for n in (w["w1"][e], w["w3"][e]))
    out.append((names_up, b.expert_up.weight, _stacked_reader(up, xs, coords, g.z)))
    out.append((tuple(w["w2"]), b.expert_down.weight, _stacked_reader(down, part("y", f), coords, g.z)))
    return out


def _stacked_reader(blocks: list[list[tuple[str, int, int]]], cols: tuple[int, int], coords, gz: int):
    """The local experts' W blocks (each cat(HF rows of its parts)[:, cols]^T) stacked, flattened, z-chunk."""
    def reader(get):
        flat = torch.cat([torch.cat([get(name)[r0:r1, cols[0]:cols[1]] for name, r0, r1 in parts], 0).t().reshape(-1)
                          for parts in blocks])
        n, z = flat.numel() // gz, coords[AXES.index("z")]
        return flat[z * n:(z + 1) * n]
    return reader
