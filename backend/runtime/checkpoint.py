"""Sharded checkpoints: each rank's files plus a metadata file, published by an atomic rename.

Layout under the checkpoint directory:

    step_00000010/meta.json          grid, model spec, world size, step, format version, and the size
                                     and SHA-256 of every file (meta.json carries its own checksum)
    step_00000010/.metadata          torch.distributed.checkpoint's (DCP) index of the tensors' chunks
    step_00000010/__3_0.distcp       rank 3's chunks (format /3: backend.runtime.dcp, any grid reads it)
    step_00000010/rank_00003.pt      or, format /2 (before DCP; read on its own grid only): rank 3's
                                     model shard, optimizer state, data position, RNG states
    latest                           the name of the last complete checkpoint (one line)

Saving: every rank writes its file(s) into `.tmp.step_00000010/`, hashing as it goes, and fsyncs;
once every rank has written, rank 0 collects the checksums (format /2: through a `.sha256` file beside
each rank's; DCP: backend.runtime.dcp_save.write gathers them) into meta.json, fsyncs the directory, renames it to
`step_00000010` and then replaces `latest` through a fsynced temporary file. A crash at any point
leaves `latest` naming the previous complete checkpoint.

Loading never trusts a file: meta.json must parse, carry every key with the right type and match its
own checksum; every file must exist with its recorded size (`candidates`, cheap), and the files must
match their SHA-256 before torch reads them (format /2: a rank its own file in `load`; DCP: the ranks
share out the files in `find_resume`, `verify` checks them all in one process). `find_resume` walks the candidates
newest first (the one `latest` names, then every other step, newest first) and takes the first whose
files are good on every rank (the ranks agree by an all-reduce, so they all load the same step); when
that is not the one `latest` names, rank 0 prints one warning line. When no step is good it refuses
with one line. torch is imported only where tensors are saved or loaded, so checking a checkpoint
from the command line is quick.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from topologies.common import TwinError, finite_json, naming, remove_quietly, write_atomic
from twin.program.grid import Grid
from twin.program.model import ModelSpec


FORMAT = "axonn-twin-backend-checkpoint/3"      # torch.distributed.checkpoint files (backend.runtime.dcp)
OLD_FORMAT = "axonn-twin-backend-checkpoint/2"  # one torch.save file per rank: read on its own grid only
LATEST = "latest"
CRASH_IN_SAVE_ENV = "BACKEND_TEST_CRASH_IN_SAVE"  # tests: rank 0 SIGKILLs itself in the save of this step,
# after every rank wrote its files and before meta.json, the rename and `latest`
META_KEYS = {"format": str, "step": int, "grid": str, "world_size": int, "model": dict, "files": dict,
             "checksum": str}


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
    """The metadata of a checkpoint: what a run must match to load it (`files` is filled by `save`)."""
    return {"format": FORMAT, "step": step, "grid": str(grid), "world_size": grid.size,
            "model": asdict(model), **(extra or {})}


def _meta_checksum(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(finite_json(body, sort_keys=True).encode()).hexdigest()


class _HashingWriter:
    """A binary file that hashes (SHA-256) and counts what is written through it."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None  # torch.save hides a failed write behind its own RuntimeError

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save(ckpt_dir: str | Path, step: int, rank: int, state: dict, meta: dict, keep: int = 2,
         sharded: bool = False) -> Path:
    """Collectively save `state` (this rank's shard) as checkpoint `step`; every rank calls it.

    keep: how many complete checkpoints to keep (older ones are deleted by rank 0; 0 keeps all).
    sharded: `state` is a DCP state dict (backend.runtime.dcp: boxes of full tensors, any grid reads
    it); else one torch.save file per rank (the format before, read on its own grid only).
    Returns the directory of the new checkpoint.
    """
    root = Path(ckpt_dir)
    name = step_dir_name(step)
    tmp, final = root / f".tmp.{name}", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if final.exists() and not final.is_dir():
            raise CheckpointError(f"{final} is a file, not a checkpoint folder: move it away or choose another "
                                  "--ckpt-dir")
        for debris in root.glob(".tmp.step_*"):  # of a crash while saving (the run holds the directory's lock)
            shutil.rmtree(debris, ignore_errors=True)
        tmp.mkdir()
    if sharded:  # its first all-gather is the barrier after tmp is made; rank 0 gets every file's checksum
        files = _write_sharded(tmp, rank, state)
    else:
        _barrier()
        _write_rank_file(tmp, rank, state)
        _barrier()
        files = None
    if rank == 0 and os.environ.get(CRASH_IN_SAVE_ENV) == str(step):
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        _publish(root, tmp, final, name, {**meta, "format": FORMAT if sharded else OLD_FORMAT}, keep, files)
    _barrier()
    return final


def _write_sharded(tmp: Path, rank: int, state: dict) -> dict[str, dict]:
    """Every rank's DCP files (backend.runtime.dcp_save.write); on rank 0, name -> {bytes, sha256} of each."""
    from backend.runtime.dcp_save import write

    return {name: {"bytes": size, "sha256": digest} for name, (digest, size) in write(state, tmp, rank).items()}


def _write_rank_file(tmp: Path, rank: int, state: dict) -> None:
    import torch
    path = tmp / rank_file_name(rank)
    try:  # a failure (a full disk) names the file and leaves no partial one behind
        with naming(path):
            with open(path, "wb") as f:
                out = _HashingWriter(f)
                try:
                    torch.save(state, out)
                except Exception:
                    if out.error is not None:  # a full disk, not torch's "unexpected pos" that follows it
                        raise out.error from None
                    raise
                f.flush()
                os.fsync(f.fileno())
            write_atomic(tmp / f"{path.name}.sha256", f"{out.sha.hexdigest()} {out.size}\n")
    except BaseException:
        remove_quietly(path)
        raise


def _publish(root: Path, tmp: Path, final: Path, name: str, meta: dict, keep: int, files: dict | None) -> None:
    """Rank 0: meta.json with every file's checksum (`files`: name -> {bytes, sha256}; None: read from
    the ranks' `.sha256` files), the atomic rename, `latest`, old steps removed."""
    if files is None:
        files = {}
        for sidecar in sorted(tmp.glob("*.sha256")):
            digest, size = sidecar.read_text().split()
            files[sidecar.name.removesuffix(".sha256")] = {"bytes": int(size), "sha256": digest}
            sidecar.unlink()
    meta = {**meta, "files": files}
    meta["checksum"] = _meta_checksum(meta)
    write_atomic(tmp / "meta.json", finite_json(meta, indent=1))
    _fsync_path(tmp / "meta.json")
    _fsync_path(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_path(root)
    pointer = root / f".{LATEST}.tmp"
    try:
        with naming(root / LATEST), open(pointer, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, root / LATEST)
    except BaseException:
        remove_quietly(pointer)
        raise
    _fsync_path(root)
    if keep > 0:
        old = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != name)
        for p in old[:max(0, len(old) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)


def read_meta(path: str | Path) -> dict:
    """The metadata of the checkpoint at `path`, checked: every key with its type, its own checksum,
    and an entry (size, SHA-256) for each rank file of its grid. Raises CheckpointError."""
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable meta.json ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: meta.json is not a JSON object")
    if meta.get("format") not in (FORMAT, OLD_FORMAT):
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    for key, kind in META_KEYS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise CheckpointError(f"checkpoint {path}: meta.json lacks a valid {key!r}")
    if meta["checksum"] != _meta_checksum(meta):
        raise CheckpointError(f"checkpoint {path}: meta.json does not match its checksum (damaged)")
    try:
        grid = Grid.parse(meta["grid"])
    except TwinError:
        raise CheckpointError(f"checkpoint {path}: meta.json has an invalid grid {meta['grid']!r}") from None
    needed = [rank_file_name(r) for r in range(grid.size)] if meta["format"] == OLD_FORMAT else [".metadata"]
    for name in needed:
        entry = meta["files"].get(name)
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"checkpoint {path}: meta.json has no checksum for {name}")
    return meta


def _check_sizes(path: Path, meta: dict) -> None:
    for name, entry in meta["files"].items():
        file = path / name
        try:
            size = file.stat().st_size
        except OSError:
            raise CheckpointError(f"checkpoint {path}: {name} is missing") from None
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} has {size} bytes, {entry['bytes']} were written")


def candidates(ckpt_dir: str | Path) -> tuple[list[Path], list[str]]:
    """The checkpoints of `ckpt_dir` that pass the cheap checks (meta.json, sizes), newest first with
    the one `latest` names ahead of the rest; and one line per problem found on the way."""
    root = Path(ckpt_dir)
    problems, order = [], []
    pointer = root / LATEST
    if pointer.exists() or pointer.is_symlink():
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            problems.append(f"{pointer} is unreadable ({type(e).__name__})")
        else:
            if name.startswith("step_") and "/" not in name and (root / name).is_dir():
                order.append(root / name)
            else:
                problems.append(f"{pointer} does not name a checkpoint ({name[:40]!r})")
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: p.name, reverse=True)
    order += [p for p in steps if p not in order]
    good = []
    for path in order:
        try:
            _check_sizes(path, read_meta(path))
            good.append(path)
        except CheckpointError as e:
            problems.append(str(e))
    return good, problems


def latest(ckpt_dir: str | Path) -> Path | None:
    """The checkpoint a run resumes from (the first of `candidates`), or None when the directory
    holds none at all. Raises CheckpointError when it holds checkpoints and none is usable."""
    good, problems = candidates(ckpt_dir)
    if good:
        return good[0]
    if problems:
        raise CheckpointError(f"no usable checkpoint in {ckpt_dir}: {problems[0]}"
                              + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                              + "; remove it or choose another --ckpt-dir")
    return None


def _file_ok(path: Path, rank: int, world: int = 1) -> bool:
    """Whether this rank's share of the checkpoint's files match their SHA-256: its own file (the old
    format), or every world-th file of the checkpoint (the ranks split the hashing)."""
    try:
        meta = read_meta(path)
        if meta["format"] == OLD_FORMAT:
            names = [rank_file_name(rank)]
        else:
            names = sorted(meta["files"])[rank::world]
        return all(file_sha256(path / n) == meta["files"][n]["sha256"] for n in names)
    except (OSError, CheckpointError, KeyError):
        return False


def verify(path: str | Path) -> dict:
    """Check every file of the checkpoint at `path` against its SHA-256 (in this process); returns
    its meta.json. Raises CheckpointError naming a damaged file."""
    path = Path(path)
    meta = read_meta(path)
    _check_sizes(path, meta)
    for name, entry in sorted(meta["files"].items()):
        if file_sha256(path / name) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {path / name} does not match its checksum (damaged): use another "
                                  "step or remove it")
    return meta


def file_sha256(file: Path) -> str:
    sha = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def find_resume(ckpt_dir: str | Path, rank: int) -> Path | None:
    """Collectively pick the checkpoint to resume from: the newest candidate whose every rank file
    matches its checksum (each rank hashes its own; they agree by an all-reduce). Rank 0 prints one
    warning line when that is not the checkpoint `latest` names. None when there is no checkpoint;
    CheckpointError (the same on every rank) when there are some and none is good."""
    import torch
    import torch.distributed as dist

    root = Path(ckpt_dir)
    good, problems = candidates(root)
    named = _named(root)
    on = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if on else 1
    for path in good:
        ok = torch.tensor([1 if _file_ok(path, rank, world) else 0], dtype=torch.int32)
        if on:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item():
            if rank == 0 and path != named and (problems or named is not None):
                why = problems[0] if problems else f"{named} has a damaged rank file"
                print(f"warning: {why}; resuming from {path.name}, the newest good checkpoint", file=sys.stderr,
                      flush=True)
            return path
        problems.append(f"{path} has a rank file that does not match its checksum")
    if problems:
        raise CheckpointError(f"no usable checkpoint in {root}: {problems[0]}"
                              + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                              + "; remove it or choose another --ckpt-dir")
    return None


def _named(root: Path) -> Path | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if name.startswith("step_") and "/" not in name else None


def check_compatible(path: str | Path, grid: Grid, model: ModelSpec) -> dict:
    """Raise CheckpointError unless the checkpoint at `path` can be loaded by a run of this model on
    this grid: the same model; any grid, but the old per-rank format only on its own grid."""
    meta = read_meta(path)
    if meta["format"] == OLD_FORMAT and meta["grid"] != str(grid):
        raise CheckpointError(f"checkpoint {path} is in the per-rank format of an older version, which only its "
                              f"grid {meta['grid']} reads: resume once with --grid {meta['grid']} (its next "
                              "checkpoint is in the new format, which any grid reads) or use another --ckpt-dir")
    saved = meta["model"]
    if meta["format"] == FORMAT and saved == asdict(model) and not model.is_llama:
        old, new = model.padded_vocab(Grid.parse(meta["grid"]).y), model.padded_vocab(grid.y)
        if old != new:  # a GPT's padding rows take part in its loss
            raise CheckpointError(f"checkpoint {path} pads the vocabulary of {model.name} to {old} rows (grid "
                                  f"{meta['grid']}), grid {grid} pads it to {new}: choose a G_y that pads it alike")
    if saved != asdict(model):
        diff = [k for k in saved if saved.get(k) != asdict(model).get(k)]
        raise CheckpointError(f"checkpoint {path} was written for model {saved.get('name')!r}, this run "
                              f"uses {model.name!r} (differs in {', '.join(diff) or 'fields'}): "
                              "use the same --model or another --ckpt-dir")
    return meta


def read_rank(path: str | Path, rank: int, map_location: str | torch.device = "cpu") -> dict:
    """This rank's saved state from the checkpoint at `path`, after checking the file's SHA-256."""
    import torch

    path = Path(path)
    entry = read_meta(path)["files"].get(rank_file_name(rank))
    file = path / rank_file_name(rank)
    try:
        data = file.read_bytes()
    except OSError:
        raise CheckpointError(f"checkpoint {path} has no file for rank {rank}") from None
    if entry is None or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint {file} does not match its checksum (damaged): resume from another "
                              "step or remove it")
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    except Exception as e:  # noqa: BLE001 - the checksum matched, so this is a file torch cannot read
        raise CheckpointError(f"checkpoint {file} cannot be read ({type(e).__name__})") from None


def load(path: str | Path, rank: int, grid: Grid, model: ModelSpec,
         map_location: str | torch.device = "cpu") -> dict:
    """Check compatibility and the file's checksum; return this rank's saved state (the dict given to `save`)."""
    check_compatible(path, grid, model)
    return read_rank(path, rank, map_location)
