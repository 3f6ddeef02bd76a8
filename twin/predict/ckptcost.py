"""What one checkpoint costs at a study's scale: its bytes, and the time to write and to read it on the
system's parallel file system (the `[filesystem]` table of its system file).

A checkpoint of `backend run` holds the fp32 weights and AdamW's two fp32 moments of every parameter,
12 bytes per parameter (backend.training.state; the data position, settings and RNG states are a few
kilobytes). Every GPU writes an equal share (torch.distributed.checkpoint spreads replicated tensors
over their replicas), so one GPU writes total / GPUs. The time is the total over the rate the job's
nodes reach: the least of the file system's aggregate figure, nodes x its per-node figure (each where
the system file gives it) and nodes x the node's NIC bandwidth (the bytes leave a node through its
NICs). A peak figure is a best case: other jobs share the file system.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's exp_avg and exp_avg_sq, fp32


@dataclass(frozen=True)
class CheckpointCost:
    """One checkpoint: bytes in all and per GPU; write and read times in seconds (None without figures)."""

    bytes_total: int
    bytes_per_gpu: float
    write_s: float | None
    read_s: float | None
    filesystem: str = ""
    source: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def checkpoint_cost(system, model, gpus: int, grid_y: int = 1) -> CheckpointCost:
    """The cost of one checkpoint of `model` (a ModelSpec, its vocabulary padded for G_y) trained on
    `gpus` GPUs of `system` (a SystemSpec)."""
    total = model.parameters(model.padded_vocab(grid_y)) * BYTES_PER_PARAMETER
    fs = system.filesystem
    if fs is None:
        return CheckpointCost(total, total / gpus, None, None)
    nodes = math.ceil(gpus / system.gpus_per_node)
    nics = nodes * system.nics_per_node * system.nic_bandwidth
    write, read = (min(r, nics) if r and nics > 0 else r for r in (fs.rate("write", nodes), fs.rate("read", nodes)))
    return CheckpointCost(total, total / gpus, total / write if write else None, total / read if read else None,
                          fs.name, fs.source)


def describe(cost: dict, system: str) -> str:
    """One line on a checkpoint's cost (`CheckpointCost.as_dict()`), for the simulate command."""
    def human_bytes(n: float) -> str:
        for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if n >= scale:
                return f"{n / scale:.1f} {unit}"
        return f"{n:.0f} B"

    head = (f"checkpoint: {human_bytes(cost['bytes_total'])} (fp32 weights and AdamW moments, "
            f"{BYTES_PER_PARAMETER} B per parameter; {human_bytes(cost['bytes_per_gpu'])} per GPU)")
    if cost["write_s"] is None and cost["read_s"] is None:
        return f"{head}: no file-system figures for {system} (add a [filesystem] table to its system file)"

    def t(s):
        return "-" if s is None else f"{s:.3g} s"
    return f"{head}: write {t(cost['write_s'])}, read {t(cost['read_s'])} on {cost['filesystem']} ({cost['source']})"
