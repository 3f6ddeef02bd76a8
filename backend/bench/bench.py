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
  `host` {op: "host", model, ops, mean_s, seconds, free_mean_s, step_s}: the executor's host time per
  compute op, the median (and mean: free_mean_s) gap between consecutive compute ops with no
  collective in flight, in a few training steps of the model on the grid (what the rank's Python
  spends between kernels: dispatch, buffer bookkeeping, issuing collectives), and step_s, the mean
  wall time of those steps (what the ops' replay through the twin's engine is checked against);
- `collectives` rows {axis, kind, group_size, stride, bytes, seconds, algbw_gbps, busbw_gbps}, run
  through backend.runtime.comm exactly as training runs them (gloo's reduce-scatter is an all-reduce);
  bytes are the real payload (all-gather: the gathered output), every group of the axis at once;
- `overlap` rows {m, n, k, axis, alone_s, overlapped_s, slowdown, comm_alone_s, comm_overlapped_s}:
  a GEMM alone and while an all-reduce runs on the axis, and the all-reduce alone and beside the GEMM
  (issue to completion): what each costs the other when they share the rank's cores;
- `steps` rows {name, kind, role, stream, axis, bytes, flops, m, n, k, layout, seconds, covered,
  cpu_s, wake_s, issue_s}: every op of the model's program as a few recorded training steps on the grid ran it
  (mean span over the steps; on CPU, a compute op's on-CPU time too), with the share of a compute op's span that
  a collective overlapped, and for a
  collective the time the compute op that waited for it took to start after its completion and the
  host's time issuing it: what ops
  cost inside training, where the ranks share the cores with each other and with gloo's threads (see
  backend.bench.steps).
Bandwidths follow nccl-tests: algbw = payload / time; busbw = algbw * 2(p-1)/p for all-reduce and
(p-1)/p for all-gather and reduce-scatter (GB/s = 1e9 B/s).

This module runs the job and writes the file; the benchmarks are in backend.bench.micro, the recorded
training steps in backend.bench.steps, the timing loop in backend.bench.timing.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch

from backend.bench.micro import bench_attention, bench_collective, bench_gemm, bench_ops, bench_overlap
from backend.bench.shapes import program_attention_shapes, program_gemm_shapes
from backend.bench.steps import bench_steps
from topologies.common import cpu_model, finite_json, write_atomic
from topologies.common import TwinError
from twin.program.grid import AXES, Grid

LAYOUTS = ("NN", "NT", "TN")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMAT = "backend-bench/2"


def _git_commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[2]
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
            "threads_per_rank": torch.get_num_threads(), "cpu_bind": os.environ.get("BACKEND_CPU_BIND", "none")}
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = cpu_model() or platform.processor() or platform.machine()
    return info


VERBOSE = [True]  # a line per timed entry (off under `backend bench --for-twin`, which prints one per grid)


def _say(rank: int, text: str) -> None:
    if rank == 0 and VERBOSE[0]:
        print(text, flush=True)


def main(config: dict) -> None:
    """The `bench` job (one rank). config: model, grid, device, dtype, squares, sizes_mib, layouts
    ("program" or "all"), all_grids, gemm, comm, ops, overlap, steps (recorded training steps, 0: none),
    min_time_s, batch, out."""
    from backend.runtime.comm import Comm
    from backend.runtime.dist import ParallelContext, destroy
    from backend.launch.env import env_rank
    rank, local_rank, world = env_rank()
    VERBOSE[0] = bool(config.get("verbose", True))
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
            write_atomic(out, finite_json(result, indent=1))
            _say(rank, f"wrote {out}")
    finally:
        if not config.get("keep_process_group"):  # `--for-twin` under a launcher: its next grid reuses it
            destroy()
        sys.stdout.flush()
