"""What every `backend` command shares: one-line errors and exit codes, the launcher's world-size
check, the program file's grid, and the options that several commands take."""

from __future__ import annotations

import functools
from typing import Annotated, Optional

import typer

from topologies.common import TwinError
from twin.program.grid import Grid


def handles_errors(fn):
    """Turn bad input (TwinError, a missing file) into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            code = fn(*args, **kwargs)
        except (TwinError, OSError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        if code:
            raise typer.Exit(code if code > 0 else 1)

    return wrapper


def check_launcher_world(grid: Grid) -> None:
    """Under torchrun or srun: the launcher's world size must be the grid's rank count (TwinError if not)."""
    from backend.launch.env import check_world_size
    check_world_size(grid.size, str(grid))


DeviceOpt = Annotated[str, typer.Option(help="cpu (gloo) or cuda (NCCL/RCCL).")]
ProgramOpt = Annotated[Optional[str], typer.Option(help="Run this program file (`twin program --json-out FILE`): it fixes the model, grid, batch and switches.")]
DtypeOpt = Annotated[str, typer.Option(help="GEMM precision: fp32, bf16 or fp16.")]
InitFromOpt = Annotated[Optional[str], typer.Option(help="Start from the weights of this Hugging Face Llama directory (config.json and *.safetensors); its config is the model.")]


def program_grid(program_file: str | None, grid: str) -> str:
    """The grid to launch: the program file's (validated here, before any rank starts) or --grid."""
    if not program_file:
        return grid
    from twin.program.programfile import load_program
    loaded = load_program(program_file)
    return str((loaded[0] if isinstance(loaded, list) else loaded).grid)  # a pipelined grid's file: its stages
