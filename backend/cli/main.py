"""The `backend` command: real training, replay and microbenchmarks with PyTorch.

Each command checks its input here, in the launching process, then starts the ranks (backend.launch.launcher):
on one machine it spawns them itself; under torchrun or srun this process is one rank. Bad input
ends with one line on stderr and exit code 2, on every rank, without a traceback.

The commands live by what they do: backend.cli.train (run, finetune, memorization-study),
backend.cli.measure (replay, bench), backend.cli.checkpoint (export, generate, memorization);
backend.cli.common holds what they share. This module only lists them, in `--help` order.
"""

from __future__ import annotations

import importlib.util
import sys

import typer

from backend.cli.checkpoint import export_cmd, generate_cmd, memorization_cmd
from backend.cli.measure import bench_cmd, replay_cmd
from backend.cli.train import finetune_cmd, memorization_study_cmd, run_cmd
from twin.program.flags import OneLineErrors

app = typer.Typer(cls=OneLineErrors, no_args_is_help=True, add_completion=False,
                  help="Train for real with PyTorch, running the same schedule the twin simulates.")


@app.callback()
def _needs_torch() -> None:
    """Every backend command needs PyTorch: say in one line how to install it."""
    if importlib.util.find_spec("torch") is None:  # found, not imported: `--help` and bad input stay fast
        typer.echo("error: the backend needs PyTorch, which is not installed: pip install torch "
                   "(CPU only: pip install torch --index-url https://download.pytorch.org/whl/cpu)", err=True)
        raise typer.Exit(2) from None


for _name, _cmd in (("run", run_cmd), ("replay", replay_cmd), ("finetune", finetune_cmd), ("export", export_cmd),
                    ("bench", bench_cmd), ("generate", generate_cmd), ("memorization", memorization_cmd),
                    ("memorization-study", memorization_study_cmd)):
    app.command(_name)(_cmd)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())

