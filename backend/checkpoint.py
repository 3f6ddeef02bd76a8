"""Sharded checkpoints: one file per rank plus a metadata file, published by an atomic rename.

Layout under the checkpoint directory:

    step_00000010/meta.json          grid, model spec, world size, step, format version
    step_00000010/rank_00003.pt      this rank's model shard, optimizer state, data position, RNG states
    latest                           the name of the last complete checkpoint (one line)

Saving: every rank writes its file into `.tmp.step_00000010/` and fsyncs it; after a barrier rank 0
writes meta.json, fsyncs the directory, renames it to `step_00000010` and then replaces `latest`
through a fsynced temporary file. A crash at any point leaves `latest` naming the previous complete
checkpoint. Loading checks the metadata against this run's grid and model on every rank (no
collective), so a mismatch is the same clear error everywhere and nothing hangs. torch is imported
only where tensors are saved or loaded, so checking a checkpoint from the command line is quick.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from twin.common import TwinError
from twin.grid import Grid
from twin.model import ModelSpec

FORMAT = "axonn-twin-backend-checkpoint/1"
LATEST = "latest"


class CheckpointError(TwinError):
    """A checkpoint that cannot be used by this run."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (so a rename inside it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    """RNG states of python, numpy, torch CPU and (if present) the current CUDA device."""
    import torch
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import torch
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def make_meta(step: int, grid: Grid, model: ModelSpec, extra: dict | None = None) -> dict:
    """The metadata of a checkpoint: what a run must match to load it."""
    return {"format": FORMAT, "step": step, "grid": str(grid), "world_size": grid.size,
            "model": asdict(model), **(extra or {})}


def save(ckpt_dir: str | Path, step: int, rank: int, state: dict, meta: dict, keep: int = 2) -> Path:
    """Collectively save `state` (this rank's shard) as checkpoint `step`; every rank calls it.

    keep: how many complete checkpoints to keep (older ones are deleted by rank 0; 0 keeps all).
    Returns the directory of the new checkpoint.
    """
    root = Path(ckpt_dir)
    name = step_dir_name(step)
    tmp, final = root / f".tmp.{name}", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crash while saving this step before
        tmp.mkdir()
    _barrier()
    import torch
    path = tmp / rank_file_name(rank)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        _fsync_path(tmp / "meta.json")
        _fsync_path(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_path(root)
        pointer = root / f".{LATEST}.tmp"
        with open(pointer, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, root / LATEST)
        _fsync_path(root)
        if keep > 0:
            old = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != name)
            for p in old[:max(0, len(old) - (keep - 1))]:
                shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return final


def latest(ckpt_dir: str | Path) -> Path | None:
    """The directory of the last complete checkpoint, or None when there is none."""
    root = Path(ckpt_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"checkpoint pointer {pointer} names {path.name}, which is incomplete or missing")
    return path


def read_meta(path: str | Path) -> dict:
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable meta.json ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def check_compatible(path: str | Path, grid: Grid, model: ModelSpec) -> dict:
    """Raise CheckpointError unless the checkpoint at `path` was written for this grid and model."""
    meta = read_meta(path)
    if meta["grid"] != str(grid):
        raise CheckpointError(f"checkpoint {path} was written with grid {meta['grid']}, this run uses "
                              f"grid {grid}: resume with --grid {meta['grid']} or use another --ckpt-dir")
    saved = meta["model"]
    if saved != asdict(model):
        diff = [k for k in saved if saved.get(k) != asdict(model).get(k)]
        raise CheckpointError(f"checkpoint {path} was written for model {saved.get('name')!r}, this run "
                              f"uses {model.name!r} (differs in {', '.join(diff) or 'fields'}): "
                              "use the same --model or another --ckpt-dir")
    return meta


def load(path: str | Path, rank: int, grid: Grid, model: ModelSpec,
         map_location: str | torch.device = "cpu") -> dict:
    """Check compatibility and return this rank's saved state (the dict given to `save`)."""
    check_compatible(path, grid, model)
    file = Path(path) / rank_file_name(rank)
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no file for rank {rank}")
    import torch
    return torch.load(file, map_location=map_location, weights_only=False)
