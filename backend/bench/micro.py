"""The microbenchmarks of backend.bench.bench, every rank at once: GEMMs by shape and layout, causal attention,
eager per-op cost, collectives per axis, a GEMM under an all-reduce. The shapes of a model's program
that they time: backend.bench.shapes (no torch)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from backend.bench.shapes import OP_SIZES
from backend.bench.timing import agree, mean_over_ranks, synchronize, time_fn, world_group


def gemm_operands(m: int, n: int, k: int, layout: str, dtype: torch.dtype, device: torch.device):
    """Random operands of C[m,n] = A[m,k] B[k,n] stored as `layout` says (T: stored transposed)."""
    a = torch.randn(m, k, dtype=dtype, device=device) if layout[0] == "N" else \
        torch.randn(k, m, dtype=dtype, device=device).t()
    b = torch.randn(k, n, dtype=dtype, device=device) if layout[1] == "N" else \
        torch.randn(n, k, dtype=dtype, device=device).t()
    return a, b



def bench_gemm(m: int, n: int, k: int, layout: str, dtype: torch.dtype, device: torch.device,
               min_time_s: float = 0.2) -> dict:
    """Time one GEMM shape and layout on every rank at once; flop/s counts 2*m*n*k per rank."""
    a, b = gemm_operands(m, n, k, layout, dtype, device)
    seconds = mean_over_ranks(time_fn(lambda: torch.mm(a, b), device, min_time_s, group=world_group()))
    return {"m": m, "n": n, "k": k, "layout": layout, "dtype": str(dtype).removeprefix("torch."),
            "seconds": seconds, "tflops": 2.0 * m * n * k / seconds / 1e12}


def bench_ops(dtype: torch.dtype, device: torch.device, min_time_s: float = 0.2) -> list[dict]:
    """Per-op cost of eager PyTorch: an elementwise add over several sizes (bytes read plus written),
    and one forward+backward of a tiny autograd op (counted as two ops)."""
    rows = []
    for numel in OP_SIZES:
        a = torch.randn(numel, dtype=dtype, device=device)
        b = torch.randn(numel, dtype=dtype, device=device)
        s = mean_over_ranks(time_fn(lambda: torch.add(a, b), device, min_time_s, 2000, group=world_group()))
        rows.append({"op": "add", "numel": numel, "bytes": 3 * numel * a.element_size(), "seconds": s})
    x = torch.randn(64, dtype=dtype, device=device, requires_grad=True)

    def fwd_bwd():
        torch.nn.functional.gelu(x).sum().backward()

    # gelu + sum forward, their two backward nodes and accumulation: about four ops
    s = mean_over_ranks(time_fn(fwd_bwd, device, min_time_s, 2000, group=world_group()))
    rows.append({"op": "autograd", "numel": 64, "bytes": 0, "ops": 4, "seconds": s / 4})
    return rows


def bench_attention(m: int, n: int, k: int, fwd_flops: float, bwd_flops: float, dtype: torch.dtype,
                    device: torch.device, min_time_s: float = 0.2) -> dict:
    """Causal attention as the backend runs it (scaled_dot_product_attention) on m = sequences x heads
    rows of n tokens with head size k, every rank at once: forward alone, and forward + backward
    (backward = the difference). flops: the program's count (twin.program.program)."""
    import torch.nn.functional as F
    q, kk, v = (torch.randn(1, m, n, k, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, m, n, k, dtype=dtype, device=device)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, kk, v, is_causal=True)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, kk, v, is_causal=True).backward(grad)

    f = mean_over_ranks(time_fn(fwd, device, min_time_s, group=world_group()))
    fb = mean_over_ranks(time_fn(fwd_bwd, device, min_time_s, group=world_group()))
    return {"m": m, "n": n, "k": k, "fwd_flops": fwd_flops, "bwd_flops": bwd_flops, "fwd_s": f,
            "bwd_s": max(fb - f, 1e-9)}


def bench_collective(comm, kind: str, axis: str, nbytes: int, dtype: torch.dtype, device: torch.device,
                     min_time_s: float = 0.2) -> dict:
    """Time one collective of about `nbytes` real payload over `axis` through backend.runtime.comm
    (all-gather: the gathered output), all groups of the axis at once; the slowest member sets it."""
    p = comm.ctx.size(axis)
    group = comm.ctx.groups[axis]
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(p, nbytes // elem // p * p)
    full = torch.ones(numel, dtype=dtype, device=device)
    part = torch.ones(numel // p, dtype=dtype, device=device)
    name = f"bench.{kind}_{axis}"
    if kind == "all_reduce":
        fn = lambda: comm.all_reduce(full, axis, name)  # noqa: E731
    elif kind == "all_gather":
        fn = lambda: comm.all_gather(part, axis, name)  # noqa: E731
    else:
        fn = lambda: comm.reduce_scatter(full, axis, name)  # noqa: E731
    seconds = time_fn(fn, device, min_time_s, max_iters=100, group=group)
    seconds = agree(seconds, world_group(), dist.ReduceOp.MAX)
    payload = numel * elem
    factor = 2 * (p - 1) / p if kind == "all_reduce" else (p - 1) / p
    algbw = payload / seconds / 1e9
    return {"axis": axis, "kind": kind, "group_size": p, "stride": comm.ctx.grid.stride(axis),
            "bytes": payload, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": algbw * factor}


def bench_overlap(comm, axis: str, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                  nbytes: int = 1 << 20, min_time_s: float = 0.2) -> dict:
    """A GEMM alone, then while an asynchronous all-reduce of `nbytes` runs over `axis`; and the
    all-reduce alone, then beside the GEMM (issue to completion, a callback on its future): how much
    each slows the other when they share the rank's cores."""
    a, b = gemm_operands(m, n, k, "NN", dtype, device)
    buf = torch.ones(max(1, nbytes // a.element_size()), dtype=dtype, device=device)
    group = world_group()
    alone = mean_over_ranks(time_fn(lambda: torch.mm(a, b), device, min_time_s, group=group))
    comm_alone = time_fn(lambda: comm.all_reduce(buf, axis, "bench.overlap"), device, min_time_s, max_iters=100,
                         group=comm.ctx.groups[axis])
    gemm_s, comm_s = [], []

    def overlapped():
        t0 = time.perf_counter()
        pending = comm.all_reduce(buf, axis, "bench.overlap", async_op=True)
        done: list[float] = []
        try:
            pending.work.get_future().then(lambda _: done.append(time.perf_counter()))
        except (AttributeError, RuntimeError):  # a backend without futures: completion unknown
            pass
        t1 = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        gemm_s.append(time.perf_counter() - t1)
        pending.wait()
        synchronize(device)
        if done:
            comm_s.append(done[0] - t0)

    time_fn(overlapped, device, min_time_s, group=comm.ctx.groups[axis])
    gemm_s.sort()
    with_comm = mean_over_ranks(gemm_s[len(gemm_s) // 2])
    row = {"m": m, "n": n, "k": k, "axis": axis, "bytes": buf.numel() * buf.element_size(),
           "alone_s": alone, "overlapped_s": with_comm, "slowdown": with_comm / alone}
    # every rank takes part in the means (a rank whose callbacks never ran reports its wait instead)
    comm_s.sort()
    beside = comm_s[len(comm_s) // 2] if comm_s else with_comm
    row.update(comm_alone_s=mean_over_ranks(comm_alone), comm_overlapped_s=mean_over_ranks(beside))
    return row
