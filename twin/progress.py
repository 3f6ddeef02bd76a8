"""Progress of a long command on stderr: a rich bar through the command's stages, with the time spent
and an estimate of the time left (from the stages' expected shares of the work and the pace so far).

    with Stages([("ranking grids", 3), ("simulating", 1)], quiet=json_out) as stage:
        stage("ranking grids")      # each call finishes the stage before it
        ...
        stage("simulating grid 8x8x4x128")   # matched to a planned stage by its first word(s)

Quiet (`--quiet`, `--json`) or not on a terminal-like stderr: nothing is shown, and the calls cost nothing.
`Steps` is the same bar over a count of like steps (`steps(what, done, total)`).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from rich.progress import Progress


def Console(**kwargs):  # noqa: N802 - rich's Console, imported when a bar is shown (--json never needs rich)
    from rich.console import Console
    return Console(**kwargs)


class Stages:
    """A context manager; calling it with a stage's name moves the bar to that stage."""

    def __init__(self, plan: list[tuple[str, float]], quiet: bool = False, console=None):
        self.plan = plan
        self.weights = dict(plan)
        self.quiet = quiet
        self.console = console
        self.progress: Progress | None = None
        self.task = None
        self.current: str | None = None
        self.done = 0.0
        self.t0 = time.perf_counter()

    def __enter__(self) -> Callable[[str], None]:
        if not self.quiet:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
                                     TimeElapsedColumn(), TextColumn("left ~"), TimeRemainingColumn(),
                                     console=self.console or Console(stderr=True), transient=True)
            self.progress.start()
            self.task = self.progress.add_task("starting", total=sum(self.weights.values()) or 1.0)
        return self

    def _weight(self, name: str) -> float:
        for key, w in self.plan:
            if name.startswith(key):
                return w
        return 0.0

    def __call__(self, name: str) -> None:
        if self.current is not None:
            self.done += self._weight(self.current)
        self.current = name
        if self.progress is not None:
            self.progress.update(self.task, description=name, completed=self.done)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=sum(self.weights.values()))
            self.progress.stop()


class Steps:
    """A bar over a count of like steps (points of a scaling series, simulations of a sensitivity
    study): the library calls `steps(what, done, total)` before each; the estimate is the pace so far."""

    def __init__(self, quiet: bool = False, console=None):
        self.quiet = quiet
        self.console = console
        self.progress: Progress | None = None

    def __enter__(self) -> Callable[[str, int, int], None]:
        if not self.quiet:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
                                     TextColumn("{task.completed:.0f}/{task.total:.0f}"), TimeElapsedColumn(),
                                     TextColumn("left ~"), TimeRemainingColumn(),
                                     console=self.console or Console(stderr=True), transient=True)
            self.progress.start()
            self.task = self.progress.add_task("starting", total=1)
        return self

    def __call__(self, what: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=what, completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()


def quiet_default(json_out: bool, quiet: bool) -> bool:
    """Progress is off under --quiet, under --json, and when stderr is not a terminal."""
    return quiet or json_out or not sys.stderr.isatty()
