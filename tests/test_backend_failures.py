"""Failures that say what happened (issue 48): the launcher names the rank that caused a failure, not a
peer that lost its connection; a full disk and a step folder that is a file are named with their path;
a step whose loss or gradients are not finite stops the run naming the step (or is skipped), and
nothing non-finite is saved or written as JSON; SIGTERM saves a checkpoint of the step reached."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from backend.launch import spawn  # noqa: E402
from backend.launch.rank import CAUSE, PEER, lost_peer  # noqa: E402
from topologies.common import os_error_line  # noqa: E402
from backend.runtime import checkpoint  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from backend_helpers import children  # noqa: E402

RUN = [sys.executable, "-m", "backend.cli", "run", "--model", "gpt-tiny", "--warmup", "1"]
GLOO_RESET = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8940: "
              "Connection reset by peer. This is typically caused by a remote worker hanging")


def _lines(err: str) -> list[str]:
    return [line for line in err.strip().splitlines() if line.strip()]


# -- the launcher's ranking, on error files as ranks write them ---------------------------------------
class _Done:
    def __init__(self, pid: int, code: int):
        self.pid, self.returncode = pid, code

    def poll(self):
        return self.returncode


def _report(run_dir: Path, rank: int, when: float, code: int, kind: str, line: str) -> None:
    (run_dir / f"error{rank}").write_text(f"{when!r} {code} {kind}\n{line}\n")


def test_an_own_error_outranks_earlier_lost_connections(tmp_path):
    _report(tmp_path, 0, 1.0, 1, PEER, f"error: rank 0: {GLOO_RESET}")
    _report(tmp_path, 1, 1.1, 1, PEER, "error: rank 1: RuntimeError: Connection closed by peer")
    _report(tmp_path, 3, 2.0, 2, CAUSE, "error: rank 3: /x/log.jsonl: No space left on device")
    procs = [_Done(1, 1), _Done(2, 1), _Done(3, 0), _Done(4, 2)]
    assert spawn._first_failure(procs, str(tmp_path), ) == (2, "error: rank 3: /x/log.jsonl: No space left on device")


def test_a_rank_killed_by_a_signal_outranks_its_peers(tmp_path):
    _report(tmp_path, 0, 1.0, 1, PEER, f"error: rank 0: {GLOO_RESET}")
    procs = [_Done(1, 1), _Done(2, 1), _Done(3, -9), _Done(4, 1)]
    code, line = spawn._first_failure(procs, str(tmp_path))
    assert code == 1 and line.startswith("error: rank 2 was killed by SIGKILL")


def test_lost_connections_are_told_from_causes():
    assert lost_peer(RuntimeError(GLOO_RESET.split(": ", 1)[1]))
    assert lost_peer(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert lost_peer(ConnectionResetError(104, "Connection reset by peer"))
    assert not lost_peer(RuntimeError("CUDA out of memory"))
    assert not lost_peer(OSError(28, "No space left on device"))
    line = os_error_line(OSError(28, "No space left on device", "/out/log.jsonl"))
    assert line.startswith("/out/log.jsonl: No space left on device (the disk is full")


# -- whole runs -------------------------------------------------------------------------------------
def _start(out: Path, grid: str, *extra: str) -> subprocess.Popen:
    """A run that goes on until stopped; returns once it has logged a step."""
    proc = subprocess.Popen(RUN + ["--grid", grid, "--steps", "100000", "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not ((out / "log.jsonl").exists() and (out / "log.jsonl").stat().st_size):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "slow start"
        time.sleep(0.1)
    return proc


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("grid,victim", [("1x1x2x2", 2), ("2x2x2x1", 5)])
def test_a_rank_killed_mid_run_is_the_one_named(tmp_path, grid, victim):
    run = _start(tmp_path / "out", grid)
    try:
        ranks = children(run.pid)
        assert len(ranks) == Grid.parse(grid).size
        os.kill(ranks[victim], signal.SIGKILL)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    lines = _lines(err)
    assert run.returncode == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"error: rank {victim} was killed by SIGKILL"), lines[0]


def _unshare_works() -> bool:
    if not shutil.which("unshare") or not Path("/proc").is_dir():
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=8k tmpfs /mnt 2>/dev/null || "
                        "mount -t tmpfs -o size=8k tmpfs /tmp"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare and tmpfs mounts in a private mount namespace")
def test_a_full_disk_under_out_is_named_and_leaves_no_temporary_file(tmp_path):
    """--out on a full tmpfs (8 KiB, mounted in a private mount namespace): rank 0's trace does not fit.
    The line names rank 0, the file and the full disk, not a peer's lost connection."""
    out = tmp_path / "full"
    out.mkdir()
    cmd = " ".join(RUN + ["--grid", "1x1x2x2", "--steps", "3", "--trace-step", "1", "--out", str(out)])
    script = (f"mount -t tmpfs -o size=8k tmpfs {out} && {{ {cmd}; code=$?; ls -A {out} {out}/trace >&2; "
              "exit $code; }")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())})
    lines = _lines(r.stderr)
    assert r.returncode == 2, r.stderr
    assert lines[0] == (f"error: rank 0: {out}/trace/rank0.json: No space left on device (the disk is full: "
                        "free space there or choose another folder)"), r.stderr
    assert not [line for line in lines[1:] if line.endswith(".tmp")], r.stderr


def test_a_step_folder_that_is_a_file_is_named(tmp_path):
    """Refused before any rank starts; and should one appear during the run, rank 0's save names it."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / "step_00000002").write_text("not a checkpoint")
    r = subprocess.run(RUN + ["--grid", "1x1x1x2", "--steps", "3", "--out", str(tmp_path / "out"), "--ckpt-dir",
                              str(ckpt), "--ckpt-every", "2"], capture_output=True, text=True, timeout=120)
    lines = _lines(r.stderr)
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == (f"error: {ckpt}/step_00000002 is a file, not a checkpoint folder: move it away "
                        "or choose another --ckpt-dir"), r.stderr
    grid, model = Grid.parse("1x1x1x1"), load_model("gpt-tiny")
    with pytest.raises(checkpoint.CheckpointError, match="step_00000002 is a file, not a checkpoint folder"):
        checkpoint.save(ckpt, 2, 0, {"step": 2}, checkpoint.make_meta(2, grid, model))
    assert (ckpt / "step_00000002").read_text() == "not a checkpoint"


def _strict(text: str):
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_a_diverging_run_stops_naming_its_step(tmp_path):
    """lr 1e4 without clipping: the loss is NaN by step 3. The run stops there, before the update, with
    one line; the log holds strict JSON; the checkpoint saved before holds finite weights only."""
    out, ckpt = tmp_path / "out", tmp_path / "ck"
    r = subprocess.run(RUN + ["--grid", "1x1x1x2", "--steps", "20", "--lr", "1e4", "--warmup", "0", "--grad-clip", "0",
                              "--out", str(out), "--ckpt-dir", str(ckpt), "--ckpt-every", "1"],
                       capture_output=True, text=True, timeout=120)
    lines = _lines(r.stderr)
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: rank 0: step ") and "stopped before its update" in lines[0], lines[0]
    step = int(lines[0].split("step ")[1].split(":")[0])
    logged = [_strict(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in logged] == list(range(1, step))
    assert checkpoint.latest(ckpt).name == f"step_{step - 1:08d}"
    import torch
    from backend.runtime import dcp
    weights = {k: t[0] for k, t in dcp.read_full(checkpoint.latest(ckpt)).items()}  # [weight, exp_avg, exp_avg_sq]
    assert "wte" in weights and all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_skip_nonfinite_goes_on_and_writes_null(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(RUN + ["--grid", "1x1x1x1", "--steps", "5", "--lr", "1e4", "--warmup", "0", "--grad-clip", "0",
                              "--skip-nonfinite", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = _strict((out / "summary.json").read_text())
    assert summary["skipped_steps"] >= 1 and summary["final_loss"] is None
    skipped = [rec for rec in map(_strict, (out / "log.jsonl").read_text().splitlines()) if "skipped" in rec]
    assert skipped and all(rec["loss"] is None for rec in skipped)
    assert sum("skipped" in line for line in r.stderr.splitlines()) == len(skipped)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_sigterm_saves_a_loadable_checkpoint_of_the_step_reached(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ck"
    run = _start(out, "1x1x2x1", "--ckpt-dir", str(ckpt))
    try:
        run.send_signal(signal.SIGTERM)
        stdout, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    lines = _lines(err)
    assert run.returncode == 128 + signal.SIGTERM and len(lines) == 1, err
    assert lines[0].startswith("backend run: stopped by SIGTERM after step ") and "rerun the same command" in lines[0]
    step = int(lines[0].split("after step ")[1].split(";")[0])
    last_logged = max(json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines())
    assert step == last_logged
    path = checkpoint.latest(ckpt)
    assert path.name == f"step_{step:08d}"
    from backend.runtime import dcp
    checkpoint.verify(path)
    assert dcp.read_objects(path, ["train"])["train"]["step"] == step


def test_every_json_the_project_writes_goes_through_finite_json():
    """No json.dump(s) that writes a file or a line for the user: those go through finite_json (strict JSON,
    NaN and infinities as null). What is left hashes a key or passes a config to a child process."""
    root = Path(__file__).resolve().parent.parent
    allowed = {("twin/present/report.py", "html.escape(json.dumps(r.options))"),
               ("backend/launch/spawn.py", "CONFIG_ENV: json.dumps(config)"),
               ("calibration/validate.py", "key = json.dumps("),
               ("twin/sweep/spec.py", "text = json.dumps([p.system"),  # hashes a sweep point's key
               ("topologies/common.py", "return json.dumps(_finite(obj), allow_nan=False"),
               ("topologies/common.py", "return json.dumps(obj, allow_nan=False"),
               ("topologies/common.py", "at json.dumps' speed")}
    found = []
    for package in ("twin", "backend", "calibration", "topologies"):
        for path in (root / package).rglob("*.py"):
            for line in path.read_text().splitlines():
                if "json.dump" in line and not line.strip().startswith(("#", '"""')) and "json.dumps that" not in line:
                    rel = str(path.relative_to(root))
                    if not any(rel == f and snippet in line for f, snippet in allowed):
                        found.append(f"{rel}: {line.strip()}")
    assert not found, found


# -- writes that fail: the path named, no temporary file left -----------------------------------------
class _FileSizeLimit:
    """Writes past `limit` bytes fail in the kernel (RLIMIT_FSIZE: EFBIG, "File too large"), as on a full disk."""

    def __init__(self, limit: int):
        import resource
        self.resource, self.limit = resource, limit

    def __enter__(self):
        self.before = self.resource.getrlimit(self.resource.RLIMIT_FSIZE)
        self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self.resource.setrlimit(self.resource.RLIMIT_FSIZE, (self.limit, self.before[1]))

    def __exit__(self, *exc):
        self.resource.setrlimit(self.resource.RLIMIT_FSIZE, self.before)
        signal.signal(signal.SIGXFSZ, self.handler)


def test_a_failed_atomic_write_names_the_path_and_leaves_no_tmp(tmp_path):
    from topologies.common import write_atomic

    path = tmp_path / "summary.json"
    write_atomic(path, "old")
    with _FileSizeLimit(4096), pytest.raises(OSError) as e:
        write_atomic(path, "x" * 100_000)
    assert e.value.filename == str(path) and "File too large" in os_error_line(e.value)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    with pytest.raises(UnicodeEncodeError):  # a failure that is not an OSError cleans up too
        write_atomic(path, "bad \udc80")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_failed_checkpoint_write_names_the_rank_file_and_removes_it(tmp_path):
    grid, model = Grid.parse("1x1x1x1"), load_model("gpt-tiny")
    with _FileSizeLimit(64 * 1024), pytest.raises(OSError) as e:
        checkpoint.save(tmp_path, 2, 0, {"payload": list(range(100_000))}, checkpoint.make_meta(2, grid, model))
    assert e.value.filename == str(tmp_path / ".tmp.step_00000002" / "rank_00000.pt")
    assert not list(tmp_path.rglob("*.pt")) and checkpoint.latest(tmp_path) is None


def test_a_failed_dcp_checkpoint_write_names_the_rank_file_and_publishes_nothing(tmp_path):
    import torch
    grid, model = Grid.parse("1x1x1x1"), load_model("gpt-tiny")
    with _FileSizeLimit(64 * 1024), pytest.raises(OSError) as e:
        checkpoint.save(tmp_path, 2, 0, {"w": torch.zeros(100_000)}, checkpoint.make_meta(2, grid, model), sharded=True)
    assert e.value.filename == str(tmp_path / ".tmp.step_00000002" / "__0_0.distcp"), e.value
    assert "File too large" in os_error_line(e.value)
    assert checkpoint.latest(tmp_path) is None and not (tmp_path / "latest").exists()


def test_the_default_progress_limit_follows_the_measured_steps(tmp_path):
    """900 s until every rank has stepped twice and while one is busy (saving); then 20 times the slowest
    interval between two heartbeats, at least 120 s."""
    procs = [_Done(os.getpid(), None), _Done(os.getpid(), None)]
    watch = spawn._Progress(2, str(tmp_path), None)
    now = time.time()

    def beat(rank: int, at: float, state: str = "") -> None:
        path = tmp_path / f"beat{rank}"
        path.write_text(state)
        os.utime(path, (now + at, now + at))

    for at in (0.0, 1.0, 2.0):  # the start, then steps of 1 s
        beat(0, at)
        beat(1, at)
        assert watch.stalled(procs) is None
    assert watch.limit(0) == spawn.FLOOR_S
    beat(0, 33.0)  # a step of 31 s
    beat(1, 33.0)
    watch.stalled(procs)
    assert watch.slowest == pytest.approx(31.0) and watch.limit(0) == pytest.approx(20 * 31.0)
    beat(1, 34.0, spawn.BUSY)
    assert watch.limit(1) == spawn.STARTUP_S and watch.limit(0) == pytest.approx(20 * 31.0)
    assert spawn._Progress(2, str(tmp_path), 5.0).limit(0) == 5.0


def test_a_checkpoint_with_nan_weights_is_not_resumed(tmp_path):
    """One written before non-finite steps were caught: a resume refuses it in one line."""
    out, ckpt = tmp_path / "out", tmp_path / "ck"
    args = RUN + ["--grid", "1x1x1x1", "--steps", "2", "--out", str(out), "--ckpt-dir", str(ckpt), "--ckpt-every", "2"]
    assert subprocess.run(args, capture_output=True, timeout=120).returncode == 0
    from backend.runtime import dcp
    path = checkpoint.latest(ckpt)
    state = {**dcp.read_full(path), **dcp.read_objects(path, ["train", "rng/rank_00000"])}  # full tensors
    state["blocks.0.qkv"][0].view(-1)[0] = float("nan")  # [weight, exp_avg, exp_avg_sq]: the weight
    meta = {k: v for k, v in checkpoint.read_meta(path).items() if k not in ("files", "checksum")}
    checkpoint.save(ckpt, 2, 0, state, meta, sharded=True)  # plain tensors: one chunk each, any grid reads them
    name = "blocks.0.qkv.weight"
    r = subprocess.run(args[:-6] + ["--steps", "4"] + args[-6:], capture_output=True, text=True, timeout=120)
    lines = _lines(r.stderr)
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"checkpoint {path} cannot be resumed" in lines[0] and f"{name} holds NaN" in lines[0], lines[0]
