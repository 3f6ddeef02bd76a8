"""Checkpoints in torch.distributed.checkpoint (DCP): each rank writes the boxes of the full tensors
its shards hold, with their place in the full tensor, so that any grid reads them back.

A state dict given to backend.runtime.dcp_save.write or to `read` maps names to
- `Boxes`: a local tensor and the boxes of one full tensor it holds (backend.models.placement: an
  offset and size in the full tensor, and a strided view of the local tensor); written as DCP
  chunks of that full tensor (a ShardedTensor's metadata, without ShardedTensor), read by DCP's
  planner, which reshards: each box reads the parts of the saved chunks it overlaps;
- a plain tensor: one chunk, the whole tensor;
- anything else: a pickled object (DCP's bytes items).
A plain tensor or object that several ranks give under one name is written once.

Replicas (data-parallel copies, norms replicated over y and z) give the same boxes; one writer is
kept for each, spreading the bytes over the replicas. A `Boxes` with `write=False` (a pipeline
stage's untrained copy) gives none. The files are DCP's own (`.metadata`, one
`__<rank>_0.distcp` per rank, each tensor item a torch.save archive), so plain
`torch.distributed.checkpoint` loads them (docs/checkpoints.md). The save writes them itself
(backend.runtime.dcp_save, dcp_write); the load is DCP's, in each process alone, with a reader that
reads tensors without torch.load (`read`, backend.runtime.dcp_read): DCP's central planning, its
collectives and its per-item torch.save and torch.load cost more than the bytes on a small model.
Publication, checksums and the choice of step are backend.runtime.checkpoint's.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from backend.runtime.dcp_read import FastReader
from backend.runtime.dist import gather_objects, sum_over_ranks, world_size

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

    def held(self) -> list:
        """The boxes this rank may write (all of them, unless `write` is False)."""
        return self.boxes if self.write else []

    def written(self) -> list:
        """The boxes this rank writes (of those it may, the ones given to it: `writes`)."""
        return [b for b in self.held() if self.writes is None or self._offsets(b) in self.writes]

    def nbytes(self, box) -> int:
        return len(self.locals) * math.prod(box.sizes) * self.locals[0].element_size()

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(self._offsets(b)), torch.Size(self._sizes(b))) for b in self.boxes]


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


def _quiet_dcp_logger() -> None:
    """DCP logs every call of its steps at DEBUG to a logger with only a NullHandler: each record is
    built and dropped (a few ms a save). Unless someone attached a handler, skip building them."""
    import logging

    log = logging.getLogger("c10d-NullHandler-dcp_logger")
    if log.level == logging.DEBUG and all(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.setLevel(logging.INFO)


def _cause(e: BaseException) -> BaseException:
    """The exception behind DCP's CheckpointException of a load in this process."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return e


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
    if world_size() > 1 and _any_failed(error is not None):
        if error is None:
            line = next(e for e in gather_objects(None) if e is not None)
            raise RuntimeError(f"another rank could not read it: {line}")
        gather_objects(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    if error is not None:
        raise error
    return state


def _any_failed(failed: bool) -> bool:
    """Whether any rank failed (an all-reduce)."""
    return sum_over_ranks([int(failed)])[0] > 0


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

