"""One training step of the 4D algorithm: micro-batches, gradient reductions, clipping, AdamW.

    opt = make_optimizer(model, lr=3e-4)
    loss = train_step(model, opt, [(tokens, targets), ...])   # one (tokens, targets) per micro-batch

Gradient reductions at the end of the step, in the program's order: each linear layer's fp32
gradient shard all-reduced over data (`L<i>.<layer>.grad.ar_data`), then wte+wpe
(`emb.grad.ar_data`), then all layer-norm gradients over z and data (`norms.grad.ar_z`,
`norms.grad.ar_data`). Clipping by the global norm: the squares of this rank's unique gradients
(layer norms counted on y = z = 0 only), summed over x, y and z (`opt.clip.ar_*`).
"""

from __future__ import annotations

import torch
from torch import nn

from backend.model import GPT, ReferenceGPT, sum_over_batch_shards
from backend.recorder import Recorder
from twin.program import GRAD_AR_BYTES, STAT_BYTES


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def make_optimizer(model: GPT, lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.95),
                   weight_decay: float = 0.1, eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over this rank's shards: weight decay on the sharded matrices, none on layer norms.
    On GPU the fused (single-kernel) implementation; the same update."""
    groups = [{"params": model.sharded_parameters(), "weight_decay": weight_decay},
              {"params": model.norm_parameters(), "weight_decay": 0.0}]
    fused = model.ctx.device.type == "cuda" or None
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


def make_reference_optimizer(ref: ReferenceGPT, lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.95),
                             weight_decay: float = 0.1, eps: float = 1e-8) -> torch.optim.AdamW:
    """The same AdamW for the ReferenceGPT (decay on matrices, none on layer norms)."""
    mats = [p for p in ref.parameters() if p.dim() == 2]
    norms = [p for p in ref.parameters() if p.dim() == 1]
    return torch.optim.AdamW([{"params": mats, "weight_decay": weight_decay},
                              {"params": norms, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)


def _flat(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([_grad(p).reshape(-1) for p in params])


def _unflat(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    off = 0
    for p in params:
        p.grad.copy_(flat[off:off + p.numel()].view_as(p))
        off += p.numel()


def reduce_gradients(model: GPT) -> None:
    """The end-of-step gradient all-reduces (data for every shard, z and data for layer norms)."""
    comm = model.sched.comm
    pending = []
    for lin in model.linears():
        g = _grad(lin.weight)
        pending.append((comm.all_reduce(g, "data", f"{lin.name}.grad.ar_data", async_op=True,
                                        width=GRAD_AR_BYTES), None))
    emb = [model.emb.wte, model.emb.wpe]
    flat = _flat(emb)
    pending.append((comm.all_reduce(flat, "data", "emb.grad.ar_data", async_op=True, width=GRAD_AR_BYTES), emb))
    norms = model.norm_parameters()
    nflat = _flat(norms)
    comm.all_reduce(nflat, "z", "norms.grad.ar_z", width=STAT_BYTES)
    pending.append((comm.all_reduce(nflat, "data", "norms.grad.ar_data", async_op=True, width=STAT_BYTES), norms))
    for p, params in pending:
        result = p.wait()
        if params is not None:
            _unflat(result, params)


def clip_gradients(model: GPT, max_norm: float) -> float:
    """Scale all gradients so that their global norm is at most max_norm; returns the norm before."""
    s = model.sched
    x, y, z, _ = model.ctx.coords
    with s.compute("opt.norm", "elementwise"):
        params = model.sharded_parameters() + (model.norm_parameters() if y == 0 and z == 0 else [])
        sq = torch.zeros(1, dtype=torch.float32, device=model.ctx.device)
        for p in params:
            sq += _grad(p).float().pow(2).sum()
    for axis in ("x", "y", "z"):
        s.comm.all_reduce(sq, axis, f"opt.clip.ar_{axis}", width=STAT_BYTES)
    norm = float(sq.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def train_step(model: GPT, optimizer: torch.optim.Optimizer,
               batches: list[tuple[torch.Tensor, torch.Tensor]], recorder: Recorder | None = None,
               max_norm: float = 1.0) -> float:
    """One iteration: forward and backward of each micro-batch, gradient reductions, clipping (if
    options.grad_clip), AdamW. batches: this rank's (tokens, targets) [seqs, s] per micro-batch
    (len = options.micro_batches); targets IGNORE (-100) are left out of the loss. Returns the mean
    loss over the counted tokens of the global batch (the same on every rank).

    Outside the program (not recorded): one all-reduce over z and data of [loss sum, counted
    tokens] after the gradient reductions; the gradients, computed with the scale 1/(all tokens),
    are then rescaled to 1/(counted tokens) (exact: the gradient is linear in the scale).
    """
    if recorder is not None:
        model.recorder = recorder
    n = model.options.micro_batches
    if len(batches) != n:
        raise ValueError(f"{len(batches)} micro-batches given, options.micro_batches is {n}")
    optimizer.zero_grad(set_to_none=True)
    # backward with the scale 1/(all tokens); rescaled below to 1/(tokens counted in the loss)
    all_tokens = sum(t.numel() for t, _ in batches) * model.ctx.batch_shards
    sums = torch.zeros(2, dtype=torch.float32, device=model.ctx.device)  # loss sum, counted tokens
    for j, (tokens, targets) in enumerate(batches):
        loss = model(tokens, targets, micro_batch=j, total_tokens=all_tokens, reduce_loss=False)
        loss.backward()
        sums[0] += loss.detach()
        sums[1] += (targets >= 0).sum()  # a tensor add: no host sync
    model.sched.finish_grads()
    reduce_gradients(model)
    sums = sum_over_batch_shards(sums, model.ctx)  # outside the program: loss and token count
    factor = all_tokens / max(float(sums[1]), 1.0)
    if factor != 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    if model.options.grad_clip:
        clip_gradients(model, max_norm)
    with model.sched.compute("opt.step", "optimizer"):
        optimizer.step()
    model.sched.end_step()
    return float(sums[0]) * factor


def micro_batches(tokens: torch.Tensor, targets: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split this rank's sequences into n micro-batches of whole sequences."""
    return list(zip(tokens.chunk(n), targets.chunk(n)))


def local_batch(tokens: torch.Tensor, model: GPT) -> torch.Tensor:
    """This rank's sequences of a global batch [B, ...]: shard z + G_z*d of G_z*G_data."""
    return tokens.chunk(model.ctx.batch_shards)[model.ctx.batch_shard]
