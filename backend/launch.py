"""Starting the ranks: spawn them on this machine, or run as one rank under torchrun or srun.

`launch(kind, config, world_size)` decides:
- under a launcher (RANK or SLURM_PROCID is set: torchrun, srun) this process is one rank and runs
  the job directly;
- otherwise it starts `world_size` ranks on localhost with torchrun's variables set and a free port
  (on CPU forked from this process after importing torch once, which saves seconds per rank on a small
  machine; on GPU fresh interpreters, `python -m backend.launch`), waits for them, and stops the others
  as soon as one fails (so a failing rank never leaves the rest hanging in a collective).

A job is a function `entry(config: dict) -> None` named in JOBS; the config travels as JSON in the
environment variable BACKEND_CONFIG. Bad input (TwinError) ends a rank with one line on stderr and
exit code 2; when this module spawned the ranks only rank 0 prints it (all ranks see the same error).
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import socket
import subprocess
import sys
import time

from twin.common import TwinError

JOBS = {"run": "backend.train:main", "replay": "backend.replay:main", "bench": "backend.bench:main",
        "memorization-study": "backend.study:main"}
CONFIG_ENV = "BACKEND_CONFIG"
SPAWNED_ENV = "BACKEND_SPAWNED"
EXIT_BAD_INPUT = 2


def under_launcher() -> bool:
    """True when torchrun or Slurm started this process as one rank."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def env_rank() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's or Slurm's variables; (0, 0, 1) if neither."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))
    if "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env.get("SLURM_NTASKS", 1))
    return 0, 0, 1


def check_world_size(grid_size: int, grid: str) -> None:
    """Raise TwinError when the launcher started a different number of ranks than the grid has."""
    if under_launcher():
        _, _, world = env_rank()
        if world != grid_size:
            raise TwinError(f"grid {grid} has {grid_size} ranks but the launcher started {world}: "
                            f"make G_x*G_y*G_z*G_data equal the number of processes")


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
    """Run a job in this process (one rank); returns the exit code."""
    rank = env_rank()[0]
    quiet = os.environ.get(SPAWNED_ENV) == "1" and rank != 0
    try:
        module, fn = JOBS[kind].split(":")
        getattr(importlib.import_module(module), fn)(config)
    except (TwinError, OSError) as e:
        if not quiet:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    return 0


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


def _forked_rank(kind: str, config: dict, env: dict) -> None:
    import torch
    os.environ.update(env)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # torch read it before the fork
    code = run_job(kind, config)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start_ranks(kind: str, config: dict, world_size: int, fork: bool) -> list:
    """Start the ranks: forked from this process (CPU), or fresh interpreters (GPU: CUDA and fork
    do not mix). Returns handles with poll()/terminate()/kill()/wait() and returncode."""
    import multiprocessing as mp
    port = free_port()
    envs = []
    for rank in range(world_size):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               SPAWNED_ENV: "1"}
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
        envs.append(env)
    if not fork:
        return [subprocess.Popen([sys.executable, "-m", "backend.launch", kind],
                                 env={**os.environ, **env, CONFIG_ENV: json.dumps(config)}) for env in envs]
    _preload(kind)
    ctx = mp.get_context("fork")
    procs = [_Forked(ctx.Process(target=_forked_rank, args=(kind, config, env))) for env in envs]
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

    def terminate(self):
        self.proc.terminate()

    def kill(self):
        self.proc.kill()

    def wait(self, timeout=None):
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("rank", timeout)
        return self.proc.exitcode


def spawn(kind: str, config: dict, world_size: int, poll_s: float = 0.05, fork: bool | None = None) -> int:
    """Start `world_size` local ranks of job `kind`, wait, and return the first failing exit code.

    fork: fork the ranks from this process (default on CPU) or start fresh interpreters (on GPU).
    """
    if fork is None:
        fork = config.get("device", "cpu") == "cpu"
    procs = _start_ranks(kind, config, world_size, fork=fork)
    code = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0]
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        code = 130
    if code:
        if code < 0:
            rank = next(i for i, p in enumerate(procs) if p.returncode == code)
            print(f"error: rank {rank} was killed by signal {-code}; stopping the other ranks",
                  file=sys.stderr, flush=True)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return code
    return next((p.returncode for p in procs if p.returncode), 0)


def launch(kind: str, config: dict, world_size: int) -> int:
    """Run job `kind` on `world_size` ranks: directly under a launcher, else by spawning them."""
    if under_launcher():
        return run_job(kind, config)
    if world_size == 1:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        return run_job(kind, config)
    return spawn(kind, config, world_size)


def main() -> None:
    """Worker entry point: `python -m backend.launch <kind>` with the config in BACKEND_CONFIG."""
    kind = sys.argv[1]
    config = json.loads(os.environ[CONFIG_ENV])
    code = run_job(kind, config)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown of torch (seconds on a busy machine)


if __name__ == "__main__":
    main()
