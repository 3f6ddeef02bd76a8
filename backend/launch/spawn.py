"""Starting the ranks on this machine: spawn `world_size` of them, watch them, stop them all on a failure.

`spawn` starts the ranks with torchrun's variables set and a free port (on CPU forked from this process
after importing torch once, which saves seconds per rank on a small machine; on GPU fresh interpreters,
`python -m backend.launch.launcher`), waits for them, and stops the others as soon as one fails (so a failing
rank never leaves the rest hanging in a collective), printing the first cause (the earliest failure:
the others are ranks that lost a peer). A rank that makes no progress (no heartbeat) for
`progress_timeout` seconds ends the run with one line naming it.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from backend.launch.rank import (CONFIG_ENV, CPU_BIND_ENV, JOBS, RUN_DIR_ENV, SPAWNED_ENV, bind_rank,
                                 die_with_parent, run_job)
from topologies.common import TwinError

TIMEOUT_ENV = "BACKEND_PROGRESS_TIMEOUT"  # seconds; overrides the default progress timeout
PROGRESS_TIMEOUT_S = {"run": 900.0}  # per job kind; jobs that do not call heartbeat() have none


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _preload(kind: str) -> None:
    """Import what the ranks need once, before forking, so that N ranks do not import torch N times."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: about a second per process)
    import torch.distributed  # noqa: F401
    module = JOBS[kind].split(":")[0]
    importlib.import_module(module)
    if kind == "run":
        for m in ("backend.models.gpt", "backend.training.optim", "backend.runtime.checkpoint", "backend.training.data"):
            importlib.import_module(m)


def _forked_rank(kind: str, config: dict, env: dict, parent: int) -> None:
    import torch
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops the ranks
    os.environ.update(env)
    bind_rank(int(env["RANK"]))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # torch read it before the fork
    code = run_job(kind, config)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start_ranks(kind: str, config: dict, world_size: int, fork: bool, run_dir: str) -> list:
    """Start the ranks: forked from this process (CPU), or fresh interpreters (GPU: CUDA and fork
    do not mix). Returns handles with poll()/terminate()/kill()/wait() and returncode."""
    import multiprocessing as mp
    port = free_port()
    envs = []
    for rank in range(world_size):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               SPAWNED_ENV: "1", RUN_DIR_ENV: run_dir}
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
        if fork:
            env[CPU_BIND_ENV] = os.environ.get(CPU_BIND_ENV, "none")
            env["BACKEND_CPU_BIND_CORES"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        envs.append(env)
    parent = os.getpid()
    if not fork:
        return [subprocess.Popen([sys.executable, "-m", "backend.launch.launcher", kind, str(parent)],
                                 env={**os.environ, **env, CONFIG_ENV: json.dumps(config)}) for env in envs]
    _preload(kind)
    ctx = mp.get_context("fork")
    procs = [_Forked(ctx.Process(target=_forked_rank, args=(kind, config, env, parent))) for env in envs]
    return procs


class _Forked:
    """A forked rank with the Popen methods spawn() uses."""

    def __init__(self, proc):
        self.proc = proc
        proc.start()

    @property
    def returncode(self):
        return self.proc.exitcode

    def poll(self):
        return self.proc.exitcode

    @property
    def pid(self):
        return self.proc.pid

    def terminate(self):
        self.proc.terminate()

    def kill(self):
        self.proc.kill()

    def wait(self, timeout=None):
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("rank", timeout)
        return self.proc.exitcode


def spawn(kind: str, config: dict, world_size: int, poll_s: float = 0.05, fork: bool | None = None,
          progress_timeout: float | None = None) -> int:
    """Start `world_size` local ranks of job `kind`, wait, and return the first failing exit code.

    fork: fork the ranks from this process (default on CPU) or start fresh interpreters (on GPU).
    progress_timeout: seconds a rank may go without a heartbeat() before the run is ended (None:
    the job kind's default, PROGRESS_TIMEOUT_S, or BACKEND_PROGRESS_TIMEOUT; 0: never).
    """
    if fork is None:
        fork = config.get("device", "cpu") == "cpu"
    timeout = _progress_timeout(kind, progress_timeout)
    run_dir = tempfile.mkdtemp(prefix="backend-run-")
    keep_run_dir = False
    procs = _start_ranks(kind, config, world_size, fork=fork, run_dir=run_dir)
    code, message = 0, None
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break
            if timeout:
                message = _stalled(procs, run_dir, timeout)
                if message:
                    code = 1
                    break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        code, message = 130, "error: interrupted; stopping the ranks"
    if not code and any(p.returncode not in (None, 0) for p in procs):
        time.sleep(0.2)  # let a rank that failed at the same moment write its cause
        code, message = _first_failure(procs, run_dir)
    if code:
        for p in procs:
            if p.poll() is None:
                p.kill() if message and "no progress" in message else p.terminate()
        deadline = time.time() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if message:
            keep_run_dir = "traceback in" in message
            print(message, file=sys.stderr, flush=True)
    else:
        code = next((p.returncode for p in procs if p.returncode), 0)
    if not keep_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _progress_timeout(kind: str, given: float | None) -> float:
    if given is not None:
        return float(given)
    env = os.environ.get(TIMEOUT_ENV)
    if env:
        try:
            return float(env)
        except ValueError:
            raise TwinError(f"{TIMEOUT_ENV}={env!r} is not a number of seconds") from None
    return PROGRESS_TIMEOUT_S.get(kind, 0.0)


def _first_failure(procs: list, run_dir: str) -> tuple[int, str | None]:
    """The exit code and message of the rank that failed first (by the time it wrote its cause)."""
    reports = []
    for rank, p in enumerate(procs):
        try:
            with open(os.path.join(run_dir, f"error{rank}")) as f:
                head, line = f.read().split("\n")[:2]
            when, code = head.split()
            reports.append((float(when), int(code), line))
        except (OSError, ValueError):
            continue
    if reports:
        _, code, line = min(reports)
        return code, line
    rank, p = next((r, p) for r, p in enumerate(procs) if p.returncode not in (None, 0))
    if p.returncode < 0:
        name = signal.Signals(-p.returncode).name if -p.returncode in signal.valid_signals() else -p.returncode
        return p.returncode, f"error: rank {rank} was killed by {name}; stopping the other ranks"
    return p.returncode, f"error: rank {rank} exited with code {p.returncode}; stopping the other ranks"


def _stalled(procs: list, run_dir: str, timeout: float) -> str | None:
    """A message naming the rank that made no progress for `timeout` seconds, or None."""
    now = time.time()
    ages = []
    for rank, p in enumerate(procs):
        try:
            ages.append((now - os.stat(os.path.join(run_dir, f"beat{rank}")).st_mtime, rank))
        except OSError:
            ages.append((0.0, rank))  # not started yet: its first beat comes at the job's start
    if max(ages)[0] < timeout:
        return None
    stopped = [rank for rank, p in enumerate(procs) if _state(p.pid) == "T"]
    if stopped:
        rank, why = stopped[0], "it is stopped (SIGSTOP?)"
    else:
        rank, why = max(ages)[1], "it or a collective it waits in is hung"
    age = next(a for a, r in ages if r == rank) if not stopped else max(ages)[0]
    return (f"error: rank {rank} made no progress for {age:.0f} s ({why}); ending the run "
            f"(the limit is {timeout:g} s: --progress-timeout or {TIMEOUT_ENV})")


def _state(pid: int) -> str:
    """The process state letter from /proc (R, S, D, T, Z...), or '' where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
