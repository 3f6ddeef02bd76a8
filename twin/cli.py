"""The `twin` command: parses, calls the library, prints. Bad input exits 2 with one line."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from twin.errors import TwinError
from twin.grid import Grid
from twin.memory import GIB, check_fits, memory_per_gpu
from twin.model import list_models, load_model
from twin.program import Options, build_program

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="A digital twin of 4D-parallel LLM training: simulate, search, inspect.")
console = Console()


def handles_errors(fn):
    """Turn a TwinError (or a missing/unreadable file) into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (TwinError, OSError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None

    return wrapper


def not_implemented(what: str) -> None:
    typer.echo(f"error: `twin {what}` is not implemented yet", err=True)
    raise typer.Exit(1)


def write_file(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file, so a failure never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model name (see `twin models`) or a model .toml file.")]
GridOpt = Annotated[str, typer.Option("--grid", "-g", help="4D grid XxYxZxD (x fastest), e.g. 8x8x4x128.")]


def options_from_flags(oar: bool, ors: bool, oag: bool, cache_layers: int, recompute: bool,
                       micro_batches: int) -> Options:
    if cache_layers < 0:
        raise TwinError(f"--cache-layers must be >= 0, got {cache_layers}")
    return Options(oar=oar, ors=ors, oag=oag, cache_layers=cache_layers, recompute=recompute,
                   micro_batches=micro_batches)


@app.command("models")
@handles_errors
def models_cmd() -> None:
    """List the models that ship with the twin."""
    table = Table("model", "layers", "hidden", "heads", "vocab", "seq", "batch", "parameters")
    for name in list_models():
        m = load_model(name)
        table.add_row(name, str(m.layers), str(m.hidden), str(m.heads), str(m.vocab), str(m.seq_len),
                      str(m.global_batch), f"{m.parameters() / 1e9:.2f} B")
    console.print(table)


@app.command("program")
@handles_errors
def program_cmd(
    model: ModelOpt = "gpt-5b",
    grid: GridOpt = "2x2x2x64",
    gpus: Annotated[Optional[int], typer.Option(help="GPU count; must equal the grid's product.")] = None,
    batch: Annotated[Optional[int], typer.Option(help="Global batch in sequences (default: the model's).")] = None,
    seq: Annotated[Optional[int], typer.Option(help="Sequence length in tokens (default: the model's).")] = None,
    oar: Annotated[bool, typer.Option("--oar/--no-oar", help="Overlap backward all-reduce (y) with the dW GEMM.")] = True,
    ors: Annotated[bool, typer.Option("--ors/--no-ors", help="Overlap z reduce-scatters with earlier layers.")] = True,
    oag: Annotated[bool, typer.Option("--oag/--no-oag", help="Prefetch the next layer's z all-gather.")] = True,
    cache_layers: Annotated[int, typer.Option(help="Keep gathered weights of the first N blocks.")] = 0,
    recompute: Annotated[bool, typer.Option("--recompute/--no-recompute", help="Activation recomputation.")] = True,
    micro_batches: Annotated[int, typer.Option(help="Gradient accumulation steps.")] = 1,
    hbm_gib: Annotated[Optional[float], typer.Option(help="GPU memory (GiB) to check the fit against; off by default.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the whole program (every op) as JSON here.")] = None,
) -> None:
    """Build the schedule of one iteration for one rank and print its summary."""
    spec = load_model(model)
    g = Grid.parse(grid)
    opts = options_from_flags(oar, ors, oag, cache_layers, recompute, micro_batches)
    g.validate(spec, gpus=gpus, batch=batch, micro_batches=micro_batches, seq_len=seq)
    mem = memory_per_gpu(spec, g, opts, batch, seq)
    if hbm_gib is not None:
        check_fits(mem, hbm_gib * GIB, f"{spec.name} on grid {g} ")
    prog = build_program(spec, g, opts, batch, seq)
    if json_out is not None:
        write_file(json_out, prog.to_json())
    s = prog.summary()
    console.print(f"[bold]{spec.name}[/] on grid {g} ({g.size} GPUs), batch {s['global_batch']} x "
                  f"{s['seq_len']} tokens, padded vocabulary {s['padded_vocab']}")
    kinds = Table("kind", "ops", title="ops by kind")
    for k, n in s["ops_by_kind"].items():
        kinds.add_row(k, str(n))
    console.print(kinds)
    axes = Table("axis", "group size", "payload (GB)", "on the wire per rank (GB)",
                 title="communication per rank (ring volumes)")
    for a, v in s["wire_bytes_per_axis"].items():
        axes.add_row(a, str(g.axis_size(a)), f"{s['payload_bytes_per_axis'][a] / 1e9:.3f}", f"{v / 1e9:.3f}")
    console.print(axes)
    console.print(f"flops per rank {s['flops_per_rank']:.4g}; model flops {s['model_flops']:.4g} "
                  f"(GEMM+attention {s['matmul_flops']:.4g}, reference formula {s['reference_flops']:.4g})")
    console.print(f"memory per GPU {mem.total / GIB:.2f} GiB: " + ", ".join(
        f"{k} {v / GIB:.2f}" for k, v in mem.as_dict().items() if k != "total"))
    if json_out is not None:
        console.print(f"wrote {json_out}")


@app.command("simulate")
@handles_errors
def simulate_cmd() -> None:
    """Simulate one training iteration on a system (issue 4)."""
    not_implemented("simulate")


@app.command("search")
@handles_errors
def search_cmd() -> None:
    """Find the best 4D grid for a model on a system (not implemented yet)."""
    not_implemented("search")


@app.command("systems")
@handles_errors
def systems_cmd() -> None:
    """List the systems with their key figures (issue 3)."""
    not_implemented("systems")


@app.command("topology")
@handles_errors
def topology_cmd() -> None:
    """Draw a system's dragonfly and node fabric (issue 3)."""
    not_implemented("topology")


if __name__ == "__main__":
    app()
