"""Replay: the training executor on random weights and random tokens, for timing a program without a
model checkpoint or data.

It is `backend run`'s executor (backend/runtime/executor.py) running the same program op by op (GEMMs,
attention, normalization, collectives, the optimizer), only the weights are random and each step's
tokens are drawn uniformly. Every op is recorded under its program name; the last iteration is
written as a Chrome trace (twin.program.trace schema) gathered on rank 0.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from backend.training.train import check_run_flags
from topologies.common import TwinError
from twin.program.flags import options_from_flags
from twin.program.grid import Grid
from twin.program.model import load_model
from twin.program.program import Options, Program, build_program

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class ReplayConfig:
    """What to replay: the program of (model, grid, options, batch), or a program file, `steps` times."""

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
    program_file: str | None = None

    def options(self) -> Options:
        return options_from_flags(self.oar, self.ors, self.oag, self.cache_layers, self.recompute,
                                  self.micro_batches)

    def program(self) -> Program:
        if self.program_file:
            from twin.program.programfile import load_program
            return load_program(self.program_file)
        return build_program(load_model(self.model), Grid.parse(self.grid), self.options(), batch=self.batch)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device == "cuda" else torch.float32
        return DTYPES[self.dtype]


def validate(cfg: ReplayConfig) -> None:
    """Check a replay config before any rank starts (raises TwinError)."""
    program = cfg.program()
    check_run_flags(cfg.steps, cfg.batch, cfg.device, program.grid.size)
    if cfg.dtype not in ("auto", *DTYPES):
        raise TwinError(f"--dtype must be auto, fp32 or bf16, got {cfg.dtype!r}")
    from backend.launch.env import check_memory
    check_memory(program, cfg.device, cfg.torch_dtype().itemsize)


def main(config: dict) -> None:
    """The `replay` job of one rank (see backend.launch.launcher)."""
    from backend.runtime.dist import ParallelContext, destroy
    from backend.launch.env import check_world_size
    from backend.models.build import make_model
    from backend.training.optim import make_optimizer, micro_batches, train_step
    from backend.runtime.recorder import NULL_RECORDER, Recorder
    from twin.program.trace import write_trace

    cfg = ReplayConfig(**config)
    program = cfg.program()
    grid, spec = program.grid, program.model
    check_world_size(grid.size, str(grid))
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TwinError("--device cuda but no CUDA device is visible to PyTorch")
    ctx = ParallelContext.from_env(grid, backend="nccl" if cfg.device == "cuda" else "gloo")
    try:
        ctx.dtype = cfg.torch_dtype()
        model = make_model(spec, ctx, seed=ctx.rank, program=program)
        optimizer = make_optimizer(model)
        gen = torch.Generator().manual_seed(1 + ctx.batch_shard)
        local = program.batch // ctx.batch_shards
        recorder = NULL_RECORDER
        for step in range(1, cfg.steps + 1):
            tokens = torch.randint(0, spec.vocab, (local, program.seq_len + 1), generator=gen).to(ctx.device)
            batches = micro_batches(tokens[:, :-1], tokens[:, 1:], program.options.micro_batches)
            recorder = Recorder(enabled=True, device=ctx.device) if step == cfg.steps else NULL_RECORDER
            dist.barrier()
            recorder.reset()
            t0 = time.perf_counter()
            train_step(model, optimizer, batches, recorder=recorder)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if ctx.rank == 0:
                print(f"replay {step}/{cfg.steps}: {seconds * 1e3:.2f} ms ({len(program.ops)} program ops)",
                      flush=True)
        spans = recorder.spans(ctx.rank, program)
        gathered = [None] * grid.size if ctx.rank == 0 else None
        dist.gather_object(spans, gathered, dst=0)
        if ctx.rank == 0:
            out = Path(cfg.out)
            write_trace(out, [s for part in gathered for s in part],
                        {"source": "backend replay", "model": spec.name, "grid": str(grid),
                         "device": str(ctx.device), "dtype": str(cfg.torch_dtype()).removeprefix("torch."),
                         "options": asdict(program.options)}, step=cfg.steps, world_size=grid.size,
                        backend="nccl" if ctx.device.type == "cuda" else "gloo")
            print(f"wrote {out}", flush=True)
    finally:
        destroy()
