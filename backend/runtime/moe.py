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


# -- the executor's MoE kernels (twin/program/moe.py names the ops and their buffers) ----------------
class Routing:
    """The value of a block's `router.idx` buffer: this rank's routing of its m tokens and the layout
    of the rows it sends and its experts receive.

    Send order (the `moe.send` rows): kept choices sorted by expert, then by token position; expert e
    lives on expert-group member e // n_local as its local expert e % n_local. Expert order (the rows
    the local experts compute on): by local expert, then source member, then the source's order.
    `recv` ([E_p, n_local] counts of rows from each source for each local expert) is learnt by the
    dispatch's count exchange (all_to_all of ints); with E_p = 1 it is the send counts."""

    def __init__(self, idx: torch.Tensor, keep: torch.Tensor, experts: int, members: int):
        self.idx, self.keep, self.experts, self.members = idx, keep, experts, members
        self.n_local = experts // members
        flat_e = torch.where(keep, idx, experts).reshape(-1)   # dropped choices sort last
        order = torch.sort(flat_e, stable=True).indices          # token-major flat order: by expert, then token
        kept = int(keep.sum())
        order = order[:kept]
        k = idx.shape[1]
        self.tok, self.slot = order // k, order % k
        self.send_counts = torch.bincount(flat_e[order], minlength=experts)  # [E] rows sent to each expert
        self.recv: torch.Tensor | None = None if members > 1 else self.send_counts.view(1, experts)
        self._perm: torch.Tensor | None = None

    def send_splits(self) -> list[int]:
        """Rows sent to each member of the expert group."""
        return self.send_counts.view(self.members, self.n_local).sum(1).tolist()

    def recv_splits(self) -> list[int]:
        """Rows received from each member."""
        return self.recv.sum(1).tolist()

    def expert_rows(self) -> list[int]:
        """Rows of each local expert in expert order."""
        return self.recv.sum(0).tolist()

    def to_expert_order(self) -> torch.Tensor:
        """Index: expert-order row i is received (source-major) row perm[i]."""
        if self._perm is None:
            counts = self.recv.reshape(-1).cpu()  # a few ints: the index is built on the host
            starts = torch.cumsum(counts, 0) - counts
            blocks = [torch.arange(int(starts[s * self.n_local + l]), int(starts[s * self.n_local + l] + counts[s * self.n_local + l]))
                      for l in range(self.n_local) for s in range(self.members)]
            perm = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.long)
            self._perm = perm.to(self.idx.device)
        return self._perm


def _router_weight(run, op) -> torch.Tensor:
    return run.model.router_weight(op.weight)


def router(run, op, x: torch.Tensor) -> torch.Tensor:
    """Router logits of this rank's x-shard of features: [m, h/G_x] @ [h/G_x, E], fp32 (summed over x)."""
    return x.float() @ _router_weight(run, op).float()


def router_topk(run, op, logits: torch.Tensor):
    """Softmax (fp32), top-k, renormalised gates; the Routing (capacity: per this rank's m tokens); this
    rank's per-expert counts (summed over z and data by the counts' all-reduces). In the forward pass
    the rank's share of the auxiliary loss's P is kept for the loss value."""
    spec, members = run.model.spec, run.model.ctx.size("expert")
    e, k = experts_of(spec), top_k_of(spec)
    probs, idx, gates = route(logits, k)
    keep = keep_mask(idx, e, capacity(idx.shape[0], k, e, capacity_factor_of(spec)))
    counts = expert_counts(idx, e)
    if op.phase == "fwd":
        run.aux_parts.append((probs.sum(0), counts, idx.shape[0]))
    return probs, gates, Routing(idx, keep, e, members), counts


def moe_permute(run, op, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The rows this rank sends, in send order (kept choices only: the actual counts)."""
    return x[routing.tok]


def moe_unpermute(run, op, back: torch.Tensor, gates: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token's output: the sum of its kept rows (returned in send order) times their gates."""
    m = routing.idx.shape[0]
    out = torch.zeros((m, back.shape[1]), dtype=torch.float32, device=back.device)
    out.index_add_(0, routing.tok, back.float() * gates[routing.tok, routing.slot, None])
    return out.to(back.dtype)


def moe_unpermute_bwd(run, op, dout: torch.Tensor, back: torch.Tensor, gates: torch.Tensor, routing: Routing):
    """d(rows) = dout of the row's token times its gate; d(gates) partial over this rank's features."""
    d = dout[routing.tok].float()
    drows = (d * gates[routing.tok, routing.slot, None]).to(dout.dtype)
    dgates = torch.zeros(gates.shape, dtype=torch.float32, device=dout.device)
    dgates[routing.tok, routing.slot] = (d * back.float()).sum(-1)
    return drows, dgates


def router_topk_bwd(run, op, dgates: torch.Tensor, probs: torch.Tensor, routing: Routing, counts: torch.Tensor):
    """d(logits): the renormalised top-k softmax's backward of d(gates), plus the auxiliary loss's
    gradient (its f from the micro-batch's global counts, its P over the micro-batch's T tokens)."""
    g = weights_grad_to_logits(probs, routing.idx, dgates)
    tokens = probs.shape[0] * run.model.ctx.batch_shards
    return g + aux_grad(probs, counts, tokens, run.dloss * run.aux_scale)


def router_dgrad(run, op, dlogits: torch.Tensor) -> torch.Tensor:
    """This rank's x-shard of the router's input gradient: d(logits) @ W^T (no reduction needed)."""
    return (dlogits @ _router_weight(run, op).float().t()).to(run.model.ctx.compute_dtype)


def router_wgrad(run, op, x: torch.Tensor, dlogits: torch.Tensor) -> torch.Tensor:
    """The router's weight gradient x^T d(logits) [h/G_x, E] (fp32), accumulated into its parameter."""
    return x.float().t() @ dlogits


def moe_permute_bwd(run, op, drows: torch.Tensor, routing: Routing) -> torch.Tensor:
    """d(input) of the tokens: the scatter-add of their rows' gradients (send order)."""
    m = routing.idx.shape[0]
    out = torch.zeros((m, drows.shape[1]), dtype=torch.float32, device=drows.device)
    out.index_add_(0, routing.tok, drows.float())
    return out.to(drows.dtype)


def grouped_gemm(run, op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One GEMM per local expert on its rows (expert order), each with its own weight of the stack
    [n_local, k, n]: NN rows @ W_e, NT rows @ W_e^T, TN (weight gradient) rows_a^T rows_b -> the stack."""
    routing = run.routing_of(op)
    rows = routing.expert_rows()
    if op.layout == "TN":
        out = torch.zeros((len(rows), a.shape[1], b.shape[1]), dtype=a.dtype, device=a.device)
        for e, (ra, rb) in enumerate(zip(a.split(rows), b.split(rows))):
            if ra.shape[0]:
                out[e] = ra.t() @ rb
        return out
    w = b if op.layout == "NN" else b.transpose(1, 2)
    outs = [ra @ w[e] for e, ra in enumerate(a.split(rows))]
    return torch.cat(outs) if outs else a.new_zeros((0, w.shape[2]))


def aux_value(run, experts: int, shards: int) -> torch.Tensor:
    """This rank's share of the micro-batch's load-balancing loss, times its coefficient and
    1 / (MoE layers * micro-batches): sum over blocks of E * sum_i (counts_i / T) (P-sum_i / T), where the
    counts are global (their all-reduces complete) and T = this rank's tokens * G_z * G_data."""
    total = torch.zeros((), dtype=torch.float32)
    for psum, counts, m in run.aux_parts:
        t = m * shards
        total = total + experts * (counts.float().cpu() / t * psum.float().cpu() / t).sum()
    return total.to(run.aux_parts[0][0].device) * run.aux_scale


def routing_sources(program) -> dict[int, tuple[str, int]]:
    """For every all-to-all and grouped GEMM of an MoE program: (the `router.idx` buffer whose
    routing it follows, how many all-to-alls lie between it and where its rows were laid out). Found
    by walking each op's first input back through the ops that wrote it to the block's moe_permute
    (forward) or moe_unpermute_bwd (backward); an even count means the rows travel toward the experts."""
    writer: dict[str, int] = {}
    source: dict[int, dict[str, int]] = {}
    routings = set()  # the buffers router_topk writes its Routing to (its third output)
    for op in program.ops:
        source[op.index] = {name: writer[name] for name in op.reads if name in writer}
        for name in op.writes:
            writer[name] = op.index
        if op.role == "router_topk":
            routings.add(op.writes[2])
    ops = program.ops
    out = {}
    for op in ops:
        if op.kind != "all_to_all" and op.role != "grouped_gemm":
            continue
        cur, crossed = op, 0
        while cur.role not in ("moe_permute", "moe_unpermute_bwd"):
            prev = ops[source[cur.index][cur.reads[0]]]
            crossed += prev.kind == "all_to_all"
            cur = prev
        idx = [name for name in cur.reads if name in routings]
        out[op.index] = (idx[0], crossed)
    return out


MOE_COMPUTE = {"router": router, "router_topk": router_topk, "moe_permute": moe_permute,
               "moe_unpermute": moe_unpermute, "moe_unpermute_bwd": moe_unpermute_bwd,
               "router_topk_bwd": router_topk_bwd, "router_dgrad": router_dgrad, "router_wgrad": router_wgrad,
               "moe_permute_bwd": moe_permute_bwd, "grouped_gemm": grouped_gemm}
