"""backend.runtime.dcp_read and dcp_write: DCP's tensor items read without torch.load give exactly
what torch.load gives, and anything the fast path does not recognise is still read, by torch.load;
written without torch.save they are torch.save's archives byte for byte."""

import io
import warnings

import pytest

torch = pytest.importorskip("torch")

from backend.runtime import dcp_read, dcp_write  # noqa: E402


def _archive(obj, crc32: bool = True) -> bytes:
    """torch.save's archive of obj, with or without its records' CRC-32s."""
    buf = io.BytesIO()
    torch.serialization.set_crc32_options(crc32)
    try:
        torch.save(obj, buf)
    finally:
        torch.serialization.set_crc32_options(True)
    return buf.getvalue()


@pytest.mark.parametrize("tensor", [
    torch.randn(5, 7)[:, 2:],  # a view with a storage offset
    torch.randn(4, 6).t(),  # strides not row-major
    torch.arange(10, dtype=torch.bfloat16)[3:],
    torch.tensor(3.0, dtype=torch.float64),
    torch.randint(0, 9, (3, 4), dtype=torch.int64),
    torch.zeros(0, 3),
])
def test_a_tensor_archive_reads_as_torch_load_reads_it(tensor):
    got = dcp_read.tensor_from_archive(_archive(tensor))
    want = torch.load(io.BytesIO(_archive(tensor)), weights_only=True)
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got, want)


def test_anything_else_is_left_to_torch_load():
    data = _archive({"a": torch.ones(2), "b": [1, 2]})
    with pytest.raises(dcp_read._NotPlain):
        dcp_read.tensor_from_archive(data)
    assert dcp_read._read_tensor(data)["b"] == [1, 2]
    with pytest.raises(Exception):
        dcp_read.tensor_from_archive(b"not a zip at all" * 3)


def test_the_reader_loads_a_plain_dcp_checkpoint_as_dcp_does(tmp_path):
    """A checkpoint written by plain DCP (default planner, whole tensors and objects):
    FastReader fills the same state dict as DCP's FileSystemReader, and reads no tensor with torch.load."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(6, 4), "v": torch.arange(5, dtype=torch.bfloat16), "step": 7, "name": "x"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that a process without a process group saves alone
        dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
        want = {"w": torch.empty(6, 4), "v": torch.empty(5, dtype=torch.bfloat16), "step": 0, "name": None}
        got = {"w": torch.empty(6, 4), "v": torch.empty(5, dtype=torch.bfloat16), "step": 0, "name": None}
        dcp.load(want, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
        loads = []
        real_load = torch.load
        try:
            def spy(*a, **k):  # the planner unpickles objects with torch.load: count the tensors only
                out = real_load(*a, **k)
                loads.extend([out] if isinstance(out, torch.Tensor) else [])
                return out
            torch.load = spy
            dcp.load(got, storage_reader=dcp_read.FastReader(tmp_path), no_dist=True)
        finally:
            torch.load = real_load
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["v"], state["v"])
    assert got["step"] == want["step"] == 7 and got["name"] == want["name"] == "x"
    assert loads == []


def test_a_truncated_file_is_an_error_not_garbage(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(64, 64)}, checkpoint_id=tmp_path, no_dist=True)
        data = next(tmp_path.glob("*.distcp"))
        data.write_bytes(data.read_bytes()[:1000])
        with pytest.raises(BaseException, match="truncated"):
            dcp.load({"w": torch.empty(64, 64)}, storage_reader=dcp_read.FastReader(tmp_path), no_dist=True)


@pytest.mark.parametrize("tensor", [
    torch.arange(6.0),
    torch.randn(3, 64, 32),
    torch.arange(10, dtype=torch.bfloat16),
    torch.tensor(2.5, dtype=torch.float64),
    torch.ones(5, dtype=torch.bool),
    torch.randint(0, 100, (7, 3)),
])
@pytest.mark.parametrize("crc32", [True, False])
def test_an_archive_is_torch_saves_byte_for_byte(tensor, crc32):
    out = io.BytesIO()
    n = dcp_write.write_archive(out, [tensor], tuple(tensor.shape), crc32=crc32)
    assert out.getvalue() == _archive(tensor, crc32) and n == len(out.getvalue())
    if not crc32:  # torch.load checks no CRC-32: the archive without them loads
        assert torch.equal(torch.load(io.BytesIO(out.getvalue())), tensor)


def test_an_archive_of_pieces_is_the_stacked_tensors_and_an_empty_one_is_left_to_torch_save():
    pieces = [torch.randn(4, 6)[:, 1:5] for _ in range(3)]  # strided views, as a box of a shard is
    for crc32 in (True, False):
        out = io.BytesIO()
        dcp_write.write_archive(out, pieces, (3, 4, 4), crc32=crc32)
        assert out.getvalue() == _archive(torch.stack(pieces), crc32)
    with pytest.raises(ValueError):
        dcp_write.write_archive(io.BytesIO(), [torch.zeros(0, 3)], (0, 3))


def _read_on_rank(rank: int, store: str, folders: list, out) -> None:
    import torch.distributed as dist

    from backend.runtime import dcp

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        dcp.read({"w": torch.empty(8, 8)}, folders[rank])
        out.put((rank, "read"))
    except BaseException as e:  # noqa: BLE001 - the test looks at what each rank raised
        out.put((rank, f"{type(e).__name__}: {e}"))
    dist.destroy_process_group()


def test_a_rank_that_cannot_read_makes_every_rank_fail(tmp_path):
    """Each rank reads alone; a failure on one is raised on the other too, with its line."""
    import multiprocessing as mp

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(8, 8)}, checkpoint_id=tmp_path / "good", no_dist=True)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_read_on_rank, args=(r, str(tmp_path / "store"), [tmp_path / "good", tmp_path / "gone"],
                                                     out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert "No such file" in got[1], got
    assert got[0].startswith("RuntimeError: another rank could not read it: ") and "No such file" in got[0], got


def test_a_rank_file_hashes_what_it_writes_and_starts_its_writeback_as_it_goes(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setattr(dcp_write, "WRITEBACK", 1000)
    data = [bytes([i]) * 700 for i in range(10)]
    out = dcp_write.HashingFile(tmp_path / "f")
    for d in data:
        out.write(d)
    assert out.started == 7000  # asked the kernel to write back each time 1000 bytes or more were new
    assert out.close() == (hashlib.sha256(b"".join(data)).hexdigest(), 7000)
    assert (tmp_path / "f").read_bytes() == b"".join(data)
