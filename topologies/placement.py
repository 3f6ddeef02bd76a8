"""Rank placement: which GPU of which node each rank runs on.

As `srun` does, ranks fill a node (local GPU 0, 1, ...) before the next node, so with a 4D grid the
x-groups (consecutive ranks) sit inside a node whenever G_x divides the GPUs per node. The nodes
come from contiguous groups by default (`placement="contiguous"`: nodes 0, 1, 2, ... of the machine),
or are drawn at random from the whole machine (`placement="scattered"`, seeded by `seed`), as a busy
batch system hands them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from topologies.system import SystemSpec
from topologies.common import InputError

PLACEMENTS = ("contiguous", "scattered")


@dataclass(frozen=True)
class Placement:
    """ranks -> GPUs. Arrays are indexed by rank; `gpu` is the machine-wide GPU id
    (node * gpus_per_node + local)."""

    system: SystemSpec
    kind: str
    nodes: np.ndarray   # the job's nodes in rank order (node indices of the machine)
    node: np.ndarray    # node of each rank
    local: np.ndarray   # GPU index inside its node of each rank
    gpu: np.ndarray     # machine-wide GPU id of each rank

    @property
    def ranks(self) -> int:
        return len(self.gpu)

    @property
    def group(self) -> np.ndarray:
        """Dragonfly group of each rank."""
        return self.system.group_of_node(self.node)

    def groups_used(self) -> np.ndarray:
        return np.unique(self.system.group_of_node(self.nodes))


def place(system: SystemSpec, ranks: int, placement: str = "contiguous", seed: int = 0) -> Placement:
    """Place `ranks` ranks (GPUs) on `system`. Raises InputError if the job does not fit the machine."""
    if placement not in PLACEMENTS:
        from topologies.datafile import did_you_mean
        raise InputError(f"unknown placement {placement!r}:{did_you_mean(placement, PLACEMENTS)} "
                         f"choose one of {', '.join(PLACEMENTS)}")
    if not isinstance(ranks, (int, np.integer)) or ranks < 1:
        raise InputError(f"a job needs at least one GPU, got {ranks!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"the seed of a scattered placement must be an integer >= 0, got {seed!r}")
    gpn = system.gpus_per_node
    need = -(-ranks // gpn)
    if need > system.nodes:
        raise InputError(f"a job of {ranks} GPUs needs {need} nodes but {system.name} has {system.nodes} nodes "
                        f"({system.total_gpus} GPUs): use at most {system.total_gpus} GPUs")
    if placement == "contiguous":
        nodes = np.arange(need, dtype=np.int64)
    else:
        rng = np.random.default_rng(seed)
        nodes = np.sort(rng.choice(system.nodes, size=need, replace=False)).astype(np.int64)
    r = np.arange(ranks, dtype=np.int64)
    node = nodes[r // gpn]
    local = r % gpn
    return Placement(system, placement, nodes, node, local, node * gpn + local)
