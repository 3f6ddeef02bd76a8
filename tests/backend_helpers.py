"""Helpers for the backend tests: run a function on every rank of a grid (gloo, CPU processes), or in
one process on a fake process group of any size."""

from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
# imported once, before the ranks fork, as backend.launch.spawn does: torch.optim and autograd.grad
# import it (and sympy) lazily, which cost each of 8 forked ranks seconds (an 8-rank test: 20 s -> 2 s)
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.multiprocessing as mp

from backend.launch.spawn import free_port
from backend.runtime.dist import ParallelContext
from twin.program.grid import Grid


def _worker(rank: int, world: int, port: int, grid: Grid, fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        ctx = ParallelContext.build(grid)
        result = fn(ctx, *args)
        queue.put((rank, result, None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_grid(grid: Grid | str, fn: Callable, *args, timeout_s: float = 120.0) -> list:
    """Run fn(ctx, *args) on every rank of `grid` (one forked process each, gloo); results by rank.

    fn must be a module-level function; its result is pickled back (keep it small: floats, lists,
    small tensors).
    """
    grid = Grid.parse(grid) if isinstance(grid, str) else grid
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, grid.size, port, grid, fn, args, queue), daemon=True)
             for r in range(grid.size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    for _ in procs:
        rank, result, err = queue.get()
        if err:
            errors.append(f"rank {rank}:\n{err}")
        results[rank] = result
        if errors:
            break
    for p in procs:
        p.join(timeout=5 if errors else timeout_s)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(grid.size)]


@contextmanager
def fake_grid(grid: Grid | str, rank: int = 0) -> Iterator[ParallelContext]:
    """A ParallelContext for `rank` of `grid` on PyTorch's fake backend (no-op collectives, one process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    grid = Grid.parse(grid) if isinstance(grid, str) else grid
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=grid.size)
    try:
        yield ParallelContext.build(grid)
    finally:
        dist.destroy_process_group()


def children(pid: int) -> list[int]:
    """The process ids whose parent is `pid` (a launcher's ranks), increasing: forked in rank order."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return sorted(out)


def sharded_gradients(model, tokens: torch.Tensor, targets: torch.Tensor, n: int) -> float:
    """One batch through a sharded model in `n` micro-batches, each scaled to the batch's counted
    tokens, and the gradients reduced as a training step reduces them; returns the loss."""
    from backend.training.optim import local_batch, micro_batches, reduce_gradients

    loss, total = 0.0, int((targets >= 0).sum())
    for j, (t, y) in enumerate(micro_batches(local_batch(tokens, model), local_batch(targets, model), n)):
        mb_loss = model(t, y, micro_batch=j, total_tokens=total)
        mb_loss.backward()
        loss += float(mb_loss.detach())
    reduce_gradients(model)
    return loss


def steps_against_reference(model, opt, ref, ref_opt, batches, n: int, max_norm: float,
                            **ref_kwargs) -> tuple[list[float], list[float], list]:
    """Clipped optimizer steps of a sharded model and of its single-process reference on the same
    (tokens, targets) batches; returns both loss curves and the keys of the ops the sharded model's
    first step recorded."""
    from backend.runtime.recorder import Recorder
    from backend.training.optim import local_batch, micro_batches, train_step

    losses, ref_losses, rec = [], [], Recorder()
    for step, (tokens, targets) in enumerate(batches):
        ref_opt.zero_grad()
        rl = ref(tokens, targets, **ref_kwargs)
        rl.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_losses.append(float(rl))
        mbs = micro_batches(local_batch(tokens, model), local_batch(targets, model), n)
        losses.append(train_step(model, opt, mbs, recorder=rec if step == 0 else None, max_norm=max_norm))
        model.recorder = Recorder(enabled=False)
    return losses, ref_losses, [r.key() for r in rec.records]


def random_batch(spec, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random tokens of a model spec (seeded by `step`) and their next-token targets, a
    fifth of them dropped (IGNORE, as goldfish drops them)."""
    from backend.runtime.layers import IGNORE

    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=g)
    targets = torch.roll(tokens, -1, dims=1)
    targets[torch.rand(targets.shape, generator=g) < 0.2] = IGNORE
    return tokens, targets


def relative_errors(ref, full: dict) -> dict[str, float]:
    """Per parameter of a single-process reference, the largest difference of the gathered gradient
    `full[name]` from the reference's, over the reference's largest (0 against an all-zero one)."""
    return {k: float((full[k] - p.grad).abs().max()) / (float(p.grad.abs().max()) + 1e-12)
            for k, p in ref.named_parameters()}
