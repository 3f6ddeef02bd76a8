"""Checkpoints: a run killed (SIGKILL) mid-training resumes from its last checkpoint and its loss
curve continues exactly as an uninterrupted run's; a crash while saving never corrupts the last
good checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from backend.runtime import checkpoint  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402

GRID = "1x1x2x2"  # data sharded over z and data; weights sharded over z
ARGS = ["run", "--model", "gpt-tiny", "--grid", GRID, "--steps", "6", "--warmup", "2", "--lr", "3e-3"]


def backend(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.cli", *args], capture_output=True, text=True,
                          timeout=90, env={**os.environ, **(env or {})})


def losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def test_killed_run_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    full = backend(ARGS + ["--out", str(tmp_path / "full")])
    assert full.returncode == 0, full.stderr
    crashed = backend(ARGS + ["--out", str(tmp_path / "a"), "--ckpt-dir", str(ckpt), "--ckpt-every", "2"],
                      env={"BACKEND_TEST_CRASH_AFTER_STEP": "3"})
    assert crashed.returncode != 0  # rank 0 killed itself after step 3; the others were stopped
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    resumed = backend(ARGS + ["--out", str(tmp_path / "b"), "--ckpt-dir", str(ckpt), "--ckpt-every", "2"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed after step 2" in resumed.stdout

    want, before, after = losses(tmp_path / "full" / "log.jsonl"), losses(tmp_path / "a" / "log.jsonl"), \
        losses(tmp_path / "b" / "log.jsonl")
    assert sorted(before) == [1, 2, 3] and sorted(after) == [3, 4, 5, 6]
    for step, loss in {**before, **after}.items():
        assert loss == pytest.approx(want[step], rel=1e-6, abs=1e-6), (step, loss, want[step])
    assert (ckpt / "latest").read_text().strip() == "step_00000006"
    assert not list(ckpt.glob(".tmp.*"))


def test_crash_while_saving_keeps_last_good_checkpoint(tmp_path):
    grid, model = Grid.parse("1x1x1x1"), load_model("gpt-tiny")
    meta = checkpoint.make_meta(4, grid, model)
    checkpoint.save(tmp_path, 4, 0, {"step": 4}, meta)
    # a save of step 6 that died half way: its files are in the temporary directory only
    debris = tmp_path / ".tmp.step_00000006"
    debris.mkdir()
    (debris / "rank_00000.pt").write_bytes(b"half a file")
    path = checkpoint.latest(tmp_path)
    assert path.name == "step_00000004"
    assert checkpoint.load(path, 0, grid, model)["step"] == 4
    # the next save of that step clears the debris and publishes atomically
    checkpoint.save(tmp_path, 6, 0, {"step": 6}, checkpoint.make_meta(6, grid, model), keep=1)
    assert checkpoint.latest(tmp_path).name == "step_00000006"
    assert not debris.exists() and not (tmp_path / "step_00000004").exists()
