"""`backend` command line: bad input ends with one clear line and a non-zero exit on every rank,
without a traceback or a hang; replay runs and writes a trace; --help everywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")

from backend.runtime import checkpoint  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from twin.program.trace import read_trace  # noqa: E402

TIMEOUT = 60


def backend(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.cli", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env={**os.environ, **(env or {})})


def assert_one_error_line(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_help_everywhere():
    for cmd in ([], ["run"], ["replay"], ["bench"]):
        r = backend(*cmd, "--help")
        assert r.returncode == 0 and "Usage" in r.stdout


def test_unknown_model_and_bad_grid():
    assert_one_error_line(backend("run", "--model", "gpt-nope"), "unknown model")
    assert_one_error_line(backend("run", "--grid", "2x2"), "XxYxZxD")
    assert_one_error_line(backend("replay", "--model", "gpt-tiny", "--grid", "1x3x1x1"), "divisible")


def test_missing_data_file_and_token_out_of_vocabulary(tmp_path):
    assert_one_error_line(backend("run", "--data", str(tmp_path / "nope.bin")), "does not exist")
    bad = tmp_path / "bad.bin"
    np.array([1, 2, 300, 4] * 100, dtype=np.uint16).tofile(bad)
    assert_one_error_line(backend("run", "--data", str(bad)), "token id 300", "vocabulary 256")


def test_checkpoint_from_another_grid(tmp_path):
    grid, model = Grid.parse("1x1x1x1"), load_model("gpt-tiny")
    checkpoint.save(tmp_path, 2, 0, {"step": 2}, checkpoint.make_meta(2, grid, model))  # its metadata decides
    assert_one_error_line(backend("run", "--grid", "1x1x2x1", "--ckpt-dir", str(tmp_path)), "grid 1x1x1x1")
    other = load_model("gpt-small")
    checkpoint.save(tmp_path, 3, 0, {"step": 3}, checkpoint.make_meta(3, grid, other))
    assert_one_error_line(backend("run", "--grid", "1x1x1x1", "--ckpt-dir", str(tmp_path)), "gpt-small")


def test_under_a_launcher_every_rank_reports_and_exits(tmp_path):
    """As under torchrun/srun: each process is one rank; a grid that does not match the world size
    is one line on every rank, exit 2, and nobody waits for a rendezvous."""
    procs = [subprocess.Popen([sys.executable, "-m", "backend.cli", "run", "--grid", "1x1x1x1"],
                              env={**os.environ, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r),
                                   "SLURM_NTASKS": "2"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=TIMEOUT)
        assert_one_error_line(subprocess.CompletedProcess(p.args, p.returncode, out, err),
                              "1 ranks", "started 2")


def test_replay_writes_a_trace(tmp_path):
    out = tmp_path / "replay"
    r = backend("replay", "--model", "gpt-tiny", "--grid", "1x1x2x1", "--steps", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    spans = read_trace(out)
    assert {s.rank for s in spans} == {0, 1}
    assert any(s.kind == "gemm" for s in spans) and any(s.stream == "z" for s in spans)


def test_bench_writes_a_table(tmp_path):
    import json
    out = tmp_path / "bench.json"
    r = backend("bench", "--model", "", "--grid", "1x1x1x2", "--squares", "64", "--sizes-mib", "0.01",
                "--min-time", "0.01", "--out", str(out))
    assert r.returncode == 0, r.stderr
    table = json.loads(out.read_text())
    assert {row["layout"] for row in table["gemm"]} == {"NN", "NT", "TN"}
    assert table["gemm"][0]["tflops"] > 0
    assert {(row["axis"], row["kind"]) for row in table["collectives"]} == {
        ("data", "all_reduce"), ("data", "all_gather"), ("data", "reduce_scatter")}
    assert table["machine"]["commit"] and table["ranks"] == 2 and table["ops"] and table["overlap"]
    assert all(row["busbw_gbps"] > 0 for row in table["collectives"])


def test_fabric_plugin_warning(monkeypatch, tmp_path):
    from backend.launch.env import fabric_warning
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("NCCL_NET_PLUGIN", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    assert fabric_warning("cpu") is None
    assert "libfabric" in fabric_warning("cuda")
    (tmp_path / "libnccl-net-ofi.so").write_bytes(b"")
    assert fabric_warning("cuda") is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    (tmp_path / "libnccl-net-ofi.so").unlink()
    assert fabric_warning("cuda") is None  # one node: no network plugin needed


def test_more_ranks_than_gpus_on_one_machine(monkeypatch):
    import torch

    from backend.training.train import check_run_flags
    from topologies.common import TwinError

    for var in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_run_flags(1, None, "cuda", 1)
    with pytest.raises(TwinError, match="2 ranks but this machine has 1 GPU"):
        check_run_flags(1, None, "cuda", 2)
    monkeypatch.setenv("RANK", "0")  # under torchrun each process is one rank: nothing to check here
    check_run_flags(1, None, "cuda", 2)


def test_backend_needs_no_simulator_packages():
    """The GPU check runs where only torch, numpy, typer and rich are sure to be (an H200 image):
    the backend must not import the simulator's plotly or networkx."""
    code = ("import sys, backend.cli.main, backend.training.train, backend.bench.replay, backend.bench.bench, backend.launch.launcher, "
            "backend.models.gpt, backend.training.optim, backend.runtime.checkpoint, backend.training.data, twin.program.trace; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('plotly', 'networkx')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=TIMEOUT)


def test_a_model_too_big_for_memory_is_one_line_before_any_allocation(tmp_path, monkeypatch):
    """The ranks' bytes (the twin's memory model + a rank's own overhead) against the memory available."""
    from typer.testing import CliRunner

    import backend.launch.launcher
    import backend.launch.env
    from backend.cli.main import app
    from backend.launch.env import RANK_OVERHEAD_BYTES, check_memory
    from twin.program.program import build_program

    big = tmp_path / "big.toml"
    big.write_text('name = "big"\nlayers = 16\nhidden = 16384\nheads = 16\nvocab = 256\nseq_len = 32\n'
                   'global_batch = 8\n')  # ~52 G parameters: ~770 GiB of fp32 state
    monkeypatch.setattr(backend.launch.launcher, "launch", lambda *a, **k: pytest.fail("ranks started"))
    r = CliRunner().invoke(app, ["run", "--model", str(big), "--steps", "1", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    line, = r.stderr.strip().splitlines()
    assert "big on grid 1x1x1x1 needs about" in line and "GiB of memory is available" in line, line
    r = CliRunner().invoke(app, ["replay", "--model", str(big), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "needs about" in r.stderr, r.output
    # 8 ranks of gpt-small fit in 1 GiB more than they need, not in 1 GiB less
    program = build_program(load_model("gpt-small"), Grid.parse("2x2x2x1"))
    from twin.predict.memory import memory_per_gpu
    need = 8 * (memory_per_gpu(program.model, program.grid, program.options, activation_bytes=4).total
                + RANK_OVERHEAD_BYTES)
    monkeypatch.setattr(backend.launch.env, "available_memory", lambda: need + 2**30)
    check_memory(program, "cpu", 4)
    monkeypatch.setattr(backend.launch.env, "available_memory", lambda: need - 2**30)
    with pytest.raises(Exception, match="x 8 rank"):
        check_memory(program, "cpu", 4)


@pytest.mark.parametrize("args", [["bench", "--out", "{f}/x.json"], ["replay", "--out", "{f}/trace"],
                                  ["memorization-study", "--out", "{f}/study"],
                                  ["memorization-study", "--out", "{d}/study", "--png", "{f}/x.png"]])
def test_output_paths_are_checked_before_the_ranks_start(args, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import backend.launch.launcher
    from backend.cli.main import app

    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(backend.launch.launcher, "launch", lambda *a, **k: pytest.fail("ranks started"))
    argv = [a.format(f=tmp_path / "file", d=tmp_path) for a in args]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2, r.output
    line, = r.stderr.strip().splitlines()
    assert "a part of the path is a file" in line, line
