"""Progress of a long command on stderr: a rich bar through the command's stages, with the time spent
and an estimate of the time left (from the stages' expected shares of the work and the pace so far).

    with Stages([("ranking grids", 3), ("simulating", 1)], quiet=json_out) as stage:
        stage("ranking grids")      # each call finishes the stage before it
        ...
        stage("simulating grid 8x8x4x128")   # matched to a planned stage by its first word(s)

The estimate: a stage that reports its own progress (`stage.part(fraction)`: the engine does, in a
`--full` run) moves the bar within the stage; the time left is the time so far times the work left
over the work done, shown from the first step on. Ctrl-C leaves the bar where it was (not at 100 %)
and the command says "interrupted" in one line (twin.cli.common.handles_errors).

Quiet (`--quiet`, `--json`) or not on a terminal-like stderr: nothing is shown, and the calls cost nothing.
A bar appears only once the command has run SHOW_AFTER_S (1 s): a quicker command never imports rich.
`Steps` is the same bar over a count of like steps (`steps(what, done, total)`).
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from rich.progress import Progress


def Console(**kwargs):  # noqa: N802 - rich's Console, imported when a bar is shown (--json never needs rich)
    from rich.console import Console
    return Console(**kwargs)


SHOW_AFTER_S = 1.0  # a bar appears once a command has run this long (rich costs ~0.06 s to import)


class _Bar:
    """A rich bar on stderr that appears SHOW_AFTER_S seconds after it is entered (from a timer
    thread): a command done sooner neither shows it nor imports rich. Until then it keeps the task's
    description, completed and total, which the bar starts from."""

    def __init__(self, quiet: bool = False, console=None):
        self.quiet = quiet
        self.console = console
        self.progress: Progress | None = None
        self.state = {"description": "starting", "completed": 0.0, "total": 1.0}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._closed = False

    def columns(self) -> list:
        raise NotImplementedError

    def _show(self) -> None:
        with self._lock:
            if self._closed or self.progress is not None:
                return
            from rich.progress import Progress
            self.progress = Progress(*self.columns(), console=self.console or Console(stderr=True), transient=True)
            self.progress.start()
            self.task = self.progress.add_task(**self.state)

    def _update(self, **state) -> None:
        with self._lock:
            self.state.update(state)
            if self.progress is not None:
                self.progress.update(self.task, **state)

    def _enter(self) -> None:
        if self.quiet:
            return
        if SHOW_AFTER_S <= 0:
            self._show()
        else:
            self._timer = threading.Timer(SHOW_AFTER_S, self._show)
            self._timer.daemon = True
            self._timer.start()

    def _exit(self, completed: float | None = None, interrupted: bool = False) -> None:
        """Close the bar: moved to `completed` and cleared when the command ends; left where it was,
        on screen, when it was `interrupted` (Ctrl-C)."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
            if self.progress is not None:
                if interrupted:
                    self.progress.live.transient = False  # keep the bar as it was drawn last
                elif completed is not None:
                    self.progress.update(self.task, completed=completed)
                self.progress.stop()


def time_left(elapsed: float | None, completed: float, total: float) -> str:
    """The estimate the bar shows: the time so far times the work left over the work done (h:mm:ss),
    or "estimating" before any work is done."""
    if not elapsed or completed <= 0 or total <= 0:
        return "estimating"
    left = max(0.0, elapsed * (total - completed) / completed)
    return f"{int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"


def _columns(*middle) -> list:
    from rich.progress import BarColumn, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class TimeLeft(ProgressColumn):
        def render(self, task) -> Text:
            return Text(time_left(task.elapsed, task.completed, task.total), style="progress.remaining")

    return [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
            TextColumn("{task.percentage:>3.0f}%"), *[TextColumn(m) for m in middle], TimeElapsedColumn(),
            TextColumn("left ~"), TimeLeft()]


class Stages(_Bar):
    """A context manager; calling it with a stage's name moves the bar to that stage."""

    def __init__(self, plan: list[tuple[str, float]], quiet: bool = False, console=None):
        super().__init__(quiet, console)
        self.plan = plan
        self.weights = dict(plan)
        self.current: str | None = None
        self.done = 0.0
        self.state["total"] = sum(self.weights.values()) or 1.0

    def columns(self) -> list:
        return _columns()

    def __enter__(self) -> Callable[[str], None]:
        self._enter()
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
        if not self.quiet:
            self._update(description=name, completed=self.done)

    def part(self, fraction: float) -> None:
        """The current stage is `fraction` (0-1) done: move the bar within it."""
        if not self.quiet and self.current is not None:
            f = min(max(fraction, 0.0), 1.0)
            self._update(completed=self.done + f * self._weight(self.current))

    def __exit__(self, kind, *exc) -> None:
        self._exit(completed=sum(self.weights.values()), interrupted=kind is KeyboardInterrupt)


class Steps(_Bar):
    """A bar over a count of like steps (points of a scaling series, simulations of a sensitivity
    study): the library calls `steps(what, done, total)` before each; the estimate is the pace so far."""

    def columns(self) -> list:
        return _columns("{task.completed:.0f}/{task.total:.0f}")

    def __enter__(self) -> Callable[[str, int, int], None]:
        self._enter()
        return self

    def __call__(self, what: str, done: int, total: int) -> None:
        if not self.quiet:
            self._update(description=what, completed=done, total=total)

    def __exit__(self, kind, *exc) -> None:
        self._exit(interrupted=kind is KeyboardInterrupt)


def quiet_default(json_out: bool, quiet: bool) -> bool:
    """Progress is off under --quiet, under --json, and when stderr is not a terminal."""
    return quiet or json_out or not sys.stderr.isatty()


def load_program_shown(path, quiet: bool | None = None):
    """twin.program.programfile.load_program with a bar while it checks the file (a file of 10^6 ops
    takes about a minute; a small one ends before the bar would appear). quiet: None, when stderr is
    not a terminal."""
    from twin.program.programfile import load_program

    with Steps(not sys.stderr.isatty() if quiet is None else quiet) as steps:
        return load_program(path, progress=lambda done: steps("checking the program file", round(1000 * done), 1000))
