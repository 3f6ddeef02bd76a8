"""TensorBoard logs of training runs: backend.training.tensorboard writes TFRecord event files (masked
CRC-32C, hand-encoded Event/Summary protocol buffers) that its reader, written from the format and
not from the writer, reads back; `backend run --tensorboard DIR` logs loss, learning rate, tokens/s,
flop/s and memory per step, the same values as log.jsonl."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from backend.training.tensorboard import EventWriter, crc32c, masked_crc, read_records, read_scalars


def test_crc32c_check_values():
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C (Castagnoli)
    assert crc32c(b"") == 0
    assert masked_crc(b"") == 0xA282EAD8


def test_written_scalars_read_back(tmp_path):
    with EventWriter(tmp_path) as tb:
        tb.scalars(1, {"loss": 2.5, "lr": 1e-3, "skipped": None, "flag": True})
        tb.scalars(2, {"loss": 2.25})
    files = list(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 1
    records = read_records(files[0])
    assert b"brain.Event:2" in records[0]  # the file version event comes first
    assert read_scalars(tmp_path) == [(1, "loss", 2.5), (1, "lr", pytest.approx(1e-3)), (2, "loss", 2.25)]


def test_a_corrupt_record_is_refused(tmp_path):
    with EventWriter(tmp_path) as tb:
        tb.scalars(1, {"loss": 1.0})
    path = next(tmp_path.glob("events.out.tfevents.*"))
    data = bytearray(path.read_bytes())
    data[-6] ^= 0xFF  # inside the last record's float
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="CRC"):
        read_records(path)


def test_record_framing_by_hand(tmp_path):
    """The first record, decoded from the bytes as the format says (not with the module's reader)."""
    with EventWriter(tmp_path):
        pass
    data = next(tmp_path.glob("events.out.tfevents.*")).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert struct.unpack("<I", data[8:12])[0] == masked_crc(data[:8])
    body = data[12:12 + n]
    assert struct.unpack("<I", data[12 + n:16 + n])[0] == masked_crc(body)
    assert body[0] == 0x09 and body[9] == 0x10  # wall_time (double), then step (varint)
    assert len(data) == 16 + n


def test_backend_run_writes_tensorboard_beside_its_log(tmp_path):
    pytest.importorskip("torch")
    out, tb = tmp_path / "run", tmp_path / "tb"
    r = subprocess.run([sys.executable, "-m", "backend.cli", "run", "--model", "gpt-tiny", "--grid", "1x1x1x1",
                        "--steps", "3", "--out", str(out), "--tensorboard", str(tb)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    got: dict[str, dict[int, float]] = {}
    for step, tag, value in read_scalars(tb):
        got.setdefault(tag, {})[step] = value
    assert {"loss", "lr", "tokens_per_s", "flops_per_s", "memory_bytes"} <= set(got)
    for rec in log:
        for tag in ("loss", "lr", "tokens_per_s", "flops_per_s"):
            assert got[tag][rec["step"]] == pytest.approx(rec[tag], rel=1e-6)  # float32 of the same value
    assert all(v > 1e6 for v in got["memory_bytes"].values())
