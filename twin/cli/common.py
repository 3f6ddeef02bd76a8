"""What every `twin` command shares: the console it prints to, one-line errors, and the options
that several commands take (system, model, GPUs, grid, placement, profile, quiet)."""

from __future__ import annotations

import functools
from typing import Annotated, Optional

import typer

from topologies.common import TwinError
from twin.present.tables import Printer

console = Printer()  # every command module prints through this one object; a test sets its width


def handles_errors(fn):
    """Turn a TwinError (or a missing/unreadable file) into one line on stderr and exit code 2, and
    Ctrl-C into one line "interrupted" and exit code 130 (no traceback; the bar stays where it was)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (TwinError, OSError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted (Ctrl-C): files written before stay as they were", err=True)
            raise typer.Exit(130) from None

    return wrapper


QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar on stderr.")]
SystemOpt = Annotated[str, typer.Option("--system", "-s", help="System name (see `twin systems`) or a system .toml file.")]
StudyModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Model name or .toml file (default: the system's default study).")]
GpusOpt = Annotated[Optional[int], typer.Option(help="GPU count (default: the system's default study).")]
PlacementOpt = Annotated[str, typer.Option(help="Rank placement: contiguous or scattered nodes.")]
AutoGridOpt = Annotated[str, typer.Option("--grid", "-g", help="4D grid XxYxZxD, or auto (analytical ranking, best few simulated).")]
ProfileOpt = Annotated[Optional[str], typer.Option(help="Kernel profile name or .toml (default: by the system's GPU).")]
FullOpt = Annotated[bool, typer.Option("--full", help="Simulate every rank (default: one representative).")]
SlowdownOpt = Annotated[Optional[str], typer.Option(help="Stragglers for --full: RANK:FACTOR[,...] on compute times.")]
