"""Commands that can take more than two seconds show a progress bar with an estimate of the time left
on stderr (here forced on, as on a terminal); --quiet and --json turn it off."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

import twin.present.progress
from twin.cli.main import app


@pytest.fixture()
def bar(monkeypatch):
    """What the progress bars draw, as on a terminal (stderr is not one under the test runner)."""
    shown = io.StringIO()
    monkeypatch.setattr(twin.present.progress, "quiet_default", lambda json_out, quiet: json_out or quiet)
    monkeypatch.setattr(twin.present.progress, "SHOW_AFTER_S", 0)  # these commands take less than the 1 s a bar waits
    monkeypatch.setattr(twin.present.progress, "Console",
                        lambda **kw: Console(file=shown, force_terminal=True, width=120, **{k: v for k, v in kw.items()
                                                                                          if k != "stderr"}))
    return shown


COMMANDS = {
    "simulate": ["simulate", "--system", "cpu", "--model", "gpt-tiny"],
    "search": ["search", "--system", "cpu", "--model", "gpt-tiny", "--simulate-top", "1"],
    "scaling": ["scaling", "--system", "cpu", "--series", "strong"],
    "sensitivity": ["sensitivity", "--system", "cpu", "--model", "gpt-tiny", "--grid", "2x2x2x1"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bar_with_an_estimate_unless_quiet_or_json(command, bar):
    r = CliRunner().invoke(app, COMMANDS[command])
    assert r.exit_code == 0, r.output
    assert "left ~" in bar.getvalue(), bar.getvalue()  # the estimate of the time left
    for off in ("--quiet", "--json"):
        bar.seek(0)
        bar.truncate()
        r = CliRunner().invoke(app, COMMANDS[command] + [off])
        assert r.exit_code == 0, r.output
        assert bar.getvalue() == "", (off, bar.getvalue())


def test_validate_shows_a_bar_over_its_runs_unless_quiet(bar, tmp_path):
    from fake_run import fake_run
    runs = [str(fake_run(tmp_path / grid, grid)) for grid in ("1x1x1x1", "2x1x1x1")]
    r = CliRunner().invoke(app, ["validate", *runs])
    assert r.exit_code == 0, r.output
    assert "left ~" in bar.getvalue() and "validating" in bar.getvalue(), bar.getvalue()
    bar.seek(0)
    bar.truncate()
    assert CliRunner().invoke(app, ["validate", *runs, "--quiet"]).exit_code == 0
    assert bar.getvalue() == ""


def test_a_quick_command_shows_no_bar_and_a_slow_one_shows_it_late(monkeypatch):
    """A bar appears SHOW_AFTER_S after the command starts, from the state the command has reached."""
    import time
    shown = io.StringIO()
    monkeypatch.setattr(twin.present.progress, "Console", lambda **kw: Console(file=shown, force_terminal=True, width=120))
    monkeypatch.setattr(twin.present.progress, "SHOW_AFTER_S", 0.2)
    with twin.present.progress.Stages([("one", 1.0), ("two", 1.0)]) as stage:
        stage("one")
    assert shown.getvalue() == ""
    with twin.present.progress.Steps() as steps:
        steps("point 1", 0, 2)
        time.sleep(0.5)
        steps("point 2", 1, 2)
        time.sleep(0.3)
    assert "point 2" in shown.getvalue() and "1/2" in shown.getvalue(), shown.getvalue()


def test_a_full_run_moves_the_bar_with_an_estimate(bar, monkeypatch):
    """--full: the engine reports the share of its run done, so the bar moves within the stage and
    the time left is a figure, not rich's "-:--:--"."""
    import twin.engine.sim
    monkeypatch.setattr(twin.engine.sim, "TICK_EVERY", 1)
    from twin.predict.simulate import SimulationConfig, simulate
    parts = []

    class Record:
        def __call__(self, stage):
            pass

        def part(self, fraction):
            parts.append(fraction)

    simulate(SimulationConfig("cpu", "gpt-tiny", 8, "2x2x1x2", full=True, slowdown={1: 1.3}), progress=Record())
    assert parts and all(0 <= a <= b <= 1 for a, b in zip(parts, parts[1:])) and parts[-1] > 0.5
    r = CliRunner().invoke(app, ["simulate", "--system", "cpu", "--model", "gpt-tiny", "--grid", "2x2x1x2", "--full",
                                 "--slowdown", "1:1.3"])
    assert r.exit_code == 0, r.output
    assert "left ~" in bar.getvalue() and "-:--:--" not in bar.getvalue(), bar.getvalue()


def test_time_left_is_the_pace_so_far():
    from twin.present.progress import time_left
    assert time_left(30.0, 1.0, 4.0) == "0:01:30"
    assert time_left(0.0, 0.0, 4.0) == "estimating"


def test_ctrl_c_leaves_the_bar_where_it_was_and_says_interrupted(bar, monkeypatch):
    import twin.predict.simulate

    def interrupted(config, progress=None, **kw):
        progress("ranking grids")
        progress.part(0.5)
        raise KeyboardInterrupt

    monkeypatch.setattr(twin.predict.simulate, "simulate", interrupted)
    r = CliRunner().invoke(app, ["simulate", "--system", "cpu", "--model", "gpt-tiny"])
    assert r.exit_code == 130
    assert [line for line in r.output.splitlines() if line.strip()] == [
        "interrupted (Ctrl-C): files written before stay as they were"]
    drawn = bar.getvalue()
    assert "ranking grids" in drawn and "100%" not in drawn, drawn
