"""The command-line flags that `twin` and `backend` share, and their translation into `Options`.

Both apps declare these parameters with the types below, so that a switch has one name, one help
text and one check everywhere; `options_from_flags` is the one place flags become an `Options`.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer
import typer.core

try:  # typer >= 0.2x carries its own copy of click
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - older typer on click
    import click.exceptions as _cx

from topologies.common import TwinError, check_output
from twin.program.program import Options

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model name (see `twin models`) or a model .toml file.")]
GridOpt = Annotated[str, typer.Option("--grid", "-g", help="Grid XxYxZxD or, with P pipeline stages, XxYxZxPxD (x fastest), e.g. 8x8x4x128 or 8x8x4x2x64; its product is the number of GPUs (ranks).")]
BatchOpt = Annotated[Optional[int], typer.Option(help="Global batch in sequences (default: the model's).")]
SeqOpt = Annotated[Optional[int], typer.Option(help="Sequence length in tokens (default: the model's).")]
OarOpt = Annotated[bool, typer.Option("--oar/--no-oar", help="Overlap the backward input-gradient all-reduce with the weight-gradient GEMM.")]
OrsOpt = Annotated[bool, typer.Option("--ors/--no-ors", help="Defer z reduce-scatters and overlap them with earlier layers' backward.")]
OagOpt = Annotated[bool, typer.Option("--oag/--no-oag", help="Prefetch the next layer's z all-gather one layer ahead.")]
CacheOpt = Annotated[int, typer.Option(help="Keep the gathered weights of the first N blocks for the whole step.")]
RecomputeOpt = Annotated[bool, typer.Option("--recompute/--no-recompute", help="Recompute each block's forward in the backward pass.")]
MicroOpt = Annotated[int, typer.Option(help="Micro-batches per step (gradient accumulation; the pipeline's micro-batches).")]
ScheduleOpt = Annotated[str, typer.Option(help="Pipeline schedule on a grid XxYxZxPxD: gpipe, 1f1b (needs P micro-batches) or interleaved (--chunks >= 2).")]
ChunksOpt = Annotated[int, typer.Option(help="Model chunks (virtual stages) per pipeline stage, for --schedule interleaved.")]
FrameworkOpt = Annotated[str, typer.Option(help="Whose schedule: axonn (the 4D algorithm) or megatron (Megatron-LM's: 1D tensor parallelism on y, grids 1xTx1xPxD, docs/megatron.md).")]


def options_from_flags(oar: bool = True, ors: bool = True, oag: bool = True, cache_layers: int = 0,
                       recompute: bool = True, micro_batches: int = 1, grad_clip: bool = True,
                       goldfish_h: int = 0, schedule: str = "1f1b", chunks: int = 1,
                       framework: str = "axonn") -> Options:
    """The switches of the 4D algorithm from the command line's flags (raises TwinError)."""
    if cache_layers < 0:
        raise TwinError(f"--cache-layers must be >= 0, got {cache_layers}")
    if micro_batches < 1:
        raise TwinError(f"--micro-batches must be at least 1, got {micro_batches}")
    schedule = schedule.strip().lower()
    if schedule not in ("gpipe", "1f1b", "interleaved"):
        raise TwinError(f"--schedule {schedule!r} is not one of gpipe, 1f1b, interleaved")
    if chunks < 1:
        raise TwinError(f"--chunks must be at least 1, got {chunks}")
    from twin.program.megatron import framework_options
    return framework_options(Options(oar=oar, ors=ors, oag=oag, cache_layers=cache_layers, recompute=recompute,
                                     micro_batches=micro_batches, grad_clip=grad_clip, goldfish_h=goldfish_h,
                                     schedule=schedule, chunks=chunks), framework)


class OneLineErrors(typer.core.TyperGroup):
    """A command group whose usage errors (unknown option, a value of the wrong type, a missing
    option) are one line on stderr and exit code 2, like every other bad input, instead of a box."""

    def main(self, *args, **kwargs):
        import sys

        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except _cx.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help(), err=True)
            sys.exit(2)
        except _cx.NoSuchOption as e:
            where = e.ctx.command_path if e.ctx is not None else self.name
            import difflib
            known = [o for p in (e.ctx.command.params if e.ctx is not None else []) for o in p.opts + p.secondary_opts]
            close = difflib.get_close_matches(e.option_name, known, n=2, cutoff=0.6)
            hint = f": did you mean {' or '.join(close)}?" if close else ""
            typer.echo(f"error: no such option {e.option_name}{hint} (see `{where} --help`)", err=True)
            sys.exit(2)
        except _cx.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else self.name
            typer.echo(f"error: {e.format_message()} (see `{where} --help`)", err=True)
            sys.exit(2)
        except _cx.ClickException as e:
            typer.echo(f"error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("error: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


def output_file(param: typer.CallbackParam, value):
    """typer callback: an output file path, checked (its folder created) before the command runs."""
    return _output(param, value, folder=False)


def output_folder(param: typer.CallbackParam, value):
    """typer callback: an output folder, created before the command runs."""
    return _output(param, value, folder=True)


def _output(param, value, folder: bool):
    if value is None:
        return None
    flag = param.opts[0] if param.opts else "output"
    try:
        return check_output(value, flag, folder=folder)
    except TwinError as e:
        raise typer.BadParameter(str(e).removeprefix(flag + " ").removeprefix(f"{value}: ")) from None
