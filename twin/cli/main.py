"""The `twin` command: parses, calls the library, prints. Bad input exits 2 with one line.

The commands live by what they do: twin.cli.inspect (models, program, systems, topology),
twin.cli.predict (simulate, report, search, scaling, sensitivity), twin.cli.calibrate (calibrate,
validate); twin.cli.common holds what they share. This module only lists them, in `--help` order.
"""

from __future__ import annotations

import os
import sys

import typer
import typer.main

from twin.cli.calibrate import calibrate_cmd, validate_cmd
from twin.cli.inspect import models_cmd, program_cmd, systems_cmd, topology_cmd
from twin.cli.predict import report_cmd, scaling_cmd, search_cmd, sensitivity_cmd, simulate_cmd
from twin.program.flags import OneLineErrors


class _Twin(typer.Typer):
    """The app, built for the command it runs: typer reads every command's signature (their
    annotations, evaluated) to build it, about 2 ms a command, so a process that runs one command
    builds that one. Help of the whole app, tests (which invoke the full app) and anything else: as typer does.

    A process that runs the app (`twin ...`, `python -m twin.cli ...`) ends as soon as the command is
    done and its output flushed (`leave`): tearing the interpreter down would free every object
    the run made (the network, its routes and memos), 0.05-0.1 s of a fixed-grid simulate for
    nothing. Nothing is lost: the commands close every file they write before they return."""

    def __call__(self, *args, **kwargs):
        if args or kwargs:
            return super().__call__(*args, **kwargs)
        try:
            self._run()
        except SystemExit as e:
            leave(e.code)
        leave(0)

    def _run(self):
        name = sys.argv[1] if len(sys.argv) > 1 else None
        one = [c for c in self.registered_commands if c.name == name]
        if not one:
            return super().__call__()
        every, self.registered_commands = self.registered_commands, one
        try:
            group = typer.main.get_group(self)
        finally:
            self.registered_commands = every
        return group()


def leave(code) -> None:
    """Exit the process with `code` (as sys.exit would take it) once stdout and stderr are flushed,
    without tearing the interpreter down."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: what was not read is not wanted
            pass
    os._exit(code or 0)


app = _Twin(cls=OneLineErrors, no_args_is_help=True, add_completion=False,
                  help="A digital twin of 4D-parallel LLM training: simulate, search, inspect.")

for _name, _cmd in (("models", models_cmd), ("program", program_cmd), ("simulate", simulate_cmd),
                    ("report", report_cmd), ("search", search_cmd), ("systems", systems_cmd),
                    ("topology", topology_cmd), ("calibrate", calibrate_cmd), ("validate", validate_cmd),
                    ("scaling", scaling_cmd), ("sensitivity", sensitivity_cmd)):
    app.command(_name)(_cmd)


if __name__ == "__main__":
    app()
