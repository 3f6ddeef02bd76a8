"""The `backend` command: real training, replay and microbenchmarks with PyTorch."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Train for real with PyTorch, running the same schedule the twin simulates.")


def not_implemented(what: str) -> None:
    typer.echo(f"error: `backend {what}` is not implemented yet", err=True)
    raise typer.Exit(1)


@app.command("run")
def run_cmd() -> None:
    """Train a GPT with the 4D algorithm (issue 5)."""
    not_implemented("run")


@app.command("replay")
def replay_cmd() -> None:
    """Execute the twin's program op by op with random tensors (issue 5)."""
    not_implemented("replay")


if __name__ == "__main__":
    app()
