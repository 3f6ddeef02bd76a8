"""What a run does when things go wrong: damaged checkpoints, two runs on one folder, a dead launcher,
a frozen rank, a failing rank. Each case ends in one line (or a one-line warning and a documented
fallback) and nothing already written is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from backend.runtime import checkpoint  # noqa: E402
from topologies.common import TwinError  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from backend_helpers import children  # noqa: E402
from twin.program.model import load_model  # noqa: E402

GRID, MODEL = Grid.parse("1x1x1x1"), load_model("gpt-tiny")
RUN = [sys.executable, "-m", "backend.cli", "run", "--model", "gpt-tiny", "--warmup", "1"]


def save_steps(root: Path, *steps: int) -> None:
    for step in steps:
        checkpoint.save(root, step, 0, {"step": step, "payload": list(range(1000))},
                        checkpoint.make_meta(step, GRID, MODEL), keep=0)


def resume(root: Path, capsys) -> tuple[Path | None, list[str]]:
    path = checkpoint.find_resume(root, 0)
    return path, capsys.readouterr().err.strip().splitlines()


def flip_bytes(file: Path, n: int = 64) -> None:
    data = bytearray(file.read_bytes())
    for i in range(n):
        data[len(data) // 2 + i] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip64", "delete"])
def test_a_damaged_rank_file_falls_back_to_the_previous_step(tmp_path, capsys, damage):
    save_steps(tmp_path, 2, 4)
    file = tmp_path / "step_00000004" / "rank_00000.pt"
    if damage == "truncate":
        file.write_bytes(file.read_bytes()[:100])
    elif damage == "garbage":
        file.write_bytes(os.urandom(file.stat().st_size))
    elif damage == "flip64":  # same size: only the checksum tells
        flip_bytes(file)
    else:
        file.unlink()
    path, err = resume(tmp_path, capsys)
    assert path.name == "step_00000002"
    assert len(err) == 1 and err[0].startswith("warning:") and "step_00000002" in err[0]
    assert checkpoint.load(path, 0, GRID, MODEL)["step"] == 2
    if damage == "flip64":  # loading the damaged one directly is refused too
        with pytest.raises(TwinError, match="checksum"):
            checkpoint.read_rank(tmp_path / "step_00000004", 0)


@pytest.mark.parametrize("damage", ["garbage", "directory", "dangling", "binary"])
def test_a_damaged_latest_pointer_falls_back_to_the_newest_good_step(tmp_path, capsys, damage):
    save_steps(tmp_path, 2, 4)
    pointer = tmp_path / "latest"
    pointer.unlink()
    if damage == "garbage":
        pointer.write_text("no such thing\n")
    elif damage == "directory":
        pointer.mkdir()
    elif damage == "dangling":
        pointer.write_text("step_00000099\n")
    else:
        pointer.write_bytes(b"\xff\xfe\x00garbage")
    path, err = resume(tmp_path, capsys)
    assert path.name == "step_00000004"
    assert len(err) == 1 and err[0].startswith("warning:")


@pytest.mark.parametrize("edit", [lambda m: m.pop("grid"), lambda m: m.update(step="four"),
                                  lambda m: m.update(grid="1x1x1x1", step=5)])  # the last breaks the checksum
def test_a_damaged_meta_falls_back(tmp_path, capsys, edit):
    save_steps(tmp_path, 2, 4)
    meta_file = tmp_path / "step_00000004" / "meta.json"
    meta = json.loads(meta_file.read_text())
    edit(meta)
    meta_file.write_text(json.dumps(meta))
    path, err = resume(tmp_path, capsys)
    assert path.name == "step_00000002" and len(err) == 1


def test_no_good_checkpoint_is_one_line_and_no_checkpoint_is_a_fresh_start(tmp_path, capsys):
    assert checkpoint.find_resume(tmp_path, 0) is None and checkpoint.latest(tmp_path) is None
    save_steps(tmp_path, 2)
    (tmp_path / "step_00000002" / "rank_00000.pt").write_bytes(b"x")
    for fn in (lambda: checkpoint.latest(tmp_path), lambda: checkpoint.find_resume(tmp_path, 0)):
        with pytest.raises(TwinError) as e:
            fn()
        assert "no usable checkpoint" in str(e.value) and "\n" not in str(e.value)


def _log_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_after_a_flipped_file_end_to_end(tmp_path):
    """Train, damage the newest checkpoint, resume into the same --out: one warning line, the run goes
    on from the previous checkpoint, and the log holds each step once."""
    args = RUN + ["--grid", "1x1x1x1", "--steps", "4", "--out", str(tmp_path / "out"), "--ckpt-dir",
                  str(tmp_path / "ck"), "--ckpt-every", "2"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    flip_bytes(tmp_path / "ck" / "step_00000004" / "__0_0.distcp")  # a DCP shard file
    again = subprocess.run(args[:-6] + ["--steps", "5"] + args[-6:], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    warnings = again.stderr.strip().splitlines()
    assert len(warnings) == 1 and "resuming from step_00000002" in warnings[0], again.stderr
    assert "resumed after step 2" in again.stdout
    assert _log_steps(tmp_path / "out" / "log.jsonl") == [1, 2, 3, 4, 5]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_long_run(out: Path, *extra: str) -> subprocess.Popen:
    """A 2-rank run that goes on until stopped; returns once it has logged a step."""
    proc = subprocess.Popen(RUN + ["--grid", "1x1x1x2", "--steps", "100000", "--out", str(out), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while not ((out / "log.jsonl").exists() and (out / "log.jsonl").stat().st_size):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "slow start"
        time.sleep(0.2)
    return proc


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_lock_dead_launcher_and_frozen_rank(tmp_path):
    """One long run checks three things: a second run on its --out gets one line naming it; killing the
    launcher takes its ranks with it; and (a fresh run) a SIGSTOPped rank ends the run, named."""
    run = _start_long_run(tmp_path / "out")
    try:
        second = subprocess.run(RUN + ["--grid", "1x1x1x1", "--steps", "2", "--out", str(tmp_path / "out")],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert f"in use by another run (pid {run.pid}" in second.stderr
        ranks = children(run.pid)
        assert len(ranks) == 2
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
        deadline = time.time() + 10
        while any(_alive(r) for r in ranks) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(r) for r in ranks), "ranks outlived their launcher"
    finally:
        if run.poll() is None:
            run.kill()
    run = _start_long_run(tmp_path / "out2", "--progress-timeout", "3")
    try:
        rank1 = sorted(children(run.pid))[1]  # forked in rank order
        os.kill(rank1, signal.SIGSTOP)
        _, err = run.communicate(timeout=60)
        lines = err.strip().splitlines()
        assert run.returncode != 0 and len(lines) == 1, err
        assert "rank 1 made no progress" in lines[0] and "stopped" in lines[0]
    finally:
        if run.poll() is None:
            run.kill()


def test_a_failing_rank_is_one_line_from_the_launcher(tmp_path):
    """Rank 1 fails mid-run (an injected error); its peers lose their connection and stop quietly;
    the launcher prints rank 1's cause, once."""
    r = subprocess.run(RUN + ["--grid", "1x1x2x2", "--steps", "50", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "BACKEND_TEST_FAIL_RANK": "1"})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: rank 1: RuntimeError: injected failure") and "traceback in" in lines[0]
