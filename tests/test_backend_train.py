"""`backend run` end to end on CPU (gloo, 4 ranks): the loss falls, log lines and summary are written,
and the trace of one step reads back with twin's reader and carries the program's op names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from twin.grid import Grid  # noqa: E402
from twin.model import load_model  # noqa: E402
from twin.program import Options, build_program  # noqa: E402
from twin.trace import read_trace  # noqa: E402

GRID = "2x1x2x1"
STEPS = 6


def backend(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_run_trains_logs_and_traces(tmp_path):
    out = tmp_path / "run"
    r = backend("run", "--model", "gpt-tiny", "--grid", GRID, "--steps", str(STEPS), "--warmup", "1",
                "--lr", "3e-3", "--out", str(out), "--trace-step", "5")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in lines] == list(range(1, STEPS + 1))
    losses = [rec["loss"] for rec in lines]
    assert losses[-1] < losses[0] - 0.1, losses
    for rec in lines:
        assert rec["tokens_per_s"] > 0 and rec["flops_per_s"] > 0 and rec["eta_s"] >= 0
    assert "loss" in r.stdout and "tok/s" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grid"] == GRID and summary["tokens_per_s"] > 0

    spans = read_trace(out / "trace.json")
    program = build_program(load_model("gpt-tiny"), Grid.parse(GRID), Options())
    names = {op.name for op in program.ops}
    assert {s.rank for s in spans} == set(range(4))
    assert {s.name for s in spans} <= names
    for rank in range(4):
        mine = [s for s in spans if s.rank == rank]
        want = [op.name for op in program.ops if op.kind == "gemm" or op.is_collective]
        got = [s.name for s in sorted(mine, key=lambda s: s.args["index"])
               if s.kind == "gemm" or s.stream != "compute"]
        assert sorted(got) == sorted(want)
        index = {op.name: op.index for op in program.ops}
        assert all(s.args["index"] == index[s.name] for s in mine)  # the program's op index, as in a twin trace
