"""The shapes that backend.bench.micro times, read from the model's program (no torch: `backend bench
--for-twin --plan-only` and its estimate need them without starting a rank): the grids of a rank count
that run a model, the distinct GEMM and attention shapes of their programs, the elementwise sizes."""

from __future__ import annotations

from twin.predict.search import grids_that_run
from twin.program.grid import Grid
from twin.program.model import load_model
from twin.program.program import Options, build_program

OP_SIZES = (1, 4096, 65536, 1 << 20)  # elements of the elementwise-op benchmark


def grids_of(model: str, ranks: int, batch: int | None = None) -> list[Grid]:
    """Every grid with `ranks` ranks that runs `model` (at `batch` sequences)."""
    return grids_that_run(load_model(model), ranks, batch)


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
