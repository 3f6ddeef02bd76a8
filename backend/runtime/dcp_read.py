"""Reading a DCP checkpoint's files faster than torch.distributed.checkpoint's FileSystemReader.

DCP stores each tensor chunk as a `torch.save` archive inside a rank's `.distcp` file, and its reader
opens every one with `torch.load(weights_only=True)` through a file-slice wrapper that reads it in
small pieces, copies it into a fresh tensor, which our planner copies again into the model. For
gpt-small on 4 ranks that was about half of a load. `FastReader.read_data` reads each stored item with
one read, takes the tensor's place in the archive from its uncompressed zip entries and its small
pickle (dtype, size, stride, offset: nothing else is unpickled), and hands a view of the bytes to the
planner, which copies it once into its destination.

Anything it does not recognise (a compressed or transformed item, an archive with other objects, a
big-endian file) is read by torch.load as before, so every checkpoint DCP can read still reads.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import warnings
from torch.futures import Future

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType

_DTYPES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
           "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
           "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
           "BoolStorage": torch.bool}
# zip records: a local header (30 bytes), a central directory entry (46), its end (22)
_LOCAL, _CENTRAL, _END = struct.Struct("<IHHHHHIIIHH"), struct.Struct("<IHHHHHHIIIHHHHHII"), struct.Struct("<IHHHHIIH")


class _NotPlain(Exception):
    """The archive holds something other than one plain tensor: let torch.load read it."""


class _TensorPlace(pickle.Unpickler):
    """Unpickles a torch.save archive's data.pkl of one tensor into (storage key, dtype, offset,
    size, stride), refusing every other global."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (*storage, offset, size, stride)
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _NotPlain(pid)
        return pid[2], pid[1]  # key, dtype


def _entries(buf: bytes) -> dict[str, memoryview]:
    """The records of a torch.save archive, by name without the archive's folder, as views of `buf`,
    from the zip's central directory (torch.save stores every record uncompressed). Raises _NotPlain
    for anything else (a comment, zip64, compression)."""
    end = len(buf) - _END.size
    sig, _, _, _, count, _, directory, _ = _END.unpack_from(buf, end)
    if sig != 0x06054B50 or directory == 0xFFFFFFFF:
        raise _NotPlain("no plain end of central directory")
    records, at, view = {}, directory, memoryview(buf)
    for _ in range(count):
        fields = _CENTRAL.unpack_from(buf, at)
        sig, method, size, n_name, n_extra, n_comment, local = (fields[i] for i in (0, 4, 9, 10, 11, 12, 16))
        if sig != 0x02014B50 or method != 0 or 0xFFFFFFFF in (size, local):
            raise _NotPlain("a compressed or zip64 record")
        name = bytes(view[at + _CENTRAL.size:at + _CENTRAL.size + n_name]).decode()
        head = _LOCAL.unpack_from(buf, local)
        start = local + _LOCAL.size + head[9] + head[10]
        records[name.split("/", 1)[-1]] = view[start:start + size]
        at += _CENTRAL.size + n_name + n_extra + n_comment
    return records


def tensor_from_archive(buf: bytes) -> torch.Tensor:
    """The tensor of a torch.save archive of one CPU tensor, viewing `buf` (no copy). Raises
    _NotPlain (or an error of struct, pickle or torch) for anything else."""
    records = _entries(buf)
    if bytes(records.get("byteorder", b"little")).decode() != sys.byteorder:
        raise _NotPlain("byte order")
    place = _TensorPlace(io.BytesIO(records["data.pkl"])).load()
    if not (isinstance(place, tuple) and len(place) == 5 and isinstance(place[1], torch.dtype)):
        raise _NotPlain("not one tensor")
    key, dtype, offset, size, stride = place
    if [name for name in records if name.startswith("data/")] != [f"data/{key}"]:
        raise _NotPlain("several storages")
    data = records[f"data/{key}"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) % itemsize:
        raise _NotPlain("storage size")
    if not len(data):  # frombuffer refuses an empty buffer
        return torch.empty_strided(tuple(size), tuple(stride), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the buffer is read-only: the tensor is only copied from
        storage = torch.frombuffer(data, dtype=dtype)
    return storage.as_strided(tuple(size), tuple(stride), offset)


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o or n != tensor.size(dim):
            tensor = tensor.narrow(dim, o, n)
    return tensor


def _read_tensor(buf: bytes) -> torch.Tensor:
    try:
        return tensor_from_archive(buf)
    except (_NotPlain, KeyError, ValueError, RuntimeError, pickle.UnpicklingError, struct.error):
        return torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)


class FastReader(FileSystemReader):
    """A FileSystemReader whose read_data reads each stored item with one read and its tensors
    without torch.load (module docstring). A planner with `commit_view(read_item, tensor)` takes the
    view directly; any other gets a tensor from resolve_tensor, as DCP gives it."""

    def read_data(self, plan, planner) -> Future:
        if any(self.storage_data[r.storage_index].transform_descriptors for r in plan.items):
            return super().read_data(plan, planner)
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                items: dict = {}  # one read and one parse of a stored item that several requests share
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    if (info.offset, info.length) not in items:
                        stream.seek(info.offset)
                        buf = stream.read(info.length)
                        if len(buf) != info.length:
                            raise OSError(f"{relative_path}: {info.length} bytes expected at {info.offset}, "
                                          f"{len(buf)} found (a truncated file)")
                        items[(info.offset, info.length)] = (buf if req.type == LoadItemType.BYTE_IO
                                                             else _read_tensor(buf))
                    data = items[(info.offset, info.length)]
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(data))
                        continue
                    self._commit(planner, req, _narrow(data, req.storage_offsets, req.lengths))
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _commit(planner, req, tensor: torch.Tensor) -> None:
        if hasattr(planner, "commit_view"):
            planner.commit_view(req, tensor)
            return
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)
