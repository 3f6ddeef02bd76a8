"""Checkpoints in torch.distributed.checkpoint (DCP): each rank writes the boxes of the full tensors
its shards hold, with their place in the full tensor, so that any grid reads them back.

A state dict given to `write` or `read` maps names to
- `Boxes`: a local tensor and the boxes of one full tensor it holds (backend.models.placement: an
  offset and size in the full tensor, and a strided view of the local tensor); written as DCP
  chunks of that full tensor (a ShardedTensor's metadata, without ShardedTensor), read by DCP's
  planner, which reshards: each box reads the parts of the saved chunks it overlaps;
- anything else: a pickled object (DCP's bytes items), written once when every rank gives the same
  name.

Replicas (data-parallel copies, norms replicated over y and z) give the same boxes; one writer is
kept for each, spreading the bytes over the replicas (`write`). A `Boxes` with `write=False` (a
pipeline stage's untrained copy) gives none. The files are DCP's own (`.metadata`, one
`__<rank>_0.distcp` per rank, each tensor item a torch.save archive), so plain
`torch.distributed.checkpoint` loads them (docs/checkpoints.md); DCP plans and commits every save and
load, but its central planning (collectives that change nothing here) and its per-item torch.save
and torch.load are replaced by what costs less (`write`, `read`, backend.runtime.dcp_write and
dcp_read). Publication, checksums and the choice of step are backend.runtime.checkpoint's.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import math
import os
import pickle
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from backend.runtime.dcp_read import FastReader
from backend.runtime.dcp_write import write_archive

METADATA = ".metadata"


class Boxes:
    """Boxes of one full tensor (`shape`) held by each of `locals` (same shape; each box views them
    flat). Several locals (a weight and its AdamW moments) are one DCP tensor of shape
    (len(locals), *shape): one chunk per box holds them all, so that a checkpoint has a third of the
    items to plan, write and read (each costs DCP a torch.save or a torch.load)."""

    def __init__(self, locals_: list[torch.Tensor], shape: tuple[int, ...], boxes, write: bool = True):
        self.locals, self.boxes, self.write = list(locals_), list(boxes), write
        self.writes: set | None = None  # the offsets of the boxes this rank writes (None: every box)
        self.lead = (len(self.locals),) if len(self.locals) > 1 else ()
        self.shape = torch.Size(self.lead + tuple(shape))
        self._by_offset = {self._offsets(b): b for b in self.boxes}

    def _offsets(self, box) -> tuple[int, ...]:
        return (0,) * len(self.lead) + tuple(box.offsets)

    def _sizes(self, box) -> tuple[int, ...]:
        return self.lead + tuple(box.sizes)

    def size(self) -> torch.Size:
        return self.shape

    def views(self, offsets) -> list[torch.Tensor]:
        """Each local's elements of the box at `offsets` (views: writing into them fills the locals)."""
        box = self._by_offset[tuple(offsets)]
        return [box.view(t.reshape(-1)) for t in self.locals]

    def data(self, offsets) -> torch.Tensor:
        """The box's elements of every local, as one contiguous CPU tensor (what is written)."""
        views = [v.detach().cpu() for v in self.views(offsets)]
        return torch.stack(views) if self.lead else views[0].contiguous()

    def commit(self, offsets, dest_offsets, lengths, tensor: torch.Tensor) -> None:
        """Copy a read part (`tensor`, at dest_offsets within the box at `offsets`) into the locals."""
        views = self.views(offsets)
        if not self.lead:
            views, tensor, dest_offsets, lengths = [views[0][None]], tensor[None], (0, *dest_offsets), (1, *lengths)
        for j in range(lengths[0]):
            dest = views[dest_offsets[0] + j]
            for dim, (o, n) in enumerate(zip(dest_offsets[1:], lengths[1:])):
                dest = dest.narrow(dim, o, n)
            dest.copy_(tensor[j])

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.locals[0].dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(self._offsets(b))), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(self._offsets(b)),
                                                                                 torch.Size(self._sizes(b))),
                                                      properties=props, size=self.shape))
                for b in self.written()]

    def written(self) -> list:
        """The boxes this rank writes."""
        if not self.write:
            return []
        return [b for b in self.boxes if self.writes is None or self._offsets(b) in self.writes]

    def nbytes(self, box) -> int:
        return len(self.locals) * math.prod(box.sizes) * self.locals[0].element_size()

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(self._offsets(b)), torch.Size(self._sizes(b))) for b in self.boxes]


class _SavePlanner(DefaultSavePlanner):
    """Plans are not cached (enable_plan_caching): with it, a fine-tune that saved and evaluated on
    2x2x2x1 stopped in gloo's scatter of the central plan ("Incorrect input list size 1")."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, enable_plan_caching=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.data(index.offset) if isinstance(obj, Boxes) else obj


class _LoadPlanner(DefaultLoadPlanner):
    """Reads into a fresh tensor for each part of a box and copies it into the locals on commit."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's walks the dict and replaces objects it does not know (Boxes) by None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def resolve_tensor(self, read_item):
        obj = self.state_dict[read_item.dest_index.fqn]
        if isinstance(obj, Boxes):
            return torch.empty(tuple(read_item.lengths), dtype=obj.locals[0].dtype)
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        obj = self.state_dict[read_item.dest_index.fqn]
        if isinstance(obj, Boxes):
            obj.commit(read_item.dest_index.offset, read_item.dest_offsets, read_item.lengths, tensor)

    def commit_view(self, read_item, tensor: torch.Tensor) -> None:
        """Commit a read part given as a view of the file's bytes (backend.runtime.dcp_read): a box's
        part is copied once, straight into the locals."""
        obj = self.state_dict[read_item.dest_index.fqn]
        if isinstance(obj, Boxes):
            obj.commit(read_item.dest_index.offset, read_item.dest_offsets, read_item.lengths, tensor)
            return
        target = self.resolve_tensor(read_item).detach()
        target.copy_(tensor)
        self.commit_tensor(read_item, target)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


class _HashingStream(io.RawIOBase):
    """A file opened for writing that hashes (SHA-256) and counts the bytes written through it, so a
    rank's checksum costs no second read of its file."""

    def __init__(self, f, sums: dict, name: str):
        super().__init__()
        self.f, self.sums, self.name, self.sha, self.size = f, sums, name, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.sha.update(b)
        view, n = memoryview(b).cast("B"), 0
        try:
            while n < len(view):  # a short write (a disk that fills up) is retried, and then fails
                done = self.f.write(view[n:])
                if not done:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                n += done
        except OSError as e:  # torch.save hides it behind its own RuntimeError: keep it
            self.sums.setdefault("errors", []).append(e)
            raise
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.f.fileno()

    def flush(self) -> None:
        if not self.f.closed:
            self.f.flush()

    def close(self) -> None:
        if not self.closed:
            self.sums[self.name] = (self.sha.hexdigest(), self.size)
            self.f.close()
        super().close()


class _HashingFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.sums: dict[str, tuple[str, int]] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = _HashingStream(open(path, "wb"), self.sums, Path(path).name)
        try:
            yield stream
        finally:
            stream.close()


class _Writer(FileSystemWriter):
    """Writes this rank's file `__<rank>_0.distcp` in a save DCP runs in this process alone; keeps the
    metadata of what it wrote for rank 0 to merge (`write`)."""

    def __init__(self, folder: Path, rank: int):
        super().__init__(folder, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.fs = _HashingFileSystem()
        self.own_rank = rank
        self.saved: tuple | None = None  # (Metadata, [WriteResult]) of this rank's items

    def prepare_global_plan(self, plans):
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{self.own_rank}_")) for p in plans]

    def write_data(self, plan, planner) -> Future:
        """This rank's items into one file, objects first, then the tensors, each a torch.save
        archive written by backend.runtime.dcp_write straight from a box's pieces (torch.save where
        it must); fsynced. The same file DCP's writer makes, at a fraction of its cost per item."""
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        items = sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in items:
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(planner.resolve_data(item).getbuffer())
                else:
                    obj = planner.state_dict[item.index.fqn]
                    pieces = [v.detach().cpu() for v in (obj.views(item.index.offset) if isinstance(obj, Boxes)
                                                         else [planner.resolve_data(item)])]  # NCCL: to the host
                    try:
                        write_archive(stream, pieces, tuple(item.tensor_data.chunk.sizes))
                    except ValueError:  # an empty tensor, or 4 GiB: torch.save's own archive
                        data = torch.stack(pieces) if len(pieces) > 1 else pieces[0].contiguous().clone()
                        torch.save(data, stream)
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
            stream.flush()
            os.fsync(stream.fileno())
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results) -> None:
        self.saved = (metadata, results[0])

    def write_metadata(self, metadata, results) -> None:
        """Rank 0: the checkpoint's `.metadata` (written under another name, fsynced, renamed)."""
        super().finish(metadata, results)


def write(state: dict, folder: Path, rank: int) -> dict[str, tuple[str, int]]:
    """Collectively write `state` into `folder` (every rank calls it; fsynced). Returns this rank's
    files: name -> (SHA-256, bytes) (rank 0's include the metadata file).

    DCP's own save plans centrally (a gather and a scatter of every rank's items) and then gathers
    what each wrote. Here one all-gather of the ranks' items decides who writes each box (one
    replica of each, spreading the bytes), each rank saves its share with DCP in this process, and
    one all-gather brings every rank's metadata (or failure) to all: rank 0 merges and writes
    `.metadata`, and a failure is raised on every rank, naming the rank that failed.
    """
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    _quiet_dcp_logger()
    world = _world()
    share = _share(state, rank, world) if world > 1 else state
    writer, error = _Writer(folder, rank), None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that a process without a process group saves alone
        try:
            dcp.save(share, storage_writer=writer, planner=_SavePlanner(), no_dist=True)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error = _picklable(writer.fs.sums.get("errors", [None])[0] or _cause(e))
    parts = _all_gather((error, writer.saved)) if world > 1 else [(error, writer.saved)]
    failures = {r: e for r, (e, _) in enumerate(parts) if e is not None}
    if failures:
        if rank in failures:
            raise failures[rank]
        raise CheckpointException("save", failures)
    if rank == 0:
        writer.write_metadata(*_merge([saved for _, saved in parts]))
    sums = {name: v for name, v in writer.fs.sums.items() if name.endswith(".distcp")}  # hashed as written
    if rank == 0:
        sums[METADATA] = hash_file(folder / METADATA)
    return sums


def _quiet_dcp_logger() -> None:
    """DCP logs every call of its steps at DEBUG to a logger with only a NullHandler: each record is
    built and dropped (a few ms a save). Unless someone attached a handler, skip building them."""
    import logging

    log = logging.getLogger("c10d-NullHandler-dcp_logger")
    if log.level == logging.DEBUG and all(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.setLevel(logging.INFO)


def _world() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_gather(obj) -> list:
    import torch.distributed as dist
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _share(state: dict, rank: int, world: int) -> dict:
    """The entries of `state` this rank writes: each box held by several ranks (replicas) goes to one
    of them, the largest first to the one with the fewest bytes so far (ties: the lowest rank); an
    object of a name several ranks give, to one of them. Every rank computes the same assignment
    from one all-gather of the ranks' (name, offsets, bytes)."""
    mine = [(name, tuple(obj._offsets(b)), obj.nbytes(b)) for name, obj in state.items()
            if isinstance(obj, Boxes) for b in obj.written()]
    mine += [(name, (), 0) for name, obj in state.items() if not isinstance(obj, Boxes)]
    holders: dict[tuple, list[int]] = {}
    size: dict[tuple, int] = {}
    for r, items in enumerate(_all_gather(mine)):
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
    share = {}
    for name, obj in state.items():
        if isinstance(obj, Boxes):
            obj.writes = owned.get(name, set())
            share[name] = obj
        elif name in owned:
            share[name] = obj
    return share


def _cause(e: BaseException) -> BaseException:
    """The exception behind DCP's CheckpointException of a save in this process."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return e


def _picklable(e: BaseException | None) -> BaseException | None:
    if e is None:
        return None
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - sent to the other ranks as its line
        return RuntimeError(f"{type(e).__name__}: {e}")


def _merge(parts: list[tuple]) -> tuple:
    """One Metadata of every rank's (Metadata, [WriteResult]), and the results by rank. Checks that
    the chunks of each tensor fill it (each box written once)."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    tensors: dict = {}
    planner_data: dict = {}
    for md, _ in parts:
        planner_data.update(md.planner_data or {})
        for fqn, v in md.state_dict_metadata.items():
            if isinstance(v, TensorStorageMetadata):
                if fqn in tensors:
                    tensors[fqn].chunks.extend(v.chunks)
                else:
                    tensors[fqn] = TensorStorageMetadata(v.properties, v.size, list(v.chunks))
            else:
                tensors[fqn] = v
    for fqn, v in tensors.items():
        if isinstance(v, TensorStorageMetadata) and sum(math.prod(c.sizes) for c in v.chunks) != math.prod(v.size):
            raise RuntimeError(f"checkpoint: the saved chunks of {fqn} do not fill it (a bug: please report it)")
    return Metadata(state_dict_metadata=tensors, planner_data=planner_data), [results for _, results in parts]


def hash_file(file: Path) -> tuple[str, int]:
    """(SHA-256, bytes) of a file."""
    sha, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
            size += len(block)
    return sha.hexdigest(), size


class _Reader(FastReader):
    """A reader that reads the metadata file once (`keys`, then the load, ask for it) and the tensors
    without torch.load (backend.runtime.dcp_read)."""

    def read_metadata(self, *args, **kwargs):
        if not hasattr(self, "_metadata"):
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


_readers: dict[str, _Reader] = {}  # the reader of the checkpoint being loaded (one at a time)


def _reader(folder: Path) -> _Reader:
    key = str(Path(folder).resolve())
    if key not in _readers:
        _readers.clear()
        _readers[key] = _Reader(folder)
    return _readers[key]


def keys(folder: Path) -> set[str]:
    """The names a DCP checkpoint holds."""
    return set(_reader(folder).read_metadata().state_dict_metadata)


def read(state: dict, folder: Path) -> dict:
    """Read a DCP checkpoint into `state`: Boxes are filled in place, other entries replaced by the
    saved objects. Each process reads what its own entries need, alone (DCP's load would gather and
    scatter every rank's read plan first, which changes nothing here); when torch.distributed is
    initialized the ranks then agree, so that a failure on one is raised on every rank."""
    import warnings

    import torch.distributed.checkpoint as dcp

    _quiet_dcp_logger()
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that a process without a process group loads alone
            dcp.load(state, storage_reader=_reader(folder), planner=_LoadPlanner(), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = _cause(e)
    finally:
        _readers.clear()
    if _world() > 1 and _any_failed(error is not None):
        if error is None:
            line = next(e for e in _all_gather(None) if e is not None)
            raise RuntimeError(f"another rank could not read it: {line}")
        _all_gather(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    if error is not None:
        raise error
    return state


def _any_failed(failed: bool) -> bool:
    """Whether any rank failed (an all-reduce, on the GPU under NCCL)."""
    import torch.distributed as dist

    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def read_objects(folder: Path, names) -> dict:
    """The pickled (non-tensor) entries `names` of a DCP checkpoint, read in this process."""
    return read({n: None for n in names}, folder)


WEIGHT = 0  # a stacked tensor of the checkpoint: [weight, exp_avg, exp_avg_sq] (backend.training.state)


def read_weights(folder: Path, names) -> dict:
    """The weights `names` of a checkpoint of backend.training.state, full, in this process."""
    return {k: t[WEIGHT] for k, t in read_full(folder, names).items()}


def read_full(folder: Path, names=None) -> dict:
    """The full (unsharded) tensors of a DCP checkpoint, in this process: name -> tensor, for every
    tensor (or those of `names`)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _reader(folder).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
             if isinstance(v, TensorStorageMetadata) and (names is None or k in names)}
    read(state, folder)
    return state

