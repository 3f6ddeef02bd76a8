"""Microbenchmarks: what the twin needs to know about the machine at hand, measured for one grid.

Every rank of the grid runs every benchmark at the same time, as the ranks of a training run do, so
what one rank measures already includes sharing the node (its cores and memory bandwidth on CPU).
One JSON measurement file (the input of `twin calibrate`) holds:
- `machine`: host, CPU/GPU, cores, threads per rank, date, torch/python/numpy versions, git commit,
  load average; `grid`, `ranks` (ranks sharing the node), `dtype`;
- `gemm` rows {m, n, k, layout, seconds, tflops}: the local GEMM shapes of the model's program (of
  this grid, or of every valid grid with this many ranks) in their program layout (or all three),
  and square GEMMs; seconds are the mean over the ranks;
- `attention` rows {m, n, k, fwd_flops, bwd_flops, fwd_s, bwd_s}: causal attention of the program's
  shapes (m = sequences x local heads, n = tokens, k = head size), forward and backward;
- `ops` rows {op, numel, bytes, seconds}: a small elementwise op at several sizes (per-op overhead
  plus memory bandwidth), one forward+backward of a tiny autograd op (eager per-op overhead), and
  `host` {op: "host", model, ops, mean_s, seconds, free_mean_s}: the executor's host time per compute
  op, the median (and mean: free_mean_s) gap between consecutive compute ops with no collective in
  flight, in a few training steps of the model on the grid (what the rank's Python spends between
  kernels: dispatch, buffer bookkeeping, issuing collectives);
- `collectives` rows {axis, kind, group_size, stride, bytes, seconds, algbw_gbps, busbw_gbps}, run
  through backend.comm exactly as training runs them (gloo's reduce-scatter is an all-reduce);
  bytes are the real payload (all-gather: the gathered output), every group of the axis at once;
- `overlap` rows {m, n, k, axis, alone_s, overlapped_s, slowdown, comm_alone_s, comm_overlapped_s}:
  a GEMM alone and while an all-reduce runs on the axis, and the all-reduce alone and beside the GEMM
  (issue to completion): what each costs the other when they share the rank's cores;
- `steps` rows {name, kind, role, stream, axis, bytes, flops, m, n, k, layout, seconds, covered,
  cpu_s, wake_s}: every op of the model's program as a few recorded training steps on the grid ran it
  (mean span over the steps; on CPU, a compute op's on-CPU time too), with the share of a compute op's span that
  a collective overlapped, and for a
  collective the time the compute op that waited for it took to start after its completion: what ops
  cost inside training, where the ranks share the cores with each other and with gloo's threads (see
  bench_steps).
Bandwidths follow nccl-tests: algbw = payload / time; busbw = algbw * 2(p-1)/p for all-reduce and
(p-1)/p for all-gather and reduce-scatter (GB/s = 1e9 B/s).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from twin.common import write_atomic
from twin.common import TwinError
from twin.grid import AXES, Grid
from twin.model import load_model
from twin.program import Options, build_program
from twin.trace import Span, covered_share

LAYOUTS = ("NN", "NT", "TN")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMAT = "backend-bench/2"
OP_SIZES = (1, 4096, 65536, 1 << 20)  # elements of the elementwise-op benchmark


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


def _agree(value: float, group, op=dist.ReduceOp.MIN) -> float:
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
    iters = int(_agree(int(min(max_iters, max(2, min_time_s / repeats / once))), group))
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


def _world():
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def _mean_over_ranks(seconds: float) -> float:
    group = _world()
    return _agree(seconds, group, dist.ReduceOp.SUM) / (dist.get_world_size() if group is not None else 1)


def bench_gemm(m: int, n: int, k: int, layout: str, dtype: torch.dtype, device: torch.device,
               min_time_s: float = 0.2) -> dict:
    """Time one GEMM shape and layout on every rank at once; flop/s counts 2*m*n*k per rank."""
    a, b = gemm_operands(m, n, k, layout, dtype, device)
    seconds = _mean_over_ranks(time_fn(lambda: torch.mm(a, b), device, min_time_s, group=_world()))
    return {"m": m, "n": n, "k": k, "layout": layout, "dtype": str(dtype).removeprefix("torch."),
            "seconds": seconds, "tflops": 2.0 * m * n * k / seconds / 1e12}


def bench_ops(dtype: torch.dtype, device: torch.device, min_time_s: float = 0.2) -> list[dict]:
    """Per-op cost of eager PyTorch: an elementwise add over several sizes (bytes read plus written),
    and one forward+backward of a tiny autograd op (counted as two ops)."""
    rows = []
    for numel in OP_SIZES:
        a = torch.randn(numel, dtype=dtype, device=device)
        b = torch.randn(numel, dtype=dtype, device=device)
        s = _mean_over_ranks(time_fn(lambda: torch.add(a, b), device, min_time_s, 2000, group=_world()))
        rows.append({"op": "add", "numel": numel, "bytes": 3 * numel * a.element_size(), "seconds": s})
    x = torch.randn(64, dtype=dtype, device=device, requires_grad=True)

    def fwd_bwd():
        torch.nn.functional.gelu(x).sum().backward()

    # gelu + sum forward, their two backward nodes and accumulation: about four ops
    s = _mean_over_ranks(time_fn(fwd_bwd, device, min_time_s, 2000, group=_world()))
    rows.append({"op": "autograd", "numel": 64, "bytes": 0, "ops": 4, "seconds": s / 4})
    return rows


COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")

WARMUP_STEPS = 2  # steps before the recorded ones: as many as validation leaves out of a run (calibration/validate.py)


def per_step(values: list[float]) -> float:
    """What an op costs per step, from its times in the recorded steps: their mean. The twin sums its
    ops into an iteration, and the mean of a sum is the sum of the means, whatever the shape of each
    op's spread (a run's iteration, the median of its step times, each a sum of hundreds of ops, is
    close to their mean). The upper median of 4 that bench took before is not: summed over a kind's
    ops, it came out 1.02-1.14x the mean of the same 4 steps with gpt-small on 2x2x2x1 and 2x2x1x1
    at load 8-16, and 0.58-0.90x at load 12-18, where a few steps ran 2-4x long
    (`python benchmarks/cpu_step_spread.py GRID` prints it; loaded machine)."""
    return sum(values) / len(values)


def bench_steps(model: str, ctx, batch: int | None = None, steps: int = 4,
                warmup: int = WARMUP_STEPS) -> tuple[dict | None, list[dict]]:
    """`steps` recorded training steps of `model` on the grid of `ctx` (every rank at once, as in
    `backend run`): what the microbenchmarks cannot see, measured where it happens.

    Returns (host row, step rows):
    - host {op: "host", model, ops, seconds, mean_s, all_gaps_s, free_mean_s}: the executor's host
      time per compute op, the median gap between consecutive compute ops of each step's compute
      stream during which no collective of the rank was in flight (a gap that holds a collective,
      often a wait for it, is communication, which the twin charges apart; on a tensor-parallel grid
      most gaps hold one), median over steps, mean over ranks. free_mean_s: the mean of those gaps
      (what they sum to per op: a few are long, when more ranks than cores time-slice);
      all_gaps_s: the median of every gap; mean_s: the mean gap;
    - one row per program op {name, kind, role, stream, axis, bytes, flops, m, n, k, layout, seconds,
      covered, cpu_s (compute ops on CPU), wake_s (collectives)}: its span, mean over steps
      (`per_step`) and over ranks; `cpu_s`, the same of its on-CPU time (the recorder's cpu_us: where more ranks
      than cores time-slice, a rank descheduled inside an op leaves that op's span long and its
      on-CPU time as it was; the fit spreads the ranks' summed waits over their ops, as validation
      does); `covered`,
      the median fraction of a compute op's span during which a collective of its rank was in flight
      (0 for collectives). A collective's span runs from its issue (or the end of the previous one of
      its stream) to its completion, so it holds the wait for the group's last member. `wake_s`: from
      its completion to the start of the compute op that waited for it (the next compute op, where
      this collective completed last in the gap before it; 0 where no compute op waited): the rank's
      thread wakes up after gloo's, which takes a time slice when more ranks than cores share the node.
    (None, []) when the backend has no program executor."""
    try:
        import backend.executor  # noqa: F401  (the program executor: before it, no such gaps to measure)
        from backend.model import make_model
        from backend.optim import make_optimizer, train_step
        from backend.recorder import NULL_RECORDER, Recorder
    except ImportError:
        return None, []
    spec = load_model(model)
    program = build_program(spec, ctx.grid, Options(), batch=batch)
    net = make_model(spec, ctx, program=program).to(ctx.device)
    opt = make_optimizer(net)
    seqs = program.batch // ctx.batch_shards
    gen = torch.Generator().manual_seed(ctx.rank)
    gaps: list[float] = []
    free: list[float] = []  # gaps no collective overlapped
    per_op: dict[str, list[float]] = {}
    per_cpu: dict[str, list[float]] = {}  # compute op -> on-CPU seconds (CPU only)
    cover: dict[str, list[float]] = {}
    wake: dict[str, list[float]] = {}  # collective -> delay from its completion to the compute op that waited on it
    for step in range(warmup + steps):
        tokens = torch.randint(0, spec.vocab, (seqs, program.seq_len + 1), generator=gen)
        rec = Recorder(device=ctx.device) if step >= warmup else NULL_RECORDER
        train_step(net, opt, [(tokens[:, :-1], tokens[:, 1:])], recorder=rec)
        if step < warmup:
            continue
        spans = rec.spans(ctx.rank)
        comp = sorted((sp for sp in spans if sp.stream == "compute"), key=lambda sp: sp.start_s)
        colls = [sp for sp in spans if sp.kind in COLLECTIVE_KINDS]
        waited: dict[str, float] = {}
        for a, b in zip(comp, comp[1:]):
            gap = max(0.0, b.start_s - (a.start_s + a.duration_s))
            gaps.append(gap)
            if gap > 0 and covered_share(Span(ctx.rank, "gap", "gap", "compute", a.start_s + a.duration_s, gap), colls) == 0:
                free.append(gap)
            # the collective that completed last inside the gap is the one the compute op waited for
            done = [c for c in colls if a.start_s + a.duration_s < c.start_s + c.duration_s <= b.start_s]
            if done:
                last = max(done, key=lambda c: c.start_s + c.duration_s)
                waited[last.name] = b.start_s - (last.start_s + last.duration_s)
        for sp in spans:
            per_op.setdefault(sp.name, []).append(sp.duration_s)
            if "cpu_us" in sp.args:
                per_cpu.setdefault(sp.name, []).append(sp.args["cpu_us"] / 1e6)
            cover.setdefault(sp.name, []).append(0.0 if sp.kind in COLLECTIVE_KINDS else covered_share(sp, colls))
            if sp.kind in COLLECTIVE_KINDS:
                wake.setdefault(sp.name, []).append(waited.get(sp.name, 0.0))
    net.recorder = NULL_RECORDER
    rows = []
    for op in program.ops:  # the same ops on every rank (one program): agree op by op, in program order
        cov = sorted(cover.get(op.name, [0.0]))
        rows.append({"name": op.name, "kind": op.kind, "role": op.role, "stream": op.stream,
                     "axis": op.axis or "", "bytes": op.bytes, "flops": op.flops, "m": op.m, "n": op.n,
                     "k": op.k, "layout": op.layout or "", "seconds": per_step(per_op.get(op.name, [0.0])),
                     "covered": cov[len(cov) // 2], "wake_s": per_step(wake.get(op.name, [0.0])),
                     # -1: not recorded (a collective, a GPU)
                     "cpu_s": per_step(per_cpu.get(op.name, [-1.0]))})
    group = _world()
    if group is not None:
        t = torch.tensor([[r["seconds"], r["covered"], r["wake_s"], r["cpu_s"]] for r in rows], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t /= dist.get_world_size()
        for r, (sec, cov, woke, on_cpu) in zip(rows, t.tolist()):
            r["seconds"], r["covered"], r["wake_s"], r["cpu_s"] = sec, cov, woke, on_cpu
    for r in rows:
        if r["kind"] not in COLLECTIVE_KINDS:
            del r["wake_s"]
        if r["kind"] in COLLECTIVE_KINDS or r["cpu_s"] < 0:
            del r["cpu_s"]
        else:
            r["cpu_s"] = min(r["cpu_s"], r["seconds"])
    rows = [r for r in rows if r["seconds"] > 0]
    if not gaps:
        return None, rows
    gaps.sort()
    free.sort()
    median, mean = gaps[len(gaps) // 2], sum(gaps) / len(gaps)
    # every rank must take part in the means below: a rank without free gaps uses all of them
    host_s = free[len(free) // 2] if len(free) >= 5 else median
    free_mean = sum(free) / len(free) if len(free) >= 5 else mean
    host = {"op": "host", "numel": 0, "bytes": 0, "model": model, "ops": len(free) if len(free) >= 5 else len(gaps),
            "seconds": _mean_over_ranks(host_s), "mean_s": _mean_over_ranks(mean),
            "all_gaps_s": _mean_over_ranks(median), "free_mean_s": _mean_over_ranks(free_mean)}
    return host, rows


def bench_attention(m: int, n: int, k: int, fwd_flops: float, bwd_flops: float, dtype: torch.dtype,
                    device: torch.device, min_time_s: float = 0.2) -> dict:
    """Causal attention as the backend runs it (scaled_dot_product_attention) on m = sequences x heads
    rows of n tokens with head size k, every rank at once: forward alone, and forward + backward
    (backward = the difference). flops: the program's count (twin.program)."""
    import torch.nn.functional as F
    q, kk, v = (torch.randn(1, m, n, k, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, m, n, k, dtype=dtype, device=device)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, kk, v, is_causal=True)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, kk, v, is_causal=True).backward(grad)

    f = _mean_over_ranks(time_fn(fwd, device, min_time_s, group=_world()))
    fb = _mean_over_ranks(time_fn(fwd_bwd, device, min_time_s, group=_world()))
    return {"m": m, "n": n, "k": k, "fwd_flops": fwd_flops, "bwd_flops": bwd_flops, "fwd_s": f,
            "bwd_s": max(fb - f, 1e-9)}


def program_attention_shapes(model: str, grid: Grid, all_grids: bool = False,
                             batch: int | None = None) -> list[tuple[int, int, int, float, float]]:
    """The distinct attention ops (m, n, k, forward flops, backward flops) of the program(s)."""
    seen: dict[tuple, None] = {}
    for g in grids_of(model, grid.size, batch) if all_grids else [grid]:
        ops = build_program(load_model(model), g, Options(recompute=False), batch=batch).ops
        fwd = next((op for op in ops if op.kind == "attention" and not op.name.endswith(".bwd")), None)
        bwd = next((op for op in ops if op.kind == "attention" and op.name.endswith(".bwd")), None)
        if fwd is not None and bwd is not None:
            seen[(fwd.m, fwd.n, fwd.k, fwd.flops, bwd.flops)] = None
    return list(seen)


def bench_collective(comm, kind: str, axis: str, nbytes: int, dtype: torch.dtype, device: torch.device,
                     min_time_s: float = 0.2) -> dict:
    """Time one collective of about `nbytes` real payload over `axis` through backend.comm
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
    seconds = _agree(seconds, _world(), dist.ReduceOp.MAX)
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
    group = _world()
    alone = _mean_over_ranks(time_fn(lambda: torch.mm(a, b), device, min_time_s, group=group))
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
    with_comm = _mean_over_ranks(gemm_s[len(gemm_s) // 2])
    row = {"m": m, "n": n, "k": k, "axis": axis, "bytes": buf.numel() * buf.element_size(),
           "alone_s": alone, "overlapped_s": with_comm, "slowdown": with_comm / alone}
    # every rank takes part in the means (a rank whose callbacks never ran reports its wait instead)
    comm_s.sort()
    beside = comm_s[len(comm_s) // 2] if comm_s else with_comm
    row.update(comm_alone_s=_mean_over_ranks(comm_alone), comm_overlapped_s=_mean_over_ranks(beside))
    return row


def grids_of(model: str, ranks: int, batch: int | None = None) -> list[Grid]:
    """Every grid with `ranks` ranks that runs `model` (at `batch` sequences)."""
    spec = load_model(model)
    out = []
    for x in range(1, ranks + 1):
        for y in range(1, ranks // x + 1):
            for z in range(1, ranks // (x * y) + 1):
                if ranks % (x * y * z):
                    continue
                g = Grid(x, y, z, ranks // (x * y * z))
                try:
                    g.validate(spec, gpus=ranks, batch=batch)
                except TwinError:
                    continue
                out.append(g)
    return out


def program_gemm_shapes(model: str, grid: Grid, all_grids: bool = False,
                        batch: int | None = None) -> list[tuple[int, int, int, str]]:
    """The distinct local GEMM shapes (m, n, k, layout) of the program of `model` on `grid` (or on
    every valid grid with as many ranks)."""
    seen: dict[tuple, None] = {}
    for g in grids_of(model, grid.size, batch) if all_grids else [grid]:
        prog = build_program(load_model(model), g, Options(), batch=batch)
        for op in prog.ops:
            if op.kind == "gemm":
                seen[(op.m, op.n, op.k, op.layout)] = None
    return list(seen)


def _git_commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info(device: torch.device) -> dict:
    """Where and when the measurement was taken, with what."""
    import numpy
    info = {"host": socket.gethostname(), "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "numpy": numpy.__version__, "commit": _git_commit(), "cores": os.cpu_count(),
            "threads_per_rank": torch.get_num_threads()}
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = _cpu_model() or platform.processor() or platform.machine()
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def main(config: dict) -> None:
    """The `bench` job (one rank). config: model, grid, device, dtype, squares, sizes_mib, layouts
    ("program" or "all"), all_grids, gemm, comm, ops, overlap, steps (recorded training steps, 0: none),
    min_time_s, batch, out."""
    from backend.comm import Comm
    from backend.dist import ParallelContext, destroy
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
    min_t = float(config.get("min_time_s", 0.2))
    ctx = ParallelContext.from_env(grid, backend="nccl" if device.type == "cuda" else "gloo")
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        result = {"format": FORMAT, "machine": machine_info(device), "model": config.get("model") or "",
                  "grid": str(grid), "ranks": world, "ranks_per_node": local, "dtype": config["dtype"],
                  "dtype_bytes": torch.tensor([], dtype=dtype).element_size(),
                  "gemm": [], "attention": [], "ops": [], "collectives": [], "overlap": [], "steps": []}
        if config.get("gemm", True):
            shapes = [(s, s, s, lay) for s in config.get("squares", []) for lay in LAYOUTS]
            if config.get("model"):
                prog = program_gemm_shapes(config["model"], grid, bool(config.get("all_grids")),
                                           config.get("batch"))
                if config.get("layouts", "all") == "all":
                    shapes += [(m, n, k, lay) for m, n, k in dict.fromkeys((m, n, k) for m, n, k, _ in prog)
                               for lay in LAYOUTS]
                else:
                    shapes += prog
            for m, n, k, lay in dict.fromkeys(shapes):
                row = bench_gemm(m, n, k, lay, dtype, device, min_t)
                result["gemm"].append(row)
                _say(rank, f"gemm {m}x{n}x{k} {lay}: {row['seconds'] * 1e6:.1f} us, {row['tflops'] * 1e3:.2f} GF/s")
        if config.get("gemm", True) and config.get("model"):
            for m, n, k, ff, bf in program_attention_shapes(config["model"], grid, bool(config.get("all_grids")),
                                                            config.get("batch")):
                row = bench_attention(m, n, k, ff, bf, dtype, device, min_t)
                result["attention"].append(row)
                _say(rank, f"attention {m}x{n}x{k}: forward {row['fwd_s'] * 1e6:.0f} us, backward {row['bwd_s'] * 1e6:.0f} us")
        if config.get("ops", True):
            result["ops"] = bench_ops(dtype, device, min_t)
            for row in result["ops"]:
                _say(rank, f"op {row['op']} ({row['numel']} elements): {row['seconds'] * 1e6:.1f} us")
        if config.get("model") and int(config.get("steps", 4)) > 0:
            row, result["steps"] = bench_steps(config["model"], ctx, config.get("batch"), int(config.get("steps", 4)))
            if row is not None:
                result["ops"].append(row)
                _say(rank, f"executor host time per compute op ({row['model']}): median {row['seconds'] * 1e6:.1f} us,\n"
                           f"  mean {row['mean_s'] * 1e6:.1f} us over {row['ops']} gaps per rank (no collective in flight)")
            by_kind: dict[str, float] = {}
            for r in result["steps"]:
                by_kind[r["kind"]] = by_kind.get(r["kind"], 0.0) + r["seconds"]
            _say(rank, f"{len(result['steps'])} ops of a training step, time by kind:\n"
                       + "\n".join(f"  {k:<15} {v * 1e3:9.1f} ms" for k, v in sorted(by_kind.items())))
        comm = Comm(ctx)
        axes = [a for a in AXES if grid.axis_size(a) > 1]
        if config.get("comm", True):
            for axis in axes:
                for mib in config.get("sizes_mib", [0.0625, 1, 16]):
                    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                        row = bench_collective(comm, kind, axis, int(mib * 2**20), dtype, device, min_t)
                        result["collectives"].append(row)
                        _say(rank, f"{kind} over {axis} ({row['group_size']} ranks) {row['bytes']} B: "
                                   f"{row['seconds'] * 1e6:.0f} us, busbw {row['busbw_gbps']:.3f} GB/s")
        if config.get("overlap", True) and axes and result["gemm"]:
            big = max(result["gemm"], key=lambda r: r["m"] * r["n"] * r["k"])
            for axis in axes:
                row = bench_overlap(comm, axis, big["m"], big["n"], big["k"], dtype, device, min_time_s=min_t)
                result["overlap"].append(row)
                _say(rank, f"gemm {big['m']}x{big['n']}x{big['k']} under an all-reduce over {axis}: "
                           f"{row['slowdown']:.2f}x slower")
        if rank == 0:
            out = Path(config["out"])
            out.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(out, json.dumps(result, indent=1))
            print(f"wrote {out}", flush=True)
    finally:
        destroy()
        sys.stdout.flush()


def peak_memory(fn, *modules_and_optimizers) -> tuple[object, int]:
    """Run `fn()` under torch's memory tracker; (its result, peak bytes this rank held on its device).

    The parameters, gradients and optimizer states of `modules_and_optimizers` count from the start,
    so the peak is everything the rank holds, not only what `fn` allocates.
    """
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(*modules_and_optimizers)
    with tracker:
        out = fn()
    peak = tracker.get_tracker_snapshot("peak")
    return out, int(sum(v.get("Total", 0) for v in peak.values()))
