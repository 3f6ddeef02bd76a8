"""How backend.bench.bench times things: a loop sized to a minimum time, the median of a few loops, with
the ranks agreeing on loop counts and results (seconds)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)



def agree(value: float, group, op=dist.ReduceOp.MIN) -> float:
    """The members' MIN (or MAX, SUM) of a number; the number itself without a group."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


REPEATS = 3  # timed loops per entry; the median counts (a busy machine disturbs single loops)


def time_fn(fn, device: torch.device, min_time_s: float = 0.2, max_iters: int = 200, group=None,
            repeats: int = REPEATS) -> float:
    """Seconds per call of `fn`: one warm-up call, one timed call to size the loop, then `repeats`
    timed loops of about min_time_s / repeats each; the median loop counts.

    With `group` the members agree on the loop count (a collective under test would hang otherwise;
    compute benchmarks use it so that all ranks load the machine for the same span).
    """
    fn()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    once = max(time.perf_counter() - start, 1e-7)
    iters = int(agree(int(min(max_iters, max(2, min_time_s / repeats / once))), group))
    loops = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        synchronize(device)
        loops.append((time.perf_counter() - start) / iters)
    return sorted(loops)[len(loops) // 2]


def world_group():
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def mean_over_ranks(seconds: float) -> float:
    group = world_group()
    return agree(seconds, group, dist.ReduceOp.SUM) / (dist.get_world_size() if group is not None else 1)
