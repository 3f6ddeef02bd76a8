"""The backend's recorded op list equals the twin's program: names, kinds, streams, axes, bytes, GEMM
sizes and layouts, and the order on each stream (large grids on PyTorch's fake process group in one
process, plus a real gloo run)."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from backend_helpers import fake_grid, run_on_grid  # noqa: E402

from backend.runtime.dist import ParallelContext, first_host  # noqa: E402
from backend.models.gpt import GPT  # noqa: E402
from backend.training.optim import local_batch, make_optimizer, micro_batches, train_step  # noqa: E402
from backend.runtime.recorder import Recorder  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from twin.program.program import STREAMS, Options, build_program  # noqa: E402
from twin.program.trace import read_trace, write_trace  # noqa: E402


def _key(op, full: bool) -> tuple:
    """GEMMs and collectives: everything; other compute ops: name and kind."""
    if full or op.kind == "gemm" or op.stream != "compute":
        return (op.name, op.kind, op.stream, op.axis, op.bytes, op.m, op.n, op.k, op.layout)
    return (op.name, op.kind, op.stream)


def _record_step(ctx: ParallelContext, model_name: str, options: Options, batch: int) -> Recorder:
    spec = load_model(model_name)
    rec = Recorder()
    model = GPT(spec, ctx, options)
    opt = make_optimizer(model)
    tokens = torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=torch.Generator().manual_seed(0))
    mine = local_batch(tokens, model)
    train_step(model, opt, micro_batches(mine, mine, options.micro_batches))  # warm-up step: not recorded
    train_step(model, opt, micro_batches(mine, mine, options.micro_batches), recorder=rec)
    return rec


def _assert_same(records: list, grid: Grid, model_name: str, options: Options, batch: int) -> None:
    prog = build_program(load_model(model_name), grid, options, batch=batch)
    for stream in STREAMS:
        want = [_key(op, False) for op in prog.ops if op.stream == stream]
        got = [_key(r, False) for r in records if r.stream == stream]
        assert got == want, f"{grid} {options}: {stream} stream differs"


FAKE_CASES = [
    ("2x2x2x2", "gpt-tiny", Options(), 8),
    ("2x2x2x2", "gpt-tiny", Options(oar=False, ors=False, oag=False), 8),
    ("2x2x2x2", "gpt-tiny", Options(recompute=False, oag=True, ors=False), 8),
    ("4x2x2x1", "gpt-tiny", Options(cache_layers=1), 8),
    ("4x2x2x1", "gpt-tiny", Options(cache_layers=1, micro_batches=2, recompute=False), 8),
    ("1x4x2x2", "gpt-tiny", Options(micro_batches=2, grad_clip=False), 16),
    ("2x2x4x1", "gpt-small", Options(cache_layers=2, micro_batches=2), 16),
    ("4x2x2x2", "gpt-small", Options(oag=False, cache_layers=4), 16),
    ("1x1x1x1", "gpt-tiny", Options(micro_batches=2), 8),
]


@pytest.mark.parametrize("grid,model_name,options,batch", FAKE_CASES)
def test_oplist_fake_grid(grid: str, model_name: str, options: Options, batch: int) -> None:
    g = Grid.parse(grid)
    with fake_grid(g, rank=g.size - 1) as ctx:
        records = _record_step(ctx, model_name, options, batch).records
    _assert_same(records, g, model_name, options, batch)


def _gloo_records(ctx: ParallelContext, options: Options, batch: int) -> list:
    return [r.key() for r in _record_step(ctx, "gpt-tiny", options, batch).records]


def test_oplist_gloo() -> None:
    grid, options, batch = Grid.parse("2x1x2x2"), Options(ors=False, micro_batches=2, cache_layers=1), 16
    prog = build_program(load_model("gpt-tiny"), grid, options, batch=batch)
    for records in run_on_grid(grid, _gloo_records, options, batch):
        for stream in STREAMS:
            want = [_key(op, True) for op in prog.ops
                    if op.stream == stream and (op.kind == "gemm" or op.is_collective)]
            got = [r for r in records if r[2] == stream and (r[1] == "gemm" or stream != "compute")]
            assert got == want, f"{stream} stream differs"


def test_grid_must_match_world_size() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(ValueError, match="world size is 4"):
            ParallelContext.build(Grid.parse("2x2x2x1"))
    finally:
        dist.destroy_process_group()


def test_spans_write_a_trace(tmp_path) -> None:
    with fake_grid("2x2x2x2") as ctx:
        rec = _record_step(ctx, "gpt-tiny", Options(), 8)
    spans = rec.spans(rank=3)
    assert len(spans) == len(rec.records) and all(s.duration_s >= 0 and s.start_s >= 0 for s in spans)
    assert spans[0].start_s <= spans[-1].start_s
    path = tmp_path / "trace"
    write_trace(path, spans)
    back = read_trace(path)
    assert sorted(s.name for s in back) == sorted(s.name for s in spans)
    assert {s.stream for s in back} == set(STREAMS)
    assert json.loads((path / "rank3.json").read_text())["traceEvents"]


def test_slurm_first_host() -> None:
    assert first_host("nid[001234-001240,001300]") == "nid001234"
    assert first_host("a01,a02") == "a01"
    assert first_host("node7") == "node7"


def test_gemm_layout_tuning_keeps_results() -> None:
    from backend.runtime.gemm import GemmTuner

    tuner = GemmTuner(enabled=True, repeats=1)
    a, b = torch.randn(64, 32), torch.randn(48, 32)
    out, used = tuner.matmul(a, b.t())
    assert used in GemmTuner.VARIANTS and torch.allclose(out, a @ b.t(), atol=1e-5)
    assert tuner.matmul(a, b.t())[1] == used and len(tuner.choice) == 1  # timed once per shape
    with fake_grid("2x2x2x1") as ctx:  # the recorded layout stays the program's; the one used is in args
        spec = load_model("gpt-tiny")
        rec = Recorder()
        model = GPT(spec, ctx, Options(), recorder=rec, tune_gemms=True)
        tokens = torch.randint(0, spec.vocab, (4, spec.seq_len))
        model(tokens, tokens, total_tokens=tokens.numel() * 2, reduce_loss=False).backward()
    gemms = [r for r in rec.records if r.kind == "gemm"]
    assert gemms and all(r.args.get("impl") in GemmTuner.VARIANTS for r in gemms)
    assert {r.layout for r in gemms} == {"NN", "NT", "TN"}


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_init_from_env(monkeypatch, launcher: str) -> None:
    from backend.runtime.dist import destroy, init_from_env
    from backend_helpers import free_port

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "SLURM_LOCALID",
                "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    if launcher == "torchrun":
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    else:
        monkeypatch.setenv("SLURM_PROCID", "0")
        monkeypatch.setenv("SLURM_LOCALID", "0")
        monkeypatch.setenv("SLURM_NTASKS", "1")
        monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    try:
        info = init_from_env("gloo")
        assert (info.rank, info.local_rank, info.world_size) == (0, 0, 1)
        if launcher == "slurm":
            assert os.environ["MASTER_ADDR"] == "localhost"
        with pytest.raises(ValueError, match="world size is 1"):
            ParallelContext.build(Grid.parse("2x1x1x1"))
        assert ParallelContext.build(Grid.parse("1x1x1x1")).coords == (0, 0, 0, 0)
    finally:
        destroy()
