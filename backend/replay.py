"""Replay: execute the twin's program op by op with random tensors, for timing without a model.

Every GEMM of the program runs with random operands of its shape and layout; every collective runs
on its axis group with a buffer of its payload (bytes / element size), issued asynchronously so that
the communication streams overlap compute as the program says: an op first waits for the collectives
among its dependencies, ops on one stream run in program order. Attention, elementwise, embedding,
loss and optimizer ops are not executed (they are not GEMMs or collectives) and do not appear in the
trace. Each executed op is recorded under its program name like the real run (backend.recorder), and
the last iteration is written as a Chrome trace (twin.trace schema) gathered on rank 0.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from backend.train import check_run_flags
from twin.common import TwinError
from twin.grid import Grid
from twin.model import load_model
from twin.flags import options_from_flags
from twin.program import Op, Options, Program, build_program

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class ReplayConfig:
    """What to replay: the program of (model, grid, options, batch) on `device`, `steps` times."""

    model: str = "gpt-tiny"
    grid: str = "1x1x1x1"
    steps: int = 2
    batch: int | None = None
    micro_batches: int = 1
    oar: bool = True
    ors: bool = True
    oag: bool = True
    cache_layers: int = 0
    recompute: bool = True
    out: str = "runs/replay-trace"
    device: str = "cpu"
    dtype: str = "auto"  # auto: bf16 on cuda, fp32 on cpu

    def options(self) -> Options:
        return options_from_flags(self.oar, self.ors, self.oag, self.cache_layers, self.recompute,
                                  self.micro_batches)

    def program(self) -> Program:
        return build_program(load_model(self.model), Grid.parse(self.grid), self.options(), batch=self.batch)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device == "cuda" else torch.float32
        return DTYPES[self.dtype]


def validate(cfg: ReplayConfig) -> None:
    """Check a replay config before any rank starts (raises TwinError)."""
    check_run_flags(cfg.steps, cfg.batch, cfg.device, Grid.parse(cfg.grid).size)
    if cfg.dtype not in ("auto", *DTYPES):
        raise TwinError(f"--dtype must be auto, fp32 or bf16, got {cfg.dtype!r}")
    cfg.program()


class Replayer:
    """Runs a program's GEMMs and collectives on one rank (see the module docstring)."""

    def __init__(self, program: Program, ctx, dtype: torch.dtype, recorder):
        self.program, self.ctx, self.dtype, self.recorder = program, ctx, dtype, recorder
        self.operands: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.buffers: dict[tuple, torch.Tensor] = {}

    def _gemm_operands(self, op: Op) -> tuple[torch.Tensor, torch.Tensor]:
        key = (op.m, op.n, op.k, op.layout)
        if key not in self.operands:
            from backend.bench import gemm_operands
            self.operands[key] = gemm_operands(op.m, op.n, op.k, op.layout or "NN", self.dtype, self.ctx.device)
        return self.operands[key]

    def _buffer(self, numel: int, tag: str) -> torch.Tensor:
        key = (numel, tag)
        if key not in self.buffers:
            self.buffers[key] = torch.ones(numel, dtype=self.dtype, device=self.ctx.device)
        return self.buffers[key]

    def _collective(self, op: Op):
        """Issue `op` asynchronously; returns (work, record)."""
        p = self.ctx.size(op.axis)
        group = self.ctx.groups[op.axis]
        elsize = torch.finfo(self.dtype).bits // 8
        numel = max(p, op.bytes // elsize // p * p)
        rec = self.recorder.begin(op.name, op.kind, op.stream, axis=op.axis, bytes=op.bytes,
                                  actual_bytes=numel * elsize, index=op.index)
        full = self._buffer(numel, "full")
        if op.kind == "all_reduce":
            work = dist.all_reduce(full, group=group, async_op=True)
        elif op.kind == "all_gather":
            work = _all_gather(full, self._buffer(numel // p, "part"), group=group, async_op=True)
        elif self.ctx.backend == "gloo":  # gloo has no reduce-scatter: all-reduce, as backend.comm does
            work = dist.all_reduce(full, group=group, async_op=True)
        else:
            work = _reduce_scatter(self._buffer(numel // p, "part"), full, group=group, async_op=True)
        return work, rec

    def iteration(self) -> None:
        """One pass over the program."""
        pending: dict[int, tuple] = {}

        def wait(index: int) -> None:
            if index in pending:
                work, rec = pending.pop(index)
                work.wait()
                self.recorder.end(rec)

        for op in self.program.ops:
            for d in op.deps:
                wait(d)
            if op.is_collective:
                pending[op.index] = self._collective(op)
            elif op.kind == "gemm":
                a, b = self._gemm_operands(op)
                with self.recorder.op(op.name, "gemm", "compute", bytes=op.bytes, m=op.m, n=op.n, k=op.k,
                                      layout=op.layout, index=op.index, flops=op.flops):
                    torch.mm(a, b)
        for index in list(pending):
            wait(index)


def main(config: dict) -> None:
    """The `replay` job of one rank (see backend.launch)."""
    from backend.dist import ParallelContext, destroy
    from backend.launch import check_world_size
    from backend.recorder import NULL_RECORDER, Recorder
    from twin.trace import write_trace

    cfg = ReplayConfig(**config)
    program = cfg.program()
    grid = program.grid
    check_world_size(grid.size, cfg.grid)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TwinError("--device cuda but no CUDA device is visible to PyTorch")
    ctx = ParallelContext.from_env(grid, backend="nccl" if cfg.device == "cuda" else "gloo")
    try:
        replayer = Replayer(program, ctx, cfg.torch_dtype(), NULL_RECORDER)
        for step in range(1, cfg.steps + 1):
            last = step == cfg.steps
            replayer.recorder = Recorder(enabled=True, device=ctx.device) if last else NULL_RECORDER
            dist.barrier()
            replayer.recorder.reset()
            t0 = time.perf_counter()
            replayer.iteration()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if ctx.rank == 0:
                print(f"replay {step}/{cfg.steps}: {seconds * 1e3:.2f} ms ({len(program.ops)} program ops)",
                      flush=True)
        spans = replayer.recorder.spans(ctx.rank, program)
        gathered = [None] * grid.size if ctx.rank == 0 else None
        dist.gather_object(spans, gathered, dst=0)
        if ctx.rank == 0:
            out = Path(cfg.out)
            write_trace(out, [s for part in gathered for s in part],
                        {"source": "backend replay", "model": cfg.model, "grid": str(grid),
                         "device": str(ctx.device), "dtype": str(cfg.torch_dtype()).removeprefix("torch."),
                         "options": asdict(cfg.options())}, step=cfg.steps, world_size=grid.size,
                        backend="nccl" if ctx.device.type == "cuda" else "gloo")
            print(f"wrote {out}", flush=True)
    finally:
        destroy()
