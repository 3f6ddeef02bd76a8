"""One rank's side of a run: run its job, report why it failed, beat its heartbeat, bind its core.

A job is a function `entry(config: dict) -> None` named in JOBS; the config travels as JSON in the
environment variable BACKEND_CONFIG. `run_job` runs it in this process; a failure is one line,
`error: rank N: <cause>` (bad input, TwinError: exit code 2; anything else: exit 1, with the traceback
saved to a file the line names), written to the run folder when backend.launch.spawn started the rank,
else printed (see backend.launch.launcher). Each line is marked as the rank's own failure or as a lost
peer (`lost_peer`: gloo's "Connection reset/closed by peer", NCCL's remote errors), so that the
launcher reports the root cause; a file error names the file (`os_error_line`).

`heartbeat()`, called once per training step, tells the launcher the rank makes progress;
`die_with_parent` has the kernel end a spawned rank when its launcher dies; `bind_rank` pins a forked
rank to core `rank mod cores` when BACKEND_CPU_BIND=cores.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import sys
import tempfile
import time
import traceback

from backend.launch.env import env_rank, env_world
from topologies.common import TwinError, os_error_line

JOBS = {"run": "backend.training.train:main", "replay": "backend.bench.replay:main", "bench": "backend.bench.bench:main",
        "memorization-study": "backend.studies.study:main"}
CONFIG_ENV = "BACKEND_CONFIG"
SPAWNED_ENV = "BACKEND_SPAWNED"
RUN_DIR_ENV = "BACKEND_RUN_DIR"          # the spawned run's folder: error and heartbeat files
CPU_BIND_ENV = "BACKEND_CPU_BIND"  # 'cores' (rank i on core i mod cores) or 'none'; set by the launcher
EXIT_BAD_INPUT = 2


def run_job(kind: str, config: dict) -> int:
    """Run a job in this process (one rank); returns the exit code. A failure is one line (see the
    module docstring): printed here, or written to the run folder when backend.launch.spawn spawned the rank."""
    try:
        rank = env_rank()[0]
    except TwinError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    heartbeat()
    import warnings  # torch's memory tracker warns about optimizer state it cannot size: not the user's concern
    warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass", category=UserWarning)
    try:
        module, fn = JOBS[kind].split(":")
        getattr(importlib.import_module(module), fn)(config)
    except TwinError as e:
        if type(e).__name__ == "Stopped":  # a stop signal, honoured at a step boundary: not an error
            if rank == 0:
                print(f"backend run: {e}", file=sys.stderr, flush=True)
            return e.exit_code
        # a failure every rank sees alike (a NaN loss) is rank 0's to report; the others only echo it
        echo = getattr(e, "on_every_rank", False) and rank != 0
        return _report(rank, getattr(e, "exit_code", EXIT_BAD_INPUT), str(e), kind=ECHO if echo else CAUSE)
    except OSError as e:
        return _report(rank, EXIT_BAD_INPUT, os_error_line(e), kind=PEER if lost_peer(e) else CAUSE)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - one line here; the traceback goes to a file
        return _report(rank, 1, f"{type(e).__name__}: {e}".splitlines()[0], traceback.format_exc(),
                       kind=PEER if lost_peer(e) else CAUSE)
    return 0


# a rank's own failure; a rank that lost a peer; a failure every rank sees alike, which rank 0 reports
CAUSE, PEER, ECHO = "cause", "peer", "echo"
# what gloo, NCCL and torch.distributed say when the other end of a connection went away
_PEER_LOSS = re.compile(r"Connection (reset|closed) by peer|Connection refused|Broken pipe|remote worker|"
                        r"remote process|ncclRemoteError|NCCL communicator was aborted|Socket Timeout|"
                        r"(Read|Write) error .*peer|recvBytes|sendBytes", re.I)


def lost_peer(e: BaseException) -> bool:
    """Whether an error says this rank lost a peer (gloo's "Connection reset by peer" or "Connection
    closed by peer", NCCL's remote errors): a consequence of another rank's failure, not a cause."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"DistNetworkError", "ConnectionError"}) or bool(_PEER_LOSS.search(str(e)))


def _report(rank: int, code: int, cause: str, trace: str | None = None, kind: str = CAUSE) -> int:
    """Say why this rank failed: to the launcher's run folder when spawned, else on stderr.
    kind: CAUSE (this rank's own failure), PEER (it lost a peer) or ECHO (rank 0 says the same), for the
    launcher to rank them (backend.launch.spawn)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    where = ""
    if trace is not None:
        folder = run_dir or tempfile.gettempdir()
        path = os.path.join(folder, f"traceback-rank{rank}-{os.getpid()}.txt")
        try:
            with open(path, "w") as f:
                f.write(trace)
            where = f" (traceback in {path})"
        except OSError:
            pass
    line = f"error: rank {rank}: {cause}{where}" if env_world() > 1 else f"error: {cause}{where}"
    if run_dir and os.environ.get(SPAWNED_ENV) == "1":
        try:
            with open(os.path.join(run_dir, f"error{rank}"), "w") as f:
                f.write(f"{time.time()!r} {code} {kind}\n{line}\n")
            return code
        except OSError:
            pass
    if kind == ECHO:  # under torchrun or srun every rank prints its own line: rank 0 says this one
        return code
    if kind == PEER and env_world() > 1:
        line += " (this rank lost a peer: the line of the rank that failed says why)"
    print(line, file=sys.stderr, flush=True)
    return code


_beat_path: str | None = None
_beats = 0
_state = ""
FAIL_ENV = "BACKEND_TEST_FAIL_RANK"  # tests: this rank raises at its third heartbeat
BUSY = "busy"


def heartbeat(state: str = "") -> None:
    """Tell the launcher that this rank is making progress (cheap: one utime; a no-op when not spawned).
    state: BUSY before work that may take much longer than a step (a checkpoint, a trace, an evaluation),
    for which the launcher allows its start-up limit; "" again once it is done."""
    global _beat_path, _beats, _state
    if not state:
        _beats += 1
    if _beats == 3 and not state and os.environ.get(FAIL_ENV) == os.environ.get("RANK"):
        raise RuntimeError(f"injected failure ({FAIL_ENV})")
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    if _beat_path is None or not _beat_path.startswith(run_dir):
        _beat_path = os.path.join(run_dir, f"beat{os.environ.get('RANK', '0')}")
    try:
        if state != _state:
            with open(_beat_path, "w") as f:
                f.write(state)
            _state = state
        else:
            with open(_beat_path, "a"):
                os.utime(_beat_path)
    except OSError:
        pass


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent (the launcher) dies (Linux), and check now."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the launcher died before the line above
        os._exit(1)


def bind_cores(rank: int, cores: list[int]) -> set[int]:
    """The cores rank `rank` runs on when bound: core `rank mod len(cores)` of `cores` (as
    `srun --cpu-bind=cores` places one task per core, round robin)."""
    return {cores[rank % len(cores)]}


def bind_rank(rank: int) -> set[int]:
    """Pin this process (and the threads it starts later: torch's, gloo's) to its rank's core when
    BACKEND_CPU_BIND is 'cores'; returns the cores it may run on afterwards."""
    if os.environ.get(CPU_BIND_ENV) == "cores" and hasattr(os, "sched_setaffinity"):
        cores = sorted(int(c) for c in os.environ.get("BACKEND_CPU_BIND_CORES", "").split(",") if c)
        if cores:
            os.sched_setaffinity(0, bind_cores(rank, cores))
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
