"""Starting the ranks: spawn them on this machine, or run as one rank under torchrun or srun.

`launch(kind, config, world_size)` decides:
- under a launcher (RANK or SLURM_PROCID is set: torchrun, srun) this process is one rank and runs
  the job directly;
- otherwise it starts `world_size` ranks on localhost with torchrun's variables set and a free port
  (on CPU forked from this process after importing torch once, which saves seconds per rank on a small
  machine; on GPU fresh interpreters, `python -m backend.launch.launcher`), waits for them, and stops the others
  as soon as one fails (so a failing rank never leaves the rest hanging in a collective).

A job is a function `entry(config: dict) -> None` named in JOBS; the config travels as JSON in the
environment variable BACKEND_CONFIG.

Errors: a rank that fails says why in one line, `error: rank N: <cause>` (bad input, TwinError: exit
code 2; anything else: exit 1, with the traceback saved to a file the line names). When this module
spawned the ranks, they write that line to a file of the run instead of printing it; the launcher
prints the root cause (backend.launch.spawn: a rank's own error, then a rank killed by a signal, before
the ranks that lost a peer, which often report first), stops the other ranks and exits with that
rank's code. Under torchrun or srun each rank prints its line. SIGTERM and SIGUSR1 are passed on to
spawned ranks, which save and stop at the next step boundary (backend.training.guard).

Cores: on CPU the forked ranks share the machine's cores as the scheduler places them. With
BACKEND_CPU_BIND=cores in the launcher's environment each rank is pinned to core `rank mod cores` (as
`srun --cpu-bind=cores` would), for measuring what placement does; it is off by default, since
pinning did not narrow the spread of repeated runs. A run's summary and bench's machine record say
which was used.

Lifetime: spawned ranks die with the launcher (PR_SET_PDEATHSIG, and a check of the parent); a rank
that makes no progress (`heartbeat()`, called once per training step) for `progress_timeout` seconds
ends the run with one line naming it (by default a limit that fits the run's measured steps:
backend.launch.spawn). A run holds an exclusive lock (flock) on its output and
checkpoint folders while it runs (`lock_dirs`); a second run on the same folders gets one line naming
the holder.

The modules under it: backend.launch.env (the launcher's variables, the checks before a run),
backend.launch.rank (one rank: its job, failure line, heartbeat, core), backend.launch.spawn (local
ranks: starting, watching, stopping them). This module locks a run's folders and decides.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from backend.launch.env import env_rank, under_launcher
from backend.launch.rank import CONFIG_ENV, die_with_parent, run_job
from backend.launch.spawn import free_port, spawn
from topologies.common import TwinError

LOCKED_DIRS = {"run": (("out", "--out"), ("ckpt_dir", "--ckpt-dir"))}  # config key, flag
LOCK_FILE = ".lock"


def lock_dirs(kind: str, config: dict) -> list[int]:
    """Lock the folders a job writes (LOCKED_DIRS), creating them; returns the open lock files, which
    hold the locks until closed (or this process and the ranks it forked exit). Raises TwinError
    naming the holder when another run holds one."""
    import fcntl
    import socket as _socket

    held, seen = [], set()
    for key, flag in LOCKED_DIRS.get(kind, ()):
        folder = config.get(key)
        if not folder:
            continue
        path = os.path.realpath(folder)
        if path in seen:
            continue
        seen.add(path)
        try:
            os.makedirs(path, exist_ok=True)
            fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise TwinError(f"{flag} {folder}: cannot create or lock it ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 500).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            for other in held:
                os.close(other)
            raise TwinError(f"{flag} {folder} is in use by another run ({holder}): wait for it to end "
                            f"or choose another {flag}") from None
        info = (f"pid {os.getpid()} on {_socket.gethostname()} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}: {' '.join(sys.argv)[:200]}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        held.append(fd)
    return held


def unlock(held: list[int]) -> None:
    for fd in held:
        try:
            os.close(fd)
        except OSError:
            pass


def launch(kind: str, config: dict, world_size: int, progress_timeout: float | None = None) -> int:
    """Run job `kind` on `world_size` ranks: directly under a launcher, else by spawning them.
    The folders the job writes are locked for its duration (by rank 0 under a launcher)."""
    if under_launcher():
        held = lock_dirs(kind, config) if env_rank()[0] == 0 else []
        try:
            return run_job(kind, config)
        finally:
            unlock(held)
    held = lock_dirs(kind, config)
    try:
        if world_size == 1:  # this process is the rank; the variables are its while the job runs only
            one = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()))
            before = {k: os.environ.get(k) for k in one}
            os.environ.update(one)
            try:
                return run_job(kind, config)
            finally:  # else a second job in this process (the Python API) would think a launcher started it
                for k, v in before.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        return spawn(kind, config, world_size, progress_timeout=progress_timeout)
    finally:
        unlock(held)


def main() -> None:
    """Worker entry point: `python -m backend.launch.launcher <kind>` with the config in BACKEND_CONFIG."""
    kind = sys.argv[1]
    if len(sys.argv) > 2:
        die_with_parent(int(sys.argv[2]))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = json.loads(os.environ[CONFIG_ENV])
    code = run_job(kind, config)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown of torch (seconds on a busy machine)


if __name__ == "__main__":
    main()
