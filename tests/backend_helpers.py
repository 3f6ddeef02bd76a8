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
