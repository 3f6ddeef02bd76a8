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
        except TwinError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except OSError as e:  # a file that cannot be read or written: named, and why
            from topologies.common import os_error_line
            typer.echo(f"error: {os_error_line(e)}", err=True)
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
    return grid_of(load_program_file(program_file)) if program_file else grid


def grid_of(loaded) -> str:
    """The grid of a loaded program file (a pipelined grid's file is the list of its stages' programs)."""
    return str((loaded[0] if isinstance(loaded, list) else loaded).grid)


def load_program_file(program_file: str | None):
    """The program of --program, validated (with a bar on a terminal), or None without it; a
    pipelined grid's file gives the list of its stages' programs."""
    if not program_file:
        return None
    from twin.present.progress import load_program_shown
    loaded = load_program_shown(program_file)
    first = loaded[0] if isinstance(loaded, list) else loaded
    if first.options.framework != "axonn":  # its unfused attention and dropouts have no kernels here
        from topologies.common import InputError
        raise InputError(f"{program_file}: a {first.options.framework} program (twin --framework) is simulated by "
                         "the twin only; the backend runs the axonn program")
    return loaded


FIXED_BY_PROGRAM = ("model", "grid", "batch", "micro_batches", "oar", "ors", "oag", "cache_layers", "recompute",
                    "seq", "schedule", "chunks")  # the flags a program file fixes (as `twin simulate --program` refuses them)


def refuse_fixed(ctx, program_file: str | None) -> None:
    """With --program, refuse the flags the program fixes when given on the command line (TwinError)."""
    if not program_file or ctx is None:
        return
    given = [p for p in ctx.command.params if p.name in FIXED_BY_PROGRAM
             and getattr(ctx.get_parameter_source(p.name), "name", "") in ("COMMANDLINE", "ENVIRONMENT")]
    if given:
        flags = ", ".join(p.secondary_opts[0] if p.secondary_opts and ctx.params.get(p.name) is False else p.opts[0]
                          for p in given)
        raise TwinError(f"--program fixes the model, grid, batch and switches: leave out {flags}")
