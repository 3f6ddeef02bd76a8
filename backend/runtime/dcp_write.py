"""Writing a DCP checkpoint's tensor items without torch.save's cost per archive.

DCP stores each tensor chunk as a `torch.save` archive (a zip of seven records) inside a rank's
`.distcp` file. torch.save builds each archive through a pickler, its C++ zip writer and a Python
stream, which costs about 0.2 ms of CPU an item whatever its size: as much as the bytes themselves
for a small model's boxes. `write_archive` writes the same archive, byte for byte (the tests compare
it with torch.save's), from the pieces of the tensor (a weight and its two moments: no stacked copy):
the records torch.save writes for one tensor, in its order, each 64-byte aligned with the padding
field torch uses, a data descriptor after each, the central directory and the zip64 end records.
The fixed records and the constant half of the serialization id are taken from one real torch.save
in this process, so they follow the installed torch. An archive of 4 GiB or more (zip64 records) is
left to torch.save, and so is an empty tensor (whose record torch writes without a descriptor).
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zlib

import torch

from backend.runtime.dcp_read import _entries

ALIGN = 64  # torch.save aligns every record's data to 64 bytes
_LIMIT = 0xFFFFFFFF
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


def write_archive(out, pieces: list[torch.Tensor], size: tuple[int, ...]) -> int:
    """Write to `out` (a binary stream with write()) the torch.save archive of the tensor of `size`
    whose contiguous data are `pieces` one after the other (CPU tensors of one dtype); returns the
    bytes written. Raises ValueError where only torch.save will do (an unknown dtype, 4 GiB)."""
    global _template
    if _template is None:
        _template = _Template()
    dtype = pieces[0].dtype
    if dtype not in _STORAGES or any(p.dtype != dtype for p in pieces):
        raise ValueError(f"no archive of {dtype} pieces")
    views = [memoryview(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) for p in pieces]
    nbytes = sum(len(v) for v in views)
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    pkl = io.BytesIO()
    _Pickler(pkl, ("storage", getattr(torch, _STORAGES[dtype]), "0", "cpu", numel)).dump(_Tensor(size))
    contents = {**_template.fixed, "data.pkl": pkl.getvalue(), "data/0": views}
    if not nbytes or nbytes >= _LIMIT - (1 << 20):  # the other records are a few hundred bytes
        raise ValueError("an empty archive, or one of 4 GiB or more")
    at, central, combined, small = 0, [], 0, bytearray()  # small records gathered into one write
    for name in _template.names:
        if name == ".data/serialization_id":
            contents[name] = _template.id_head + f"{combined:020d}".encode()
        data = contents[name]
        parts = data if isinstance(data, list) else [data]
        full = f"{_template.folder}/{name}".encode()
        pad = -(at + _LOCAL.size + len(full) + 4) % ALIGN
        small += _LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(full), pad + 4)
        small += full + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        crc, size_ = 0, 0
        for part in parts:
            crc = zlib.crc32(part, crc)
            size_ += len(part)
            if len(part) > 4096:
                out.write(small)
                out.write(part)
                small = bytearray()
            else:
                small += part
        small += _DESCRIPTOR.pack(0x08074B50, crc, size_, size_)
        central.append((full, crc, size_, at))
        if name != ".data/serialization_id":
            combined = _hash_combine(combined, crc)
        at += _LOCAL.size + len(full) + pad + 4 + size_ + _DESCRIPTOR.size
    start = at
    for full, crc, size_, offset in central:
        small += _CENTRAL.pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, crc, size_, size_, len(full), 0, 0, 0, 0, 0,
                               offset) + full
        at += _CENTRAL.size + len(full)
    n = len(central)
    small += _END64.pack(0x06064B50, _END64.size - 12, 0x031E, 0x002D, 0, 0, n, n, at - start, start)
    small += _LOCATOR.pack(0x07064B50, 0, at, 1) + _END.pack(0x06054B50, 0, 0, n, n, at - start, start, 0)
    out.write(small)
    return at + _END64.size + _LOCATOR.size + _END.size
