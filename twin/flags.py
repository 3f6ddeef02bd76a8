"""The command-line flags that `twin` and `backend` share, and their translation into `Options`.

Both apps declare these parameters with the types below, so that a switch has one name, one help
text and one check everywhere; `options_from_flags` is the one place flags become an `Options`.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from twin.common import TwinError
from twin.program import Options

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model name (see `twin models`) or a model .toml file.")]
GridOpt = Annotated[str, typer.Option("--grid", "-g", help="4D grid XxYxZxD (x fastest), e.g. 8x8x4x128; its product is the number of GPUs (ranks).")]
BatchOpt = Annotated[Optional[int], typer.Option(help="Global batch in sequences (default: the model's).")]
SeqOpt = Annotated[Optional[int], typer.Option(help="Sequence length in tokens (default: the model's).")]
OarOpt = Annotated[bool, typer.Option("--oar/--no-oar", help="Overlap the backward input-gradient all-reduce with the weight-gradient GEMM.")]
OrsOpt = Annotated[bool, typer.Option("--ors/--no-ors", help="Defer z reduce-scatters and overlap them with earlier layers' backward.")]
OagOpt = Annotated[bool, typer.Option("--oag/--no-oag", help="Prefetch the next layer's z all-gather one layer ahead.")]
CacheOpt = Annotated[int, typer.Option(help="Keep the gathered weights of the first N blocks for the whole step.")]
RecomputeOpt = Annotated[bool, typer.Option("--recompute/--no-recompute", help="Recompute each block's forward in the backward pass.")]
MicroOpt = Annotated[int, typer.Option(help="Micro-batches per step (gradient accumulation).")]


def options_from_flags(oar: bool = True, ors: bool = True, oag: bool = True, cache_layers: int = 0,
                       recompute: bool = True, micro_batches: int = 1, grad_clip: bool = True,
                       goldfish_h: int = 0) -> Options:
    """The switches of the 4D algorithm from the command line's flags (raises TwinError)."""
    if cache_layers < 0:
        raise TwinError(f"--cache-layers must be >= 0, got {cache_layers}")
    if micro_batches < 1:
        raise TwinError(f"--micro-batches must be at least 1, got {micro_batches}")
    return Options(oar=oar, ors=ors, oag=oag, cache_layers=cache_layers, recompute=recompute,
                   micro_batches=micro_batches, grad_clip=grad_clip, goldfish_h=goldfish_h)
