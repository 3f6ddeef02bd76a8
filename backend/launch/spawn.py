"""Starting the ranks on this machine: spawn `world_size` of them, watch them, stop them all on a failure.

`spawn` starts the ranks with torchrun's variables set and a free port (on CPU forked from this process
after importing torch once, which saves seconds per rank on a small machine; on GPU fresh interpreters,
`python -m backend.launch.launcher`), waits for them, and stops the others as soon as one fails (so a failing
rank never leaves the rest hanging in a collective), printing the root cause (`_first_failure`: a
rank's own error, then a rank killed by a signal, before the ranks that lost a peer). A rank that makes
no progress (no heartbeat) for too long ends the run with one line naming it (`_Progress`: a fixed
`progress_timeout`, or a limit from the run's measured steps). SIGTERM and SIGUSR1 are passed on to
the ranks, which save and stop at the next step boundary; their exit code (128 + the signal) is then
not a failure.
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

from backend.launch.rank import (BUSY, CAUSE, CONFIG_ENV, CPU_BIND_ENV, ECHO, JOBS, PEER, RUN_DIR_ENV, SPAWNED_ENV,
                                 bind_rank, die_with_parent, run_job)
from topologies.common import TwinError

TIMEOUT_ENV = "BACKEND_PROGRESS_TIMEOUT"  # seconds; overrides the default progress timeout
PROGRESS_TIMEOUT_S = {"run"}  # the job kinds that call heartbeat() once per step (the others have no limit)
# The default progress limit: STARTUP_S until every rank has done two steps, and while a rank says it is
# busy (saving a checkpoint, writing a trace, evaluating); then STEPS_OF times the slowest interval
# measured between two heartbeats of any rank, and at least FLOOR_S.
STARTUP_S, STEPS_OF, FLOOR_S = 900.0, 20.0, 120.0
STOP_CODES = {128 + signal.SIGTERM, 128 + signal.SIGUSR1}  # a rank that stopped on a signal at a step boundary


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
    stop = _forward_stop_signals(procs)
    watch = _Progress(len(procs), run_dir, timeout)
    code, message = 0, None
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0, *STOP_CODES) for p in procs):
                break
            message = watch.stalled(procs)
            if message:
                code = 1
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        code, message = 130, "error: interrupted; stopping the ranks"
    finally:
        _restore(stop)
    codes = [p.poll() for p in procs]
    if None not in codes and set(codes) <= {0, *STOP_CODES} and set(codes) & STOP_CODES:
        shutil.rmtree(run_dir, ignore_errors=True)  # stopped at a step boundary: rank 0 said so in one line
        return max(codes)
    if stop["signal"] and None not in codes and set(codes) <= {0, -stop["signal"], *STOP_CODES}:
        print(f"error: stopped by {signal.Signals(stop['signal']).name} before the first step ended; nothing was saved",
              file=sys.stderr, flush=True)  # the signal came before the ranks could catch it
        shutil.rmtree(run_dir, ignore_errors=True)
        return 128 + stop["signal"]
    if not code and any(p.returncode not in (None, 0) for p in procs):
        code, message = _first_failure(procs, run_dir)
    if code:
        for p in procs:
            if p.poll() is None:
                p.kill()  # not SIGTERM: a training rank takes it as "save and stop at the next step"
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


def _forward_stop_signals(procs: list) -> dict:
    """Pass SIGTERM and SIGUSR1 (Slurm's warning before a time limit) on to every rank, which saves
    and stops at its next step boundary (backend.training.guard); a second signal kills the ranks.
    Returns what `_restore` undoes."""
    state = {"signal": None, "before": {}}

    def forward(signum, frame):
        again = state["signal"] is not None  # a second signal: stop the ranks now
        state["signal"] = state["signal"] or signum
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL if again else signum)
                except OSError:
                    pass
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        try:
            state["before"][sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: the ranks get no forwarded signals
            break
    return state


def _restore(stop: dict) -> None:
    for sig, handler in stop["before"].items():
        signal.signal(sig, handler)


def _progress_timeout(kind: str, given: float | None) -> float | None:
    """The fixed limit (seconds; 0: none), or None for the default that fits the run (`_Progress`)."""
    if given is not None:
        return float(given)
    env = os.environ.get(TIMEOUT_ENV)
    if env:
        try:
            return float(env)
        except ValueError:
            raise TwinError(f"{TIMEOUT_ENV}={env!r} is not a number of seconds") from None
    return None if kind in PROGRESS_TIMEOUT_S else 0.0


GRACE_S = 3.0  # after a first failure, how long the launcher waits for every rank to exit or say why


def _settle(procs: list, run_dir: str, grace: float = GRACE_S) -> None:
    """Wait (at most `grace` seconds) until every rank has exited or written its cause, so that the
    rank that failed first can be told from the peers that lost it (they often report first)."""
    deadline = time.time() + grace
    while time.time() < deadline:
        if all(p.poll() is not None or os.path.exists(os.path.join(run_dir, f"error{rank}"))
               for rank, p in enumerate(procs)):
            time.sleep(0.05)  # an error file is written before its rank exits: let it finish
            return
        time.sleep(0.05)


def _read_reports(procs: list, run_dir: str) -> dict[int, tuple[float, int, str, str]]:
    """rank -> (time, exit code, kind, line) of every rank that wrote why it failed (backend.launch.rank)."""
    reports = {}
    for rank in range(len(procs)):
        try:
            with open(os.path.join(run_dir, f"error{rank}")) as f:
                head, line = f.read().split("\n")[:2]
            when, code, *kind = head.split()
            reports[rank] = (float(when), int(code), kind[0] if kind else CAUSE, line)
        except (OSError, ValueError):
            continue
    return reports


def _first_failure(procs: list, run_dir: str) -> tuple[int, str | None]:
    """The exit code and line of the root cause, ranked:
    1. a rank that failed by itself (an error that is not a lost connection), the earliest first;
    2. a rank killed by a signal (kill -9, the out-of-memory killer), the lowest rank first;
    3. a rank that exited with an error code and said nothing;
    4. a rank that lost a peer (gloo's "Connection reset/closed by peer", NCCL's remote errors), the
       earliest first: only when no rank above explains it.
    """
    _settle(procs, run_dir)
    reports = _read_reports(procs, run_dir)
    own = sorted((when, rank) for rank, (when, _, kind, _) in reports.items() if kind not in (PEER, ECHO))
    if own:
        _, code, _, line = reports[own[0][1]]
        return code, line
    silent = [(rank, p.returncode) for rank, p in enumerate(procs) if rank not in reports and p.returncode not in (None, 0)]
    killed = [(rank, rc) for rank, rc in silent if rc < 0]
    if killed:
        rank, rc = killed[0]
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else f"signal {-rc}"
        return 1, f"error: rank {rank} was killed by {name}; the other ranks lost it and were stopped"
    if silent:
        rank, rc = silent[0]
        return rc, f"error: rank {rank} exited with code {rc}; stopping the other ranks"
    if reports:
        rank = min((when, rank) for rank, (when, *_) in reports.items())[1]
        _, code, _, line = reports[rank]
        return code, line
    return 1, "error: a rank failed without saying why; stopping the other ranks"


class _Progress:
    """Watches the ranks' heartbeat files; `stalled` names a rank that made no progress for too long.

    timeout: a fixed limit in seconds (0: none), or None for the default that fits the run: STARTUP_S
    until every rank has beaten twice and while a rank says it is busy, else max(FLOOR_S, STEPS_OF x
    the slowest interval seen between two heartbeats of a rank).
    """

    def __init__(self, ranks: int, run_dir: str, timeout: float | None):
        self.run_dir, self.timeout = run_dir, timeout
        self.last = [None] * ranks      # the mtime of each rank's beat file when last seen
        self.beats = [0] * ranks
        self.slowest = 0.0              # seconds, the longest interval between two beats of one rank

    def limit(self, rank: int) -> float:
        if self.timeout is not None:
            return self.timeout
        if min(self.beats) < 2 or self._busy(rank):
            return STARTUP_S
        return max(FLOOR_S, STEPS_OF * self.slowest)

    def _busy(self, rank: int) -> bool:
        try:
            with open(os.path.join(self.run_dir, f"beat{rank}")) as f:
                return f.read(16).strip() == BUSY
        except OSError:
            return False

    def stalled(self, procs: list) -> str | None:
        if self.timeout == 0:
            return None
        now = time.time()
        ages = []
        for rank, p in enumerate(procs):
            try:
                mtime = os.stat(os.path.join(self.run_dir, f"beat{rank}")).st_mtime
            except OSError:
                ages.append((0.0, rank))  # not started yet: its first beat comes at the job's start
                continue
            if mtime != self.last[rank]:
                if self.last[rank] is not None and self.beats[rank] >= 2:  # not the start-up's interval
                    self.slowest = max(self.slowest, mtime - self.last[rank])
                self.last[rank], self.beats[rank] = mtime, self.beats[rank] + 1
            ages.append((now - mtime, rank))
        late = [(age, rank) for age, rank in ages if age >= self.limit(rank)]
        if not late:
            return None
        stopped = [rank for rank, p in enumerate(procs) if _state(p.pid) == "T"]
        if stopped:
            rank, why = stopped[0], "it is stopped (SIGSTOP?)"
        else:
            rank, why = max(late)[1], "it or a collective it waits in is hung"
        age = next(a for a, r in ages if r == rank) if not stopped else max(late)[0]
        how = (f"the limit is {self.timeout:g} s" if self.timeout is not None else
               f"the limit is {self.limit(rank):.0f} s, from the run's slowest step; set one")
        return (f"error: rank {rank} made no progress for {age:.0f} s ({why}); ending the run ({how}: "
                f"--progress-timeout or {TIMEOUT_ENV})")


def _state(pid: int) -> str:
    """The process state letter from /proc (R, S, D, T, Z...), or '' where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
