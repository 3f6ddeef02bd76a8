"""One training step of the 4D algorithm: micro-batches, gradient reductions, clipping, AdamW.

    opt = make_optimizer(model, lr=3e-4)
    loss = train_step(model, opt, [(tokens, targets), ...])   # one (tokens, targets) per micro-batch

Every op of the step is the program's, run by the executor (backend/runtime/executor.py): the forward and
backward of each micro-batch, the gradient reductions at the end of the step, clipping by the
global norm and the optimizer's step.
"""

from __future__ import annotations

import torch

from backend.models.gpt import GPT, sum_over_batch_shards
from backend.models.reference import ReferenceGPT
from backend.runtime.moe import is_moe
from backend.runtime.recorder import Recorder


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


def reduce_gradients(model: GPT) -> None:
    """The program's end-of-step gradient reductions (data for every shard, z and data for layer norms)."""
    model.executor.reduce_gradients()


def train_step(model: GPT, optimizer: torch.optim.Optimizer,
               batches: list[tuple[torch.Tensor, torch.Tensor]], recorder: Recorder | None = None,
               max_norm: float = 1.0, guard=None) -> float:
    """One iteration: forward and backward of each micro-batch, gradient reductions, clipping (if
    the program clips), AdamW. batches: this rank's (tokens, targets) [seqs, s] per micro-batch
    (len = options.micro_batches); targets IGNORE (-100) are left out of the loss. Returns the mean
    loss over the counted tokens of the global batch (the same on every rank).

    Outside the program (not recorded): one all-reduce over z and data of [loss sum, counted
    tokens] after the gradient reductions; the gradients, computed with the scale 1/(all tokens),
    are then rescaled to 1/(counted tokens) (exact: the gradient is linear in the scale).

    guard: a backend.training.guard.StepGuard, asked before the update (one small all-reduce): a step
    whose loss or gradients are not finite is not applied (`guard.why` says why). Without a guard, a
    non-finite gradient norm (with clipping) still skips the update.
    """
    if recorder is not None:
        model.recorder = recorder
    optimizer.zero_grad(set_to_none=True)
    loss = step_gradients(model, batches)
    skip = guard.before_update(loss, model) if guard is not None else None
    norm = model._executor_for(*batches[0][0].shape).optimizer_step(None if skip else optimizer, max_norm)
    if guard is not None:
        guard.after_update(norm)
    return loss


def step_gradients(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """train_step up to the optimizer: every micro-batch's forward and backward, the gradient
    reductions, the gradients scaled to the counted tokens; returns the loss (see train_step). The
    gradients must be None (or zero) before."""
    n = model.options.micro_batches
    if len(batches) != n:
        raise ValueError(f"{len(batches)} micro-batches given, options.micro_batches is {n}")
    device = model.ctx.device
    exe = model._executor_for(*batches[0][0].shape)
    all_tokens = sum(t.numel() for t, _ in batches) * model.ctx.batch_shards
    if is_moe(model.spec):  # the load-balancing loss is not a sum over counted tokens: scale exactly
        counted = sum((y >= 0).sum() for _, y in batches).to(device, torch.float32).reshape(1)
        all_tokens = max(float(sum_over_batch_shards(counted, model.ctx)), 1.0)
    sums = torch.zeros(2, dtype=torch.float32, device=device)  # loss sum, counted tokens
    if model.ctx.grid.pipe > 1:  # a pipeline stage: its program runs the schedule's units in order
        batches = [(t.to(device), y.to(device)) for t, y in batches]
        sums[0] += exe.run_step(batches, 1.0 / all_tokens)
        sums[1] += sum((y >= 0).sum() for _, y in batches)
        sums[0] = sum_over_stages(sums[0:1], model.ctx)[0]  # the loss is the last stage's (outside the program)
    else:
        for j, (tokens, targets) in enumerate(batches):
            tokens, targets = tokens.to(device), targets.to(device)
            sums[0] += exe.forward(j, tokens, targets, 1.0 / all_tokens).detach()
            exe.backward(j)
            sums[1] += (targets >= 0).sum()  # a tensor add: no host sync
        exe.reduce_gradients()
    sums = sum_over_batch_shards(sums, model.ctx)  # outside the program: loss and token count
    factor = all_tokens / max(float(sums[1]), 1.0)
    if factor != 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    return float(sums[0]) * factor



def sum_over_stages(value: torch.Tensor, ctx) -> torch.Tensor:
    """Sum a tensor over the pipeline stages (outside the program, not recorded)."""
    value = value.clone()
    if ctx.groups.get("pipe") is not None:
        torch.distributed.all_reduce(value, group=ctx.groups["pipe"])
    return value


def micro_batches(tokens: torch.Tensor, targets: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split this rank's sequences into n micro-batches of whole sequences."""
    return list(zip(tokens.chunk(n), targets.chunk(n)))


def local_batch(tokens: torch.Tensor, model: GPT) -> torch.Tensor:
    """This rank's sequences of a global batch [B, ...]: shard z + G_z*d of G_z*G_data."""
    return tokens.chunk(model.ctx.batch_shards)[model.ctx.batch_shard]
