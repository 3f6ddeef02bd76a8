"""Process groups of the 4D grid: one torch.distributed group per axis group, in the twin's rank order.

Rank order is the twin's (twin/program/grid.py): rank = x + G_x*(y + G_y*(z + G_z*d)). Every rank calls
`new_group` for every group of every axis in the same order (torch.distributed requires it); each rank
keeps the group of each axis that contains it. Axes of size 1 get no group (their collectives are left
out, as in the program). NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from twin.program.grid import AXES, Grid


@dataclass(frozen=True)
class LaunchInfo:
    """Who this process is, as the launcher says: global rank, rank on the node, number of ranks."""

    rank: int
    local_rank: int
    world_size: int


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as 'nid[001234-001240,001300]' or 'a01,a02'."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> LaunchInfo:
    """Initialize torch.distributed from torchrun's variables or Slurm's, and return who we are.

    torchrun: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Slurm (plain `srun`):
    SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS; MASTER_ADDR defaults to the first node of the job and
    MASTER_PORT to 29500. Without either, a single process (rank 0 of 1). backend: 'nccl' or 'gloo'
    (default: nccl when CUDA is available, else gloo). Does nothing but report if already initialized.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        info = LaunchInfo(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        info = LaunchInfo(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"]))
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        env.setdefault("MASTER_ADDR", first_host(nodes))
    else:
        info = LaunchInfo(0, 0, 1)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    if dist.is_initialized():
        return LaunchInfo(dist.get_rank(), info.local_rank, dist.get_world_size())
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        _warn_without_ofi_plugin()
    from datetime import timedelta
    dist.init_process_group(backend, init_method="env://", rank=info.rank, world_size=info.world_size,
                            timeout=timedelta(seconds=timeout_s))
    return info


def _warn_without_ofi_plugin() -> None:
    """Warn on a Slingshot (Cray) machine when NCCL/RCCL may lack its libfabric plugin (TCP fallback)."""
    if not os.path.exists("/opt/cray") or "FI_PROVIDER" in os.environ:
        return
    paths = os.environ.get("LD_LIBRARY_PATH", "")
    if "ofi" not in paths.lower():
        warnings.warn("Slingshot system without an aws-ofi-nccl/rccl plugin on LD_LIBRARY_PATH: "
                      "collectives may fall back to TCP and run 10-20x slower", stacklevel=2)


@dataclass
class ParallelContext:
    """This rank's place in the grid: coordinates, one process group per axis (None for size 1), device."""

    grid: Grid
    rank: int
    device: torch.device
    backend: str
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    dtype: torch.dtype | None = None  # compute dtype; None: bf16 on GPU, fp32 on CPU

    @classmethod
    def build(cls, grid: Grid, device: torch.device | str | None = None) -> "ParallelContext":
        """Create the axis groups of `grid` on the already initialized default process group.

        Raises ValueError when G_x*G_y*G_z*G_data differs from the world size.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_from_env() first")
        world, rank = dist.get_world_size(), dist.get_rank()
        if grid.size != world:
            raise ValueError(f"grid {grid} has {grid.size} ranks (the product of its fields) but the world "
                             f"size is {world}: launch {grid.size} processes or choose another grid")
        backend = dist.get_backend()
        if device is None:
            on_gpu = "nccl" in str(backend)
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        groups: dict[str, dist.ProcessGroup | None] = {}
        for axis in AXES + ("pipe", "expert", "edata"):  # "pipe": the stages' all-reduce (the clipping norm);
            groups[axis] = None                            # expert, edata: mixture of experts (a data subgroup)
            if grid.axis_size(axis) == 1:
                continue
            for members in grid.groups(axis):  # the same calls in the same order on every rank
                pg = dist.new_group(members)
                if rank in members:
                    groups[axis] = pg
        return cls(grid, rank, torch.device(device), backend, groups)

    @classmethod
    def from_env(cls, grid: Grid, backend: str | None = None) -> "ParallelContext":
        """init_from_env() and build(): the one call a training script needs."""
        info = init_from_env(backend)
        if grid.size != info.world_size:
            raise ValueError(f"grid {grid} needs {grid.size} ranks but {info.world_size} were launched "
                             f"(G_x*G_y*G_z*G_data must equal the world size)")
        return cls.build(grid)

    @property
    def coords(self) -> tuple[int, int, int, int]:
        """(x, y, z, data) of this rank."""
        return self.grid.coords(self.rank)

    def coord(self, axis: str) -> int:
        if axis == "pipe":
            return self.stage
        if axis in ("expert", "edata"):  # the place in the expert group (d % E_p), in the edata group (d // E_p)
            d, e = self.coords[AXES.index("data")], self.grid.expert
            return d % e if axis == "expert" else d // e
        return self.coords[AXES.index(axis)]

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 without a pipeline)."""
        return self.grid.stage(self.rank)

    def size(self, axis: str) -> int:
        return self.grid.axis_size(axis)

    @property
    def batch_shard(self) -> int:
        """Which of the G_z*G_data shards of the global batch this rank holds (z fastest)."""
        _, _, z, d = self.coords
        return z + self.grid.z * d

    @property
    def batch_shards(self) -> int:
        return self.grid.z * self.grid.data

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of weights in flight, activations and their gradients: `dtype` when set, else bf16 on
        GPU and fp32 on CPU (tests set bf16 on CPU to run the GPU's precision path)."""
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32


def world_size() -> int:
    """Ranks of the default process group (1 where torch.distributed is not initialized)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def collective_device() -> str:
    """Where a collective's tensors live: the GPU under NCCL, else the host."""
    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order (an object all-gather)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def sum_over_ranks(values: list[int]) -> list[int]:
    """The sums over the ranks of a few integers (one all-reduce of int64s)."""
    table = torch.tensor(values, dtype=torch.int64, device=collective_device())
    dist.all_reduce(table)
    return table.cpu().tolist()


def destroy() -> None:
    """Tear down torch.distributed (all groups)."""
    if dist.is_initialized():
        dist.destroy_process_group()
