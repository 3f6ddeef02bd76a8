"""Checkpoints in torch.distributed.checkpoint (DCP): each rank writes the boxes of the full tensors
its shards hold, with their place in the full tensor, so that any grid reads them back.

A state dict given to `write` or `read` maps names to
- `Boxes`: a local tensor and the boxes of one full tensor it holds (backend.models.placement: an
  offset and size in the full tensor, and a strided view of the local tensor); written as DCP
  chunks of that full tensor (a ShardedTensor's metadata, without ShardedTensor), read by DCP's
  planner, which reshards: each box reads the parts of the saved chunks it overlaps;
- anything else: a pickled object (DCP's bytes items), written once when every rank gives the same
  name.

Replicas (data-parallel copies, norms replicated over y and z) give the same boxes; DCP's planner
keeps one writer for each, spreading the bytes over the replicas. A `Boxes` with `write=False` (a
pipeline stage's untrained copy) gives none. The files are DCP's own (`.metadata`, one
`__<rank>_0.distcp` per rank), so plain `torch.distributed.checkpoint` loads them
(docs/checkpoints.md). Publication, checksums and the choice of step are backend.runtime.checkpoint's.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from backend.runtime.dcp_read import FastReader

METADATA = ".metadata"


class Boxes:
    """Boxes of one full tensor (`shape`) held by each of `locals` (same shape; each box views them
    flat). Several locals (a weight and its AdamW moments) are one DCP tensor of shape
    (len(locals), *shape): one chunk per box holds them all, so that a checkpoint has a third of the
    items to plan, write and read (each costs DCP a torch.save or a torch.load)."""

    def __init__(self, locals_: list[torch.Tensor], shape: tuple[int, ...], boxes, write: bool = True):
        self.locals, self.boxes, self.write = list(locals_), list(boxes), write
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
        if not self.write:
            return []
        props = TensorProperties(dtype=self.locals[0].dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(self._offsets(b))), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(self._offsets(b)),
                                                                                 torch.Size(self._sizes(b))),
                                                      properties=props, size=self.shape))
                for b in self.boxes]

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
    def __init__(self, folder: Path):
        super().__init__(folder, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.fs = _HashingFileSystem()


def write(state: dict, folder: Path, rank: int) -> dict[str, tuple[str, int]]:
    """Collectively write `state` into `folder` (every rank calls it; fsynced). Returns this rank's
    files: name -> (SHA-256, bytes) (rank 0's include the metadata file)."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    alone = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that a process without a process group saves alone
        writer = _Writer(folder)
        try:
            dcp.save(state, storage_writer=writer, planner=_SavePlanner(), no_dist=alone)
        except BaseException:  # DCP's CheckpointException is a BaseException
            if writer.fs.sums.get("errors"):  # this rank's write failed (a full disk): say that
                raise writer.fs.sums["errors"][0] from None
            raise
    sums = {name: v for name, v in writer.fs.sums.items() if name.endswith(".distcp")}  # hashed as written
    if rank == 0:
        sums[METADATA] = hash_file(folder / METADATA)  # written under another name, then renamed
    return sums


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
    """Read a DCP checkpoint into `state` (collective when torch.distributed is initialized, else
    in this process): Boxes are filled in place, other entries replaced by the saved objects."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    alone = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that a process without a process group loads alone
        dcp.load(state, storage_reader=_reader(folder), planner=_LoadPlanner(), no_dist=alone)
    _readers.clear()
    return state


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

