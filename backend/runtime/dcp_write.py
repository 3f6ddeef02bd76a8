"""Writing a DCP checkpoint's files without torch.distributed.checkpoint's save machinery.

A DCP checkpoint is one `__<rank>_0.distcp` file per rank (each item a torch.save archive of a
tensor chunk, or of a pickled object, one after the other) and a `.metadata` file (a pickled
`Metadata`: each tensor's chunks, and where each item lies in which file). `write_rank_file` writes
a rank's file, `write_metadata` the metadata of every rank's items: the files `dcp.save` writes,
read by plain `torch.distributed.checkpoint` (tests/test_backend_reshard.py).

DCP stores each tensor chunk as a `torch.save` archive (a zip of seven records). torch.save builds
each archive through a pickler, its C++ zip writer and a Python stream, which costs about 0.2 ms of
CPU an item whatever its size: as much as the bytes themselves for a small model's boxes.
`write_archive` writes the same archive, byte for byte (the tests compare it with torch.save's),
from the pieces of the tensor (a weight and its two moments: no stacked copy): the records
torch.save writes for one tensor, in its order, each 64-byte aligned with the padding field torch
uses, a data descriptor after each, the central directory and the zip64 end records. The fixed
records and the constant half of the serialization id are taken from one real torch.save in this
process, so they follow the installed torch. An archive of 4 GiB or more (zip64 records) is left to
torch.save, and so is an empty tensor (whose record torch writes without a descriptor).
"""

from __future__ import annotations

import collections
import errno
import functools
import hashlib
import io
import math
import os
import pickle
import struct
import uuid
import zlib
from pathlib import Path

import torch

from backend.runtime.dcp_read import _entries

ALIGN = 64  # torch.save aligns every record's data to 64 bytes
_LIMIT = 0xFFFFFFFF
# Every WRITEBACK bytes a rank file asks the kernel to start writing them to disk (posix_fadvise
# DONTNEED starts the writeback of dirty pages and drops the pages already clean), so the disk works
# while the next bytes are hashed and the fsync at the end waits for little; the checkpoint's pages
# do not crowd the page cache either. Where the call does nothing, the fsync writes everything.
WRITEBACK = 4 << 20
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names
_STORAGES = {torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
             torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
             torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
             torch.bool: "BoolStorage"}


class _Storage:
    """Stands for the tensor's storage in the pickle (a persistent id, as torch.save writes it)."""


class _Tensor:
    """Pickles as torch.save pickles a contiguous CPU tensor of `size` (without its data)."""

    def __init__(self, size: tuple[int, ...]):
        self.size = tuple(size)
        stride, step = [], 1
        for n in reversed(self.size):
            stride.append(step)
            step *= n
        self.stride = tuple(reversed(stride))

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2,
                (_STORAGE, 0, self.size, self.stride, False, collections.OrderedDict()))


_STORAGE = _Storage()


class _Pickler(pickle.Pickler):
    def __init__(self, f, storage_id: tuple):
        super().__init__(f, protocol=2)
        self.storage_id = storage_id

    def persistent_id(self, obj):
        return self.storage_id if obj is _STORAGE else None


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64 bits (torch's serialization id folds the records' CRC-32s with it)."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF


class _Template:
    """The archive torch.save writes for one tensor, read from a real one: its folder, its records'
    names in order with the fixed ones' contents, and the first half of its serialization id."""

    def __init__(self):
        buf = io.BytesIO()
        torch.save(torch.zeros(1), buf)
        raw = buf.getvalue()
        records = _entries(raw)
        first = raw[_LOCAL.size:_LOCAL.size + _LOCAL.unpack_from(raw, 0)[9]].decode()
        self.folder = first.split("/", 1)[0]
        self.names = list(records)
        self.fixed = {name: bytes(view) for name, view in records.items()}
        self.id_head = self.fixed[".data/serialization_id"][:20]
        if (len(self.fixed[".data/serialization_id"]) != 40 or "data.pkl" not in records
                or "data/0" not in records):
            raise ValueError("torch.save's archive is not the one this writer knows")


_template: _Template | None = None


def write_archive(out, pieces: list[torch.Tensor], size: tuple[int, ...], crc32: bool = True) -> int:
    """Write to `out` (a binary stream with write()) the torch.save archive of the tensor of `size`
    whose contiguous data are `pieces` one after the other (CPU tensors of one dtype); returns the
    bytes written. crc32=False writes what torch.save writes after
    torch.serialization.set_crc32_options(False): every record's CRC-32 0 (torch.load checks none),
    so that the bytes around the data depend on the dtype and size only, and are built once.
    Raises ValueError where only torch.save will do (an unknown dtype, an empty tensor, 4 GiB)."""
    dtype = pieces[0].dtype
    if dtype not in _STORAGES or any(p.dtype != dtype for p in pieces):
        raise ValueError(f"no archive of {dtype} pieces")
    views = [memoryview(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) for p in pieces]
    nbytes = sum(len(v) for v in views)
    if not nbytes or nbytes >= _LIMIT - (1 << 20):  # the other records are a few hundred bytes
        raise ValueError("an empty archive, or one of 4 GiB or more")
    if crc32:
        crc = 0
        for v in views:
            crc = zlib.crc32(v, crc)
        head, tail = _frame(dtype, tuple(size), nbytes, crc)
    else:
        head, tail = _frame_without_crc(dtype, tuple(size), nbytes)
    out.write(head)
    for v in views:
        out.write(v)
    out.write(tail)
    return len(head) + nbytes + len(tail)


@functools.lru_cache(maxsize=4096)
def _frame_without_crc(dtype: torch.dtype, size: tuple[int, ...], nbytes: int) -> tuple[bytes, bytes]:
    return _frame(dtype, size, nbytes, None)


def _frame(dtype: torch.dtype, size: tuple[int, ...], nbytes: int, data_crc: int | None) -> tuple[bytes, bytes]:
    """The bytes of the archive before and after its data (`nbytes` of CRC-32 `data_crc`; None: no
    record's CRC-32 computed, all 0): each record 64-byte aligned, with a data descriptor after it,
    then the central directory and the zip64 end records."""
    global _template
    if _template is None:
        _template = _Template()
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    pkl = io.BytesIO()
    _Pickler(pkl, ("storage", getattr(torch, _STORAGES[dtype]), "0", "cpu", numel)).dump(_Tensor(size))
    contents = {**_template.fixed, "data.pkl": pkl.getvalue()}
    at, central, combined, head, out = 0, [], 0, b"", bytearray()
    for name in _template.names:
        if name == ".data/serialization_id":
            contents[name] = _template.id_head + f"{combined:020d}".encode()
        full = f"{_template.folder}/{name}".encode()
        pad = -(at + _LOCAL.size + len(full) + 4) % ALIGN
        out += _LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(full), pad + 4)
        out += full + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        if name == "data/0":
            head, out, length, crc = bytes(out), bytearray(), nbytes, data_crc or 0
        else:
            length, crc = len(contents[name]), (0 if data_crc is None else zlib.crc32(contents[name]))
            out += contents[name]
        out += _DESCRIPTOR.pack(0x08074B50, crc, length, length)
        central.append((full, crc, length, at))
        if name != ".data/serialization_id":
            combined = _hash_combine(combined, crc)
        at += _LOCAL.size + len(full) + pad + 4 + length + _DESCRIPTOR.size
    start = at
    for full, crc, length, offset in central:
        out += _CENTRAL.pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, crc, length, length, len(full), 0, 0, 0, 0, 0,
                             offset) + full
        at += _CENTRAL.size + len(full)
    n = len(central)
    out += _END64.pack(0x06064B50, _END64.size - 12, 0x031E, 0x002D, 0, 0, n, n, at - start, start)
    out += _LOCATOR.pack(0x07064B50, 0, at, 1) + _END.pack(0x06054B50, 0, 0, n, n, at - start, start, 0)
    return head, bytes(out)


class HashingFile:
    """A file opened for writing, unbuffered, that hashes (SHA-256) and counts what is written through
    it (a checksum costs no second read) and starts writing it to disk as it goes (WRITEBACK). A
    failed or short write (a full disk) raises an OSError that names the file."""

    def __init__(self, path: Path):
        self.path, self.f = Path(path), open(path, "wb", buffering=0)
        self.sha, self.size, self.started = hashlib.sha256(), 0, 0
        self.error: OSError | None = None  # torch.save hides a failed write behind its own RuntimeError

    def write(self, data) -> int:
        view, n = memoryview(data).cast("B"), 0
        self.sha.update(view)
        try:
            while n < len(view):
                done = self.f.write(view[n:])
                if not done:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                n += done
        except OSError as e:
            self.error = OSError(e.errno, e.strerror, str(self.path))
            raise self.error from None
        self.size += n
        if self.size - self.started >= WRITEBACK and hasattr(os, "posix_fadvise"):
            try:  # start writing the last bytes to disk now, while the next are hashed (see WRITEBACK)
                os.posix_fadvise(self.f.fileno(), self.started, self.size - self.started, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            self.started = self.size
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> tuple[str, int]:
        """fsync and close; returns the file's (SHA-256, bytes)."""
        try:
            os.fsync(self.f.fileno())
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        finally:
            self.f.close()
        return self.sha.hexdigest(), self.size


def write_rank_file(path: Path, chunks: list, objects: dict) -> tuple[list[tuple], tuple[str, int]]:
    """Write one rank's `.distcp` file, fsynced: first the tensor `chunks`, each (name, offsets, sizes,
    pieces): the archive of the tensor of `sizes` whose data are the pieces one after the other (a GPU
    tensor is brought to the host); then the `objects` (name -> object, each a torch.save of it, as
    DCP's bytes items). Returns each item's (name, offsets or None, sizes or None, offset in the
    file, bytes), and the file's (SHA-256, bytes)."""
    out, entries = HashingFile(path), []
    try:
        for name, offsets, sizes, pieces in chunks:
            at = out.size
            pieces = [p.detach().cpu() for p in pieces]
            try:
                write_archive(out, pieces, sizes, crc32=False)
            except ValueError:  # an empty tensor, or 4 GiB: torch.save's own archive
                torch.save(torch.stack(pieces) if len(pieces) > 1 else pieces[0].contiguous().clone(), out)
            entries.append((name, tuple(offsets), tuple(sizes), at, out.size - at))
        for name, obj in objects.items():
            buf = io.BytesIO()
            torch.save(obj, buf)
            at = out.size
            out.write(buf.getbuffer())
            entries.append((name, None, None, at, out.size - at))
    except Exception:
        out.f.close()
        if out.error is not None:
            raise out.error from None
        raise
    return entries, out.close()


def write_metadata(folder: Path, files: list[tuple]) -> tuple[str, int]:
    """Write `folder`/.metadata for the ranks' `files`, each (file name, tensors: name -> (dtype, full
    size), the entries write_rank_file returned): under another name, fsynced, renamed. Raises
    RuntimeError unless the chunks of each tensor fill it. Returns the file's (SHA-256, bytes)."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    items: dict = {}
    storage: dict = {}
    for file, tensors, entries in files:
        for name, offsets, sizes, at, length in entries:
            if offsets is None:
                items[name], index = BytesStorageMetadata(), MetadataIndex(name)
            else:
                if name not in items:
                    dtype, size = tensors[name]
                    items[name] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), [])
                chunks = items[name].chunks
                index = MetadataIndex(name, offsets, len(chunks))
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage[index] = _StorageInfo(file, at, length)
    for name, md in items.items():
        if isinstance(md, TensorStorageMetadata) and sum(math.prod(c.sizes) for c in md.chunks) != math.prod(md.size):
            raise RuntimeError(f"checkpoint: the saved chunks of {name} do not fill it (a bug: please report it)")
    metadata = Metadata(state_dict_metadata=items, planner_data={}, storage_data=storage,
                        storage_meta=StorageMeta(save_id=str(uuid.uuid4())), version=CURRENT_DCP_VERSION)
    tmp, final = Path(folder) / ".metadata.tmp", Path(folder) / ".metadata"
    out = HashingFile(tmp)
    try:
        pickle.dump(metadata, out)
    except Exception:
        out.f.close()
        raise
    digest = out.close()
    os.replace(tmp, final)
    return digest
