"""One command-line convention: `--json` prints JSON on stdout in every command that has it, a file is
written with `--json-out FILE` (the old `--json FILE` of program and validate still works, with a
one-line note); every `--help` fits 80 columns; a misspelled system, model or option gets a "did you
mean"; `twin program` and `twin simulate --program` agree on memory (or say why they differ)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from twin.cli.main import COMMANDS, app

runner = CliRunner()
TINY = ["--model", "gpt-tiny", "--grid", "2x2x2x1", "--batch", "8"]


@pytest.mark.parametrize("command", [name for name, _ in COMMANDS] + ["calibrate", "validate"])
def test_help_fits_80_columns(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    r = runner.invoke(app, [command, "--help"], terminal_width=80)
    assert r.exit_code == 0, r.output
    wide = [line for line in r.output.splitlines() if len(line) > 80]
    assert not wide, wide


JSON = {
    "program": ["program", *TINY, "--json"],
    "simulate": ["simulate", "--system", "cpu", *TINY, "--json"],
    "search": ["search", "--system", "cpu", "--model", "gpt-tiny", "--top", "2", "--simulate-top", "1", "--json"],
    "sensitivity": ["sensitivity", "--system", "cpu", *TINY, "--json"],
}


@pytest.mark.parametrize("command", sorted(JSON))
def test_json_prints_json_on_stdout(command):
    r = runner.invoke(app, JSON[command])
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)


def test_validate_prints_json_and_writes_it_with_json_out(tmp_path):
    from fake_run import fake_run
    run = str(fake_run(tmp_path / "run", "2x1x1x1"))
    r = runner.invoke(app, ["validate", run, "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["runs"]
    out = tmp_path / "v.json"
    r = runner.invoke(app, ["validate", run, "--json-out", str(out), "--quiet"])
    assert r.exit_code == 0 and json.loads(out.read_text())["runs"], r.output


def test_the_old_json_file_spelling_still_writes_the_file(tmp_path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    r = runner.invoke(app, ["program", *TINY, "--json", str(old)])
    assert r.exit_code == 0, r.output
    assert "is now `--json-out" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert runner.invoke(app, ["program", *TINY, "--json-out", str(new)]).exit_code == 0
    assert old.read_text() == new.read_text()


@pytest.mark.parametrize("args, hint", [
    (["simulate", "--system", "frontir"], "did you mean frontier?"),
    (["simulate", "--system", "frontier", "--model", "gpt-32b"], "did you mean gpt-320b"),
    (["simulate", "--sytem", "frontier"], "did you mean --system"),
    (["simulate", "--system", "frontier", "--placement", "scatered"], "did you mean scattered?"),
    (["program", "--modle", "gpt-tiny"], "did you mean --model?"),
])
def test_misspelled_names_get_a_did_you_mean(args, hint):
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and hint in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


def test_program_and_simulate_program_agree_on_memory(tmp_path):
    prog = tmp_path / "p.json"
    r = runner.invoke(app, ["program", *TINY, "--json-out", str(prog)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert "with bf16 activations" in text  # the figure of a GPU, said so
    on_cpu = re.search(r"twin simulate --system cpu --program` reports it: ([\d.]+ \w?i?B)", text).group(1)
    s = runner.invoke(app, ["simulate", "--system", "cpu", "--program", str(prog)])
    assert s.exit_code == 0, s.output
    assert re.search(r"memory per GPU\s+([\d.]+ \w?i?B)", s.stdout).group(1) == on_cpu


def test_search_json_adds_up_as_its_chart_does():
    r = runner.invoke(app, JSON["search"])
    assert r.exit_code == 0, r.output
    for c in json.loads(r.stdout):
        assert c["compute_s"] + sum(c["exposed_comm_s"].values()) == pytest.approx(c["analytical_s"], rel=1e-9)
        assert all(c["exposed_comm_s"][a] <= c["comm_s"][a] + 1e-12 for a in c["comm_s"])
