"""Microbenchmarks: GEMM flop/s by shape and layout, collective bandwidth by size for each axis.

The result is one JSON table (the input of calibration): machine, date, device, dtype, then
`gemm` rows {m, n, k, layout, dtype, seconds, tflops} and `collectives` rows {axis, kind, group_size,
bytes, seconds, algbw_gbps, busbw_gbps}. Bandwidths follow nccl-tests: algbw = payload / time;
busbw = algbw * 2(p-1)/p for all-reduce and (p-1)/p for all-gather and reduce-scatter (GB/s = 1e9 B/s).
"""

from __future__ import annotations

import datetime
import json
import platform
import socket
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from twin.common import write_atomic
from twin.common import TwinError
from twin.grid import AXES, Grid
from twin.model import load_model
from twin.program import Options, build_program

LAYOUTS = ("NN", "NT", "TN")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_operands(m: int, n: int, k: int, layout: str, dtype: torch.dtype, device: torch.device):
    """Random operands of C[m,n] = A[m,k] B[k,n] stored as `layout` says (T: stored transposed)."""
    a = torch.randn(m, k, dtype=dtype, device=device) if layout[0] == "N" else \
        torch.randn(k, m, dtype=dtype, device=device).t()
    b = torch.randn(k, n, dtype=dtype, device=device) if layout[1] == "N" else \
        torch.randn(n, k, dtype=dtype, device=device).t()
    return a, b


def time_fn(fn, device: torch.device, min_time_s: float = 0.2, max_iters: int = 200, group=None) -> float:
    """Seconds per call of `fn`: one warm-up call, one timed call to size the loop, then a timed loop.

    With `group` (a collective under test) the members agree on the loop count, or they would hang.
    """
    fn()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    once = max(time.perf_counter() - start, 1e-7)
    iters = int(min(max_iters, max(3, min_time_s / once)))
    if group is not None:
        n = torch.tensor([iters], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group)
        iters = int(n.item())
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def bench_gemm(m: int, n: int, k: int, layout: str, dtype: torch.dtype, device: torch.device,
               min_time_s: float = 0.2) -> dict:
    """Time one GEMM shape and layout; flop/s counts 2*m*n*k."""
    a, b = gemm_operands(m, n, k, layout, dtype, device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    seconds = time_fn(lambda: torch.mm(a, b, out=out), device, min_time_s)
    return {"m": m, "n": n, "k": k, "layout": layout, "dtype": str(dtype).removeprefix("torch."),
            "seconds": seconds, "tflops": 2.0 * m * n * k / seconds / 1e12}


def program_gemm_shapes(model: str, grid: Grid) -> list[tuple[int, int, int, str]]:
    """The distinct local GEMM shapes (m, n, k, layout) of the program of `model` on `grid`."""
    prog = build_program(load_model(model), grid, Options())
    seen = []
    for op in prog.ops:
        key = (op.m, op.n, op.k, op.layout)
        if op.kind == "gemm" and key not in seen:
            seen.append(key)
    return seen


def bench_collective(kind: str, nbytes: int, group, group_size: int, device: torch.device,
                     min_time_s: float = 0.2) -> dict:
    """Time one collective of `nbytes` payload (all-gather: the gathered output) on `group`."""
    numel = max(group_size, nbytes // 4 // group_size * group_size)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.ones(numel // group_size, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        fn = lambda: dist.all_reduce(full, group=group)  # noqa: E731
    elif kind == "all_gather":
        fn = lambda: dist.all_gather_into_tensor(full, part, group=group)  # noqa: E731
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*")
    else:
        fn = lambda: dist.reduce_scatter_tensor(part, full, group=group)  # noqa: E731
    dist.barrier(group=group)
    seconds = time_fn(fn, device, min_time_s, max_iters=50, group=group)
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest member sets the time
    seconds = float(t.item())
    payload = numel * 4
    factor = 2 * (group_size - 1) / group_size if kind == "all_reduce" else (group_size - 1) / group_size
    algbw = payload / seconds / 1e9
    return {"kind": kind, "group_size": group_size, "bytes": payload, "seconds": seconds,
            "algbw_gbps": algbw, "busbw_gbps": algbw * factor}


def machine_info(device: torch.device) -> dict:
    info = {"host": socket.gethostname(), "platform": platform.platform(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def main(config: dict) -> None:
    """The `bench` job (one rank). config: model, grid, device, dtype, sizes_mib, squares, out, gemm, comm."""
    from backend.launch import env_rank
    rank, local_rank, world = env_rank()
    grid = Grid.parse(config["grid"])
    device = torch.device("cpu")
    if config["device"] == "cuda":
        if not torch.cuda.is_available():
            raise TwinError("--device cuda but no CUDA device is visible to PyTorch (use --device cpu)")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dtype = DTYPES[config["dtype"]]
    result = {"machine": machine_info(device), "model": config["model"], "grid": str(grid),
              "dtype": config["dtype"], "gemm": [], "collectives": []}
    min_t = float(config.get("min_time_s", 0.2))
    if config.get("gemm", True) and rank == 0:
        shapes = [(s, s, s, lay) for s in config.get("squares", []) for lay in LAYOUTS]
        if config.get("model"):
            mnk = dict.fromkeys((m, n, k) for m, n, k, _ in program_gemm_shapes(config["model"], grid))
            shapes += [(m, n, k, lay) for m, n, k in mnk for lay in LAYOUTS]
        for m, n, k, lay in dict.fromkeys(shapes):
            row = bench_gemm(m, n, k, lay, dtype, device, min_t)
            result["gemm"].append(row)
            print(f"gemm {m}x{n}x{k} {lay} {row['dtype']}: {row['tflops']:.3f} TF/s", flush=True)
    if config.get("comm", True) and world > 1:
        from backend.dist import ParallelContext, destroy
        ctx = ParallelContext.from_env(grid, backend="nccl" if device.type == "cuda" else "gloo")
        try:
            groups = {axis: g for axis, g in ctx.groups.items() if g is not None}
            kinds = ["all_reduce", "all_gather"] + (["reduce_scatter"] if device.type == "cuda" else [])
            for axis in AXES:
                if axis not in groups:
                    continue
                for mib in config.get("sizes_mib", [0.0625, 1, 16]):
                    for kind in kinds:
                        row = {"axis": axis, **bench_collective(kind, int(mib * 2**20), groups[axis],
                                                                grid.axis_size(axis), device, min_t)}
                        result["collectives"].append(row)
                        if rank == 0:
                            print(f"{kind} over {axis} ({row['group_size']} ranks) {row['bytes']} B: "
                                  f"busbw {row['busbw_gbps']:.3f} GB/s", flush=True)
        finally:
            destroy()
    if rank == 0:
        out = Path(config["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(result, indent=1))
        print(f"wrote {out}", flush=True)
