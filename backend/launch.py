"""Starting the ranks: spawn them on this machine, or run as one rank under torchrun or srun.

`launch(kind, config, world_size)` decides:
- under a launcher (RANK or SLURM_PROCID is set: torchrun, srun) this process is one rank and runs
  the job directly;
- otherwise it starts `world_size` ranks on localhost with torchrun's variables set and a free port
  (on CPU forked from this process after importing torch once, which saves seconds per rank on a small
  machine; on GPU fresh interpreters, `python -m backend.launch`), waits for them, and stops the others
  as soon as one fails (so a failing rank never leaves the rest hanging in a collective).

A job is a function `entry(config: dict) -> None` named in JOBS; the config travels as JSON in the
environment variable BACKEND_CONFIG.

Errors: a rank that fails says why in one line, `error: rank N: <cause>` (bad input, TwinError: exit
code 2; anything else: exit 1, with the traceback saved to a file the line names). When this module
spawned the ranks, they write that line to a file of the run instead of printing it; the launcher
prints the first cause (the earliest failure: the others are ranks that lost a peer), stops the other
ranks quietly and exits with the first rank's code. Under torchrun or srun each rank prints its line.

Cores: on CPU the forked ranks share the machine's cores as the scheduler places them. With
BACKEND_CPU_BIND=cores in the launcher's environment each rank is pinned to core `rank mod cores` (as
`srun --cpu-bind=cores` would), for measuring what placement does (benchmarks/cpu_run_spread.py); it is
off by default, since on the 2-core development VM it did not narrow the spread of repeated runs (see
that benchmark's docstring). A run's summary and bench's machine record say which was used.

Lifetime: spawned ranks die with the launcher (PR_SET_PDEATHSIG, and a check of the parent); a rank
that makes no progress (`heartbeat()`, called once per training step) for `progress_timeout` seconds
ends the run with one line naming it. A run holds an exclusive lock (flock) on its output and
checkpoint folders while it runs (`lock_dirs`); a second run on the same folders gets one line naming
the holder.
"""

from __future__ import annotations

import glob
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
import traceback

from twin.common import TwinError

JOBS = {"run": "backend.train:main", "replay": "backend.replay:main", "bench": "backend.bench:main",
        "memorization-study": "backend.study:main"}
CONFIG_ENV = "BACKEND_CONFIG"
SPAWNED_ENV = "BACKEND_SPAWNED"
RUN_DIR_ENV = "BACKEND_RUN_DIR"          # the spawned run's folder: error and heartbeat files
TIMEOUT_ENV = "BACKEND_PROGRESS_TIMEOUT"  # seconds; overrides the default progress timeout
CPU_BIND_ENV = "BACKEND_CPU_BIND"  # 'cores' (rank i on core i mod cores) or 'none'; set by the launcher
EXIT_BAD_INPUT = 2
LOCKED_DIRS = {"run": (("out", "--out"), ("ckpt_dir", "--ckpt-dir"))}  # config key, flag
PROGRESS_TIMEOUT_S = {"run": 900.0}  # per job kind; jobs that do not call heartbeat() have none
LOCK_FILE = ".lock"


def under_launcher() -> bool:
    """True when torchrun or Slurm started this process as one rank."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def env_rank() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's or Slurm's variables; (0, 0, 1) if neither.
    Raises TwinError when a variable is not a number or the rank is not below the world size."""
    env = os.environ
    if "RANK" in env:
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
        values = (env["RANK"], env.get("LOCAL_RANK", "0"), env.get("WORLD_SIZE", "1"))
    elif "SLURM_PROCID" in env:
        names = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
        values = (env["SLURM_PROCID"], env.get("SLURM_LOCALID", "0"), env.get("SLURM_NTASKS", "1"))
    else:
        return 0, 0, 1
    try:
        rank, local, world = (int(v) for v in values)
    except ValueError:
        raise TwinError(f"launcher variables {'/'.join(names)} = {'/'.join(values)} are not integers "
                        "(unset them to let `backend` start the ranks itself)") from None
    if not (0 <= rank < world and 0 <= local):
        raise TwinError(f"launcher variables {'/'.join(names)} = {'/'.join(values)}: the rank must be in "
                        "0..world size - 1")
    return rank, local, world


def check_world_size(grid_size: int, grid: str) -> None:
    """Raise TwinError when the launcher started a different number of ranks than the grid has."""
    if under_launcher():
        _, _, world = env_rank()
        if world != grid_size:
            raise TwinError(f"grid {grid} has {grid_size} ranks but the launcher started {world}: "
                            f"make G_x*G_y*G_z*G_data equal the number of processes")


# a rank's own interpreter, torch and gloo buffers: a forked gpt-tiny rank measured 290 MB resident, of
# which 120 MB its own (proportional set size, the rest shared with the launcher)
RANK_OVERHEAD_BYTES = 150 * 2**20


def available_memory() -> int | None:
    """Bytes of memory this machine can still give (MemAvailable of /proc/meminfo); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(program, device: str, compute_bytes: int) -> None:
    """Refuse, in one line and before anything is allocated, a run whose ranks would not fit in memory.

    Bytes per rank are the twin's estimate of the executor's peak (twin.memory.memory_per_gpu, with
    `compute_bytes` per activation: 4 for fp32, 2 for bf16) plus RANK_OVERHEAD_BYTES. On cpu every rank
    started on this machine (all of them, or LOCAL_WORLD_SIZE under a launcher) shares its RAM; on cuda
    each rank gets one GPU. Raises TwinError."""
    from twin.memory import GIB, memory_per_gpu

    per_rank = memory_per_gpu(program.model, program.grid, program.options, program.batch, program.seq_len,
                              activation_bytes=compute_bytes, gloo=device != "cuda").total
    what = f"{program.model.name} on grid {program.grid}"
    fix = "use a smaller model or batch, a grid with a larger G_x*G_y*G_z, or more micro-batches"
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            return
        have = torch.cuda.get_device_properties(env_rank()[1] % torch.cuda.device_count()).total_memory
        if per_rank > have:
            raise TwinError(f"{what} needs about {per_rank / GIB:.1f} GiB per rank, more than the "
                            f"{have / GIB:.1f} GiB of one GPU: {fix}")
        return
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) if under_launcher() else program.grid.size
    need = ranks * (per_rank + RANK_OVERHEAD_BYTES)
    have = available_memory()
    if have is not None and need > have:
        raise TwinError(f"{what} needs about {per_rank / GIB:.2f} GiB per rank x {ranks} rank(s) on this machine "
                        f"= {need / GIB:.1f} GiB, but only {have / GIB:.1f} GiB of memory is available: {fix}")


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multi_node() -> bool:
    """Best effort: does this job span several nodes?"""
    env = os.environ
    if int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")) or 1) > 1:
        return True
    world, local = env.get("WORLD_SIZE"), env.get("LOCAL_WORLD_SIZE")
    return bool(world and local and int(world) > int(local))


def fabric_plugin_found() -> bool:
    """Best effort: is a NCCL/RCCL network plugin (aws-ofi-nccl / aws-ofi-rccl) on the library path?"""
    if os.environ.get("NCCL_NET_PLUGIN"):
        return True
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += ["/usr/lib", "/usr/lib64", "/usr/local/lib", "/opt/amazon/aws-ofi-nccl/lib"]
    return any(glob.glob(os.path.join(d, pat)) for d in dirs
               for pat in ("libnccl-net*.so*", "librccl-net*.so*", "librccl-ofi*.so*"))


def fabric_warning(device: str) -> str | None:
    """A warning line when NCCL/RCCL will cross nodes without its libfabric plugin, else None."""
    if device != "cuda" or not multi_node() or fabric_plugin_found():
        return None
    return ("warning: NCCL/RCCL across nodes without a libfabric plugin (aws-ofi-nccl / aws-ofi-rccl) "
            "on LD_LIBRARY_PATH: on Slingshot collectives fall back to TCP and run 10-20x slower")


def run_job(kind: str, config: dict) -> int:
    """Run a job in this process (one rank); returns the exit code. A failure is one line (see the
    module docstring): printed here, or written to the run folder when this module spawned the rank."""
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
    except (TwinError, OSError) as e:
        return _report(rank, EXIT_BAD_INPUT, str(e))
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - one line here; the traceback goes to a file
        return _report(rank, 1, f"{type(e).__name__}: {e}".splitlines()[0], traceback.format_exc())
    return 0


def _report(rank: int, code: int, cause: str, trace: str | None = None) -> int:
    """Say why this rank failed: to the launcher's run folder when spawned, else on stderr."""
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
                f.write(f"{time.time()!r} {code}\n{line}\n")
            return code
        except OSError:
            pass
    print(line, file=sys.stderr, flush=True)
    return code


def env_world() -> int:
    try:
        return env_rank()[2]
    except TwinError:
        return 1


_beat_path: str | None = None
_beats = 0
FAIL_ENV = "BACKEND_TEST_FAIL_RANK"  # tests: this rank raises at its third heartbeat


def heartbeat() -> None:
    """Tell the launcher that this rank is making progress (cheap: one utime; a no-op when not spawned)."""
    global _beat_path, _beats
    _beats += 1
    if _beats == 3 and os.environ.get(FAIL_ENV) == os.environ.get("RANK"):
        raise RuntimeError(f"injected failure ({FAIL_ENV})")
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    if _beat_path is None or not _beat_path.startswith(run_dir):
        _beat_path = os.path.join(run_dir, f"beat{os.environ.get('RANK', '0')}")
    try:
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


def _preload(kind: str) -> None:
    """Import what the ranks need once, before forking, so that N ranks do not import torch N times."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: about a second per process)
    import torch.distributed  # noqa: F401
    module = JOBS[kind].split(":")[0]
    importlib.import_module(module)
    if kind == "run":
        for m in ("backend.model", "backend.optim", "backend.checkpoint", "backend.data"):
            importlib.import_module(m)


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
        return [subprocess.Popen([sys.executable, "-m", "backend.launch", kind, str(parent)],
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
    """Worker entry point: `python -m backend.launch <kind>` with the config in BACKEND_CONFIG."""
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
