"""`backend run` end to end on CPU (gloo, 4 ranks): the loss falls, log lines and summary are written,
and the trace of one step reads back with twin's reader and carries the program's op names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from twin.program.grid import Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from twin.program.program import Options, build_program  # noqa: E402
from twin.program.trace import read_trace  # noqa: E402

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
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == STEPS and all(len(line) <= 80 for line in steps), steps  # one line in 80 columns
    assert r.stdout.strip().splitlines()[-1].startswith("done: ")  # the summary line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grid"] == GRID and summary["tokens_per_s"] > 0

    spans = read_trace(out / "trace")
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
        # each collective carries the host's wall time issuing it (its buffers and the asynchronous call)
        assert all(0 < s.args["issue_us"] < 1e6 for s in mine if s.stream != "compute")


def test_fresh_interpreter_ranks(tmp_path):
    """The launch path that GPUs take (each rank a new `python -m backend.launch.launcher`), here on CPU."""
    from dataclasses import asdict

    from backend.launch.spawn import spawn
    from backend.training.train import TrainConfig

    cfg = TrainConfig(model="gpt-tiny", grid="1x1x1x2", steps=2, warmup=1, out=str(tmp_path / "run"))
    assert spawn("run", asdict(cfg), 2, fork=False) == 0
    lines = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_recorder_cuda_event_branch(monkeypatch):
    """The recorder's GPU timing (CUDA events, resolved when spans are read) with a stand-in event."""
    import torch

    from backend.runtime.recorder import Recorder

    clock = iter(range(100))

    class Event:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = next(clock)  # milliseconds, one per event

        def elapsed_time(self, end: "Event") -> float:
            return float(end.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    rec = Recorder(device="cuda")  # event 0: the origin
    with rec.op("a.fwd.gemm", "gemm", m=2, n=3, k=4, layout="NN"):  # events 1, 2
        pass
    r = rec.begin("a.fwd.ar_x", "all_reduce", "x", axis="x", bytes=8)  # event 3
    rec.end(r)  # event 4
    spans = rec.spans(0)
    assert [(s.name, s.start_s, s.duration_s) for s in spans] == [("a.fwd.gemm", 1e-3, 1e-3),
                                                                 ("a.fwd.ar_x", 3e-3, 1e-3)]
    assert spans[0].args["m"] == 2 and spans[1].args["bytes"] == 8
