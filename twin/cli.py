"""The `twin` command: parses, calls the library, prints. Bad input exits 2 with one line.

The commands live by what they do: twin.cli_inspect (models, program, systems, topology),
twin.cli_predict (simulate, report, search, scaling, sensitivity), twin.cli_calibrate (calibrate,
validate); twin.cli_common holds what they share. This module only lists them, in `--help` order.
"""

from __future__ import annotations

import sys

import typer
import typer.main

from twin.cli_calibrate import calibrate_cmd, validate_cmd
from twin.cli_inspect import models_cmd, program_cmd, systems_cmd, topology_cmd
from twin.cli_predict import report_cmd, scaling_cmd, search_cmd, sensitivity_cmd, simulate_cmd
from twin.flags import OneLineErrors

class _Twin(typer.Typer):
    """The app, built for the command it runs: typer reads every command's signature (their
    annotations, evaluated) to build it, about 2 ms a command, so a process that runs one command
    builds that one. Help of the whole app, tests (which invoke the full app) and anything else: as typer does."""

    def __call__(self, *args, **kwargs):
        name = sys.argv[1] if len(sys.argv) > 1 and not args and not kwargs else None
        one = [c for c in self.registered_commands if c.name == name]
        if not one:
            return super().__call__(*args, **kwargs)
        every, self.registered_commands = self.registered_commands, one
        try:
            group = typer.main.get_group(self)
        finally:
            self.registered_commands = every
        return group()


app = _Twin(cls=OneLineErrors, no_args_is_help=True, add_completion=False,
                  help="A digital twin of 4D-parallel LLM training: simulate, search, inspect.")

for _name, _cmd in (("models", models_cmd), ("program", program_cmd), ("simulate", simulate_cmd),
                    ("report", report_cmd), ("search", search_cmd), ("systems", systems_cmd),
                    ("topology", topology_cmd), ("calibrate", calibrate_cmd), ("validate", validate_cmd),
                    ("scaling", scaling_cmd), ("sensitivity", sensitivity_cmd)):
    app.command(_name)(_cmd)


if __name__ == "__main__":
    app()
