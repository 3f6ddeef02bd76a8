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

import hashlib
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

METADATA = ".metadata"


class Boxes:
    """Boxes of one full tensor (`shape`) held by `local` (any shape: each box views it flat)."""

    def __init__(self, local: torch.Tensor, shape: tuple[int, ...], boxes, write: bool = True):
        self.local, self.shape, self.boxes, self.write = local, torch.Size(shape), list(boxes), write
        self._by_offset = {tuple(b.offsets): b for b in self.boxes}

    def size(self) -> torch.Size:
        return self.shape

    def view(self, offsets) -> torch.Tensor:
        """The local elements of the box at `offsets` (a view: reading into it fills `local`)."""
        return self._by_offset[tuple(offsets)].view(self.local.reshape(-1))

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        if not self.write:
            return []
        props = TensorProperties(dtype=self.local.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)),
                                                      properties=props, size=self.shape))
                for b in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in self.boxes]


def _lookup(state: dict, index: MetadataIndex, saving: bool):
    obj = state[index.fqn]
    if isinstance(obj, Boxes):
        v = obj.view(index.offset)
        return v.detach().cpu().contiguous() if saving else v
    return obj


class _SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        return _lookup(self.state_dict, index, saving=True)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's walks the dict and replaces objects it does not know (Boxes) by None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index, saving=False)


def write(state: dict, folder: Path, rank: int) -> dict[str, tuple[str, int]]:
    """Collectively write `state` into `folder` (every rank calls it; fsynced). Returns this rank's
    files: name -> (SHA-256, bytes) (rank 0's include the metadata file)."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    alone = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that a process without a process group saves alone
        dcp.save(state, storage_writer=FileSystemWriter(folder, single_file_per_rank=True, sync_files=True,
                                                        thread_count=1),
                 planner=_SavePlanner(), no_dist=alone)
    mine = sorted(folder.glob(f"__{rank}_*.distcp")) + ([folder / METADATA] if rank == 0 else [])
    return {f.name: hash_file(f) for f in mine}


def hash_file(file: Path) -> tuple[str, int]:
    """(SHA-256, bytes) of a file."""
    sha, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
            size += len(block)
    return sha.hexdigest(), size


def keys(folder: Path) -> set[str]:
    """The names a DCP checkpoint holds."""
    return set(FileSystemReader(folder).read_metadata().state_dict_metadata)


def read(state: dict, folder: Path) -> dict:
    """Read a DCP checkpoint into `state` (collective when torch.distributed is initialized, else
    in this process): Boxes are filled in place, other entries replaced by the saved objects."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    alone = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that a process without a process group loads alone
        dcp.load(state, storage_reader=FileSystemReader(folder), planner=_LoadPlanner(), no_dist=alone)
    return state


def read_objects(folder: Path, names) -> dict:
    """The pickled (non-tensor) entries `names` of a DCP checkpoint, read in this process."""
    return read({n: None for n in names}, folder)


def read_full(folder: Path, names=None) -> dict:
    """The full (unsharded) tensors of a DCP checkpoint, in this process: name -> tensor, for every
    tensor (or those of `names`)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(folder).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()
             if isinstance(v, TensorStorageMetadata) and (names is None or k in names)}
    read(state, folder)
    return state

