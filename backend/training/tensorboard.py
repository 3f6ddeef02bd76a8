"""TensorBoard event files for training runs, written without TensorFlow or the tensorboard package.

    with EventWriter("runs/tiny/tb") as tb:          # events.out.tfevents.<time>.<host>.<pid>
        tb.scalars(step, {"loss": 2.31, "lr": 1e-3})
    read_scalars("runs/tiny/tb")                      # [(step, tag, value), ...]

The file is a TFRecord stream: each record is its length (uint64, little endian), the masked CRC-32C
of those 8 bytes (uint32), the data, and the masked CRC-32C of the data; masked(c) = ((c >> 15) |
(c << 17)) + 0xa282ead8 (mod 2**32). Each record holds one `Event` protocol buffer, encoded here by
hand: wall_time (field 1, double), step (field 2, varint), and either file_version (field 3,
"brain.Event:2", the first record) or a summary (field 5) whose values (field 1) each carry a tag
(field 1, string) and a simple_value (field 2, float). That is what TensorBoard's scalar dashboard
reads. `read_scalars` reads the same format back, checking every CRC, so that tests need nothing
from TensorFlow.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes) -> int:
    """The CRC-32C of `data` (crc32c(b"123456789") == 0xE3069283)."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC."""
    n = struct.pack("<Q", len(data))
    return n + struct.pack("<I", masked_crc(n)) + data + struct.pack("<I", masked_crc(data))


def _varint(v: int) -> bytes:
    out = bytearray()
    v &= (1 << 64) - 1
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, *, file_version: str | None = None,
          scalars: dict[str, float] | None = None) -> bytes:
    """An Event message: the file version, or a Summary of simple_value scalars."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", float(v)))
                          for tag, v in scalars.items())
        out += _field(5, values)
    return out


def memory_bytes() -> float:
    """Memory of this rank so far: the peak of CUDA allocations where torch has them, else the peak
    resident size of the process (bytes)."""
    import resource
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return float(torch.cuda.max_memory_allocated())
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux


class EventWriter:
    """Appends scalar events to a new event file in `folder` (created); each call is flushed."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = self.folder / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self._f = open(self.path, "ab")
        self._write(event(now, 0, file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        self._f.write(record(data))
        self._f.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event at `step` holding every (tag, value) of `values` (non-numbers left out)."""
        kept = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if kept:
            self._write(event(time.time(), step, scalars=kept))

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "EventWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = v = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, i


def _fields(buf: bytes):
    """(field number, wire type, value) of a protocol buffer message."""
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _read_varint(buf, i)
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield number, wire, v


def read_records(path: str | Path) -> list[bytes]:
    """The records of one TFRecord file; ValueError on a bad CRC or a cut record."""
    data, out, i = Path(path).read_bytes(), [], 0
    while i < len(data):
        if i + 12 > len(data):
            raise ValueError(f"{path}: record header cut at byte {i}")
        head = data[i:i + 8]
        (n,), (crc,) = struct.unpack("<Q", head), struct.unpack("<I", data[i + 8:i + 12])
        if crc != masked_crc(head):
            raise ValueError(f"{path}: bad length CRC at byte {i}")
        body = data[i + 12:i + 12 + n]
        if len(body) < n or struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] != masked_crc(body):
            raise ValueError(f"{path}: bad data CRC at byte {i}")
        out.append(body)
        i += 16 + n
    return out


def read_scalars(folder: str | Path) -> list[tuple[int, str, float]]:
    """Every scalar of every event file in `folder`: (step, tag, value), in file and record order."""
    out = []
    for path in sorted(Path(folder).glob("events.out.tfevents.*")):
        for rec in read_records(path):
            step = 0
            summary = None
            for number, _, v in _fields(rec):
                if number == 2:
                    step = v
                elif number == 5:
                    summary = v
            for number, _, value in _fields(summary or b""):
                if number != 1:
                    continue
                tag, x = None, None
                for n2, _, v2 in _fields(value):
                    if n2 == 1:
                        tag = v2.decode()
                    elif n2 == 2:
                        x = struct.unpack("<f", v2)[0]
                if tag is not None and x is not None:
                    out.append((step, tag, x))
    return out
