"""The `twin` command: parses, calls the library, prints. Bad input exits 2 with one line.

The commands live by what they do: twin.cli.inspect (models, program, systems, topology) and
twin.cli.predict (simulate, report, search, scaling, sensitivity); twin.cli.common holds what they
share. Other packages add commands through the entry-point group "twin.commands" (name = "module:function",
a typer command function): `twin calibrate` and `twin validate` come this way (pyproject.toml), so the twin
never imports the package that fits profiles, and runs without it. This module lists the commands, in
`--help` order, and plugs the others in.
"""

from __future__ import annotations

import os
import sys

import typer
import typer.main

from twin.cli.inspect import models_cmd, program_cmd, systems_cmd, topology_cmd
from twin.cli.predict import report_cmd, scaling_cmd, search_cmd, sensitivity_cmd, simulate_cmd
from twin.cli.sweep import sweep_cmd
from twin.program.flags import OneLineErrors

PLUG_INS_AFTER = "topology"  # `twin --help` lists the plugged-in commands after this one


def plug_ins(group: str = "twin.commands") -> list[tuple[str, object]]:
    """The commands other installed packages add to `twin`: (name, command function) for each entry
    point of `group`, in the order the packages' metadata lists them; none when nothing is installed.
    Reading every installed package's metadata takes 20-40 ms, so it is done only on demand."""
    from importlib.metadata import entry_points

    return [(ep.name, ep.load()) for ep in entry_points(group=group)]


# The one JSON convention (README): `--json` prints JSON on stdout, `--json-out FILE` writes it to a file.
# These commands once took `--json FILE`; that spelling still works, with a one-line note.
LEGACY_JSON_FILE = {"program": lambda v: not v.startswith("-"), "validate": lambda v: v.endswith(".json")}


def legacy_json(args: list[str]) -> list[str]:
    """`twin program|validate --json FILE` (the old spelling) as `--json-out FILE`, saying so on stderr."""
    if not args or args[0] not in LEGACY_JSON_FILE:
        return args
    is_file, out = LEGACY_JSON_FILE[args[0]], list(args)
    for i, a in enumerate(out):
        if a == "--":
            break
        value = a.split("=", 1)[1] if a.startswith("--json=") else (
            out[i + 1] if a == "--json" and i + 1 < len(out) and is_file(out[i + 1]) else None)
        if value is not None:
            out[i] = "--json-out=" + value if a.startswith("--json=") else "--json-out"
            print(f"note: `--json {value}` is now `--json-out {value}` (`--json` alone prints JSON); "
                  "running it as that", file=sys.stderr)
            break
    return out


class _Commands(OneLineErrors):
    """The click group of `twin`: its own commands, and the plugged-in ones (`plug_ins`), added the first time
    the group lists its commands (the help) or is asked for a name it does not hold. A process running one
    of twin's own commands never looks for them. Twin's own command wins a name both use."""

    _plugged = False

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, legacy_json(args))

    def list_commands(self, ctx):
        self._plug_in()
        return super().list_commands(ctx)

    def get_command(self, ctx, cmd_name):
        if cmd_name not in self.commands:
            self._plug_in()
        return super().get_command(ctx, cmd_name)

    def _plug_in(self) -> None:
        if self._plugged:
            return
        self._plugged = True
        names = list(self.commands)
        at = names.index(PLUG_INS_AFTER) + 1 if PLUG_INS_AFTER in names else len(names)
        added = {}
        for name, fn in plug_ins():
            if name not in self.commands and name not in added:
                one = typer.Typer(add_completion=False)
                one.command(name)(fn)
                added[name] = typer.main.get_command(one)
        if added:
            own = self.commands
            self.commands = {n: own[n] for n in names[:at]} | added | {n: own[n] for n in names[at:]}


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


COMMANDS = (("models", models_cmd), ("program", program_cmd), ("simulate", simulate_cmd), ("report", report_cmd),
            ("search", search_cmd), ("systems", systems_cmd), ("topology", topology_cmd), ("scaling", scaling_cmd),
            ("sensitivity", sensitivity_cmd), ("sweep", sweep_cmd))
app = _Twin(cls=_Commands, no_args_is_help=True, add_completion=False,
            help="A digital twin of 4D-parallel LLM training: simulate, search, inspect.")

for _name, _cmd in COMMANDS:
    app.command(_name)(_cmd)


if __name__ == "__main__":
    app()
