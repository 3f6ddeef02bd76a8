"""Saving a DCP checkpoint collectively: who writes which box, and what the ranks tell one another.

Every rank calls `write` with its state dict (backend.runtime.dcp: `Boxes` of full tensors, plain
tensors, objects). A save needs three agreements:
1. one writer for each box (or object) that several ranks hold: data-parallel replicas, norms
   replicated over y and z, the `train` entry every rank gives. `_assign` spreads them, the largest
   first to the holder with the fewest bytes so far, from every rank's list of (name, offsets, bytes);
2. each rank writes its file (backend.runtime.dcp_write), and every rank learns whether any failed;
3. rank 0 learns where each item lies in each file, to write `.metadata`.

DCP's own save gathers every rank's plan to rank 0, scatters the global plan back and gathers the
results: three collectives of pickled plans at every save. Here a save takes two all-reduces of one
or two integers, each as cheap as the barrier the per-rank format needs at the same place:
- before writing, each rank's 32-bit hash of its list and its memory of the sum of those hashes
  when the writers were last chosen. When every rank remembers today's sum (a training run saves
  the same shards every time), the writers are those chosen then; else one object all-gather of the
  lists chooses them again. Every rank decides from the same sums, so all take the same
  collectives. This exchange is also the barrier that keeps the ranks from writing into the folder
  before rank 0 has made it.
- after writing, each rank's failure flag. A failure is then gathered and raised on every rank.
  Where each item lies, and each file's checksum, reach rank 0 in a small file beside each rank's
  (`.report`), as the per-rank format's checksums do; rank 0 removes them.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import torch

from backend.runtime.dcp import METADATA, Boxes
from backend.runtime.dcp_write import write_metadata, write_rank_file
from backend.runtime.dist import gather_objects, sum_over_ranks, world_size
from topologies.common import write_atomic

REPORT = ".report"  # what a rank wrote, for rank 0: beside its file until rank 0 has read it

_NONE = 1 << 32  # a memory no rank can have (a hash is 32 bits)


class _Memory:
    """What this process's rank agreed on with the others at their last full exchange (`_share`)."""

    def __init__(self):
        self.lists = _NONE  # the sum of every rank's hash of its (name, offsets, bytes) list, mod 2**32
        self.owned: dict[str, set] = {}  # this rank's share then: name -> offsets of its boxes (() an object)


_memory = _Memory()


def write(state: dict, folder: Path, rank: int) -> dict[str, tuple[str, int]]:
    """Collectively write `state` into `folder` as a DCP checkpoint (every rank calls it; the files
    are fsynced). Returns, on rank 0, name -> (SHA-256, bytes) of every file of the checkpoint (each
    rank's and `.metadata`); {} on the others. A rank's failure is raised on every rank: its own
    error, another rank's OSError (naming that rank's file) or a line naming the rank."""
    world = world_size()
    share = _share(state, rank, world) if world > 1 else state
    file, error = f"__{rank}_0.distcp", None
    try:
        objects, chunks, tensors = _items(share)
        items, digest = write_rank_file(folder / file, chunks, objects)
        if rank != 0:  # for rank 0, beside the file (the per-rank format's checksums travel so too)
            write_atomic(folder / f"{file}{REPORT}", pickle.dumps((tensors, items, digest)))
    except Exception as e:  # noqa: BLE001 - told to every rank, raised on each
        error = _picklable(e)
    if world > 1 and sum_over_ranks([int(error is not None)])[0]:
        _raise(rank, gather_objects(error))
    if error is not None:
        raise error
    if rank != 0:
        return {}
    files, sums = [(file, tensors, items)], {file: digest}
    for r in range(1, world):
        name = f"__{r}_0.distcp"
        report = folder / f"{name}{REPORT}"
        tensors, items, sums[name] = pickle.loads(report.read_bytes())
        report.unlink()
        files.append((name, tensors, items))
    sums[METADATA] = write_metadata(folder, files)
    return sums


def _raise(rank: int, errors: list) -> None:
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    r = rank if rank in failed else min(failed)
    e = failed[r]
    raise e if r == rank or isinstance(e, OSError) else RuntimeError(f"rank {r} could not write its file: {e}")


def _picklable(e: BaseException | None) -> BaseException | None:
    if e is None:
        return None
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - sent to the other ranks as its line
        return RuntimeError(f"{type(e).__name__}: {e}")


def _hash(obj) -> int:
    """32 bits of BLAKE2b of repr(obj)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=4).digest(), "little")


def _items(share: dict) -> tuple[dict, list, dict]:
    """What this rank writes of `share`: (objects: name -> object, tensor chunks: [(name, offsets,
    sizes, pieces)], tensors: name -> (dtype, full size))."""
    objects, chunks, tensors = {}, [], {}
    for name, obj in share.items():
        if isinstance(obj, Boxes):
            written = obj.written()
            chunks += [(name, obj._offsets(b), obj._sizes(b), obj.views(obj._offsets(b))) for b in written]
            if written:
                tensors[name] = (obj.locals[0].dtype, tuple(obj.shape))
        elif isinstance(obj, torch.Tensor):
            chunks.append((name, (0,) * obj.dim(), tuple(obj.shape), [obj]))
            tensors[name] = (obj.dtype, tuple(obj.shape))
        else:
            objects[name] = obj
    return objects, chunks, tensors


def _share(state: dict, rank: int, world: int) -> dict:
    """The entries of `state` this rank writes (a Boxes' `writes` set to its boxes), as agreed with
    the other ranks (module docstring)."""
    mine = [(name, tuple(obj._offsets(b)), obj.nbytes(b)) for name, obj in state.items()
            if isinstance(obj, Boxes) for b in obj.held()]
    mine += [(name, (), 0) for name, obj in state.items() if not isinstance(obj, Boxes)]
    total, memories = sum_over_ranks([_hash((rank, world, mine)), _memory.lists])
    if memories != world * (total % _NONE):  # a rank remembers other lists (or none): choose again
        _memory.owned, _memory.lists = _assign(gather_objects(mine), rank, world), total % _NONE
    owned = _memory.owned
    share = {}
    for name, obj in state.items():
        if isinstance(obj, Boxes):
            obj.writes = owned.get(name, set())
            share[name] = obj
        elif name in owned:
            share[name] = obj
    return share


def _assign(lists: list, rank: int, world: int) -> dict[str, set]:
    """This rank's share of every rank's (name, offsets, bytes) `lists`: each item several ranks hold
    goes to one of them, the largest first to the one with the fewest bytes so far (ties: the lowest
    rank). Returns name -> the offsets of its items this rank writes."""
    holders: dict[tuple, list[int]] = {}
    size: dict[tuple, int] = {}
    for r, items in enumerate(lists):
        for name, offsets, nbytes in items:
            holders.setdefault((name, offsets), []).append(r)
            size[(name, offsets)] = nbytes
    load = [0] * world
    owned: dict[str, set] = {}
    for key in sorted(holders, key=lambda k: (-size[k], k)):
        r = min(holders[key], key=lambda q: (load[q], q))
        load[r] += size[key]
        if r == rank:
            owned.setdefault(key[0], set()).add(key[1])
    return owned
