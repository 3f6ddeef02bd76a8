"""The files of a run that `twin validate` reads (log.jsonl, summary.json) are checked by the schema of
topologies/schema.py like every spec file: a bad value is one line naming the file, the key and the rule."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fake_run import fake_run
from twin.cli.main import app

GOOD = {"step": 3, "step_time_s": 0.05, "tokens_per_s": 5120.0, "loss": 5.5}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder as `backend run` writes it, its trace made by the twin (the same schema)."""
    return fake_run(tmp_path_factory.mktemp("run"), "1x1x1x1")


def write_run(d, records, summary):
    (d / "log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    (d / "summary.json").write_text(json.dumps(summary))


@pytest.mark.parametrize("records,summary,words", [
    ([GOOD, {**GOOD, "step_time_s": float("nan")}], {}, ["log.jsonl line 2", "step_time_s must be a finite number"]),
    ([{**GOOD, "tokens_per_s": "fast"}], {}, ["line 1", "tokens_per_s must be a finite number"]),
    ([{**GOOD, "step": 0}], {}, ["step must be an integer in [1,"]),
    ([{k: v for k, v in GOOD.items() if k != "step"}], {}, ["step is missing"]),
    ([GOOD], {"memory_peak_bytes": [1e6, -5]}, ["summary.json", "memory_peak_bytes[0] must be an integer"]),
    ([GOOD], {"memory_peak_bytes": "lots"}, ["memory_peak_bytes must be a list"]),
])
def test_bad_run_files_are_one_line(run_dir, records, summary, words):
    write_run(run_dir, records, summary)
    r = CliRunner().invoke(app, ["validate", str(run_dir)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    line, = r.stderr.strip().splitlines()
    for w in words:
        assert w in line, line


def test_a_good_run_validates(run_dir):
    write_run(run_dir, [GOOD, {**GOOD, "step": 4}], {"memory_peak_bytes": [1_000_000]})
    r = CliRunner().invoke(app, ["validate", str(run_dir)])
    assert r.exit_code == 0, r.output
