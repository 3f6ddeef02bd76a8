"""What a rank learns from its launcher's environment, and the checks made before any rank starts.

Under torchrun or srun (RANK or SLURM_PROCID is set) this process is one rank: `env_rank` reads its
rank, local rank and world size. `check_world_size` and `check_memory` refuse, in one line, a grid the
launcher did not start enough ranks for and a run whose ranks would not fit in memory;
`fabric_warning` warns when NCCL/RCCL will cross nodes without its libfabric plugin.
"""

from __future__ import annotations

import glob
import os

from topologies.common import TwinError


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


def env_world() -> int:
    try:
        return env_rank()[2]
    except TwinError:
        return 1


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

    Bytes per rank are the twin's estimate of the executor's peak (twin.predict.memory.memory_per_gpu, with
    `compute_bytes` per activation: 4 for fp32, 2 for bf16) plus RANK_OVERHEAD_BYTES. On cpu every rank
    started on this machine (all of them, or LOCAL_WORLD_SIZE under a launcher) shares its RAM; on cuda
    each rank gets one GPU. Raises TwinError."""
    from twin.predict.memory import GIB, memory_per_gpu

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
