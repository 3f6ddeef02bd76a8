"""Llama specs in the twin: published parameter counts, exact flops of the program, the GQA split over
y (with its one-line error), memory, and `twin simulate` / `twin search` on a Llama."""

import re
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from twin import Grid, Options, build_program, load_model
from twin.cli.main import app
from topologies.common import TwinError
from twin.predict.memory import memory_per_gpu

runner = CliRunner()


@pytest.mark.parametrize("name,published", [("llama-8b", 8.0e9), ("llama-70b", 70.6e9), ("llama-405b", 405.9e9)])
def test_parameters_match_published(name, published):
    """Dubey et al. (arXiv 2407.21783) / docs/reference/models.md, rounded to 0.1 B."""
    m = load_model(name)
    assert m.arch == "llama" and m.n_kv_heads == 8 and m.head_dim == 128 and m.vocab == 128256
    assert m.parameters(m.vocab) == pytest.approx(published, abs=0.051e9)


def test_405b_count_by_hand():
    m = load_model("llama-405b")
    h, f, kv, d, V, L = 16384, 53248, 8, 128, 128256, 126
    block = h * (h + 2 * kv * d) + h * h + 3 * h * f + 2 * h
    assert m.parameters(V) == L * block + 2 * V * h + h
    B, s = 2048, 2048
    linear = block - 2 * h
    assert m.reference_flops(B, s, V) == 4 * B * s * L * (2 * linear + 4 * s * h) + 6 * B * s * h * V


@pytest.mark.parametrize("name,grid", [("llama-tiny", "2x2x2x1"), ("llama-tiny", "1x2x1x4"),
                                       ("llama-405b", "8x8x4x16"), ("llama-70b", "2x4x8x8")])
@pytest.mark.parametrize("recompute", [True, False])
def test_matmul_flops_equal_reference(name, grid, recompute):
    m = load_model(name)
    prog = build_program(m, Grid.parse(grid), Options(recompute=recompute))
    ref = m.reference_flops(prog.batch, prog.seq_len, prog.vocab, recompute=recompute)
    assert prog.matmul_flops() == pytest.approx(ref, rel=1e-12)
    assert 1.0 < prog.model_flops() / ref < (1.02 if m.hidden >= 4096 else 1.2)  # norms, RoPE, SwiGLU, loss, AdamW


def test_llama_block_ops_and_shapes():
    """GQA: qkv's y-shard holds heads/G_y q and kv_heads/G_y k, v heads; gate and up are one GEMM;
    the untied head has its own gradient reduction; RMSNorm statistics are one number per token."""
    m = load_model("llama-tiny")  # h 64, 4 heads of 16, 2 kv heads, ffn 128
    g = Grid.parse("2x2x2x1")
    prog = build_program(m, g, Options())
    ops = {op.name: op for op in prog.ops}
    assert (ops["L0.qkv.fwd.gemm"].k, ops["L0.qkv.fwd.gemm"].n) == (32, (4 + 2 * 2) * 16 // 2)
    assert (ops["L0.mlp_up.fwd.gemm"].k, ops["L0.mlp_up.fwd.gemm"].n) == (32, 2 * 128 // 2)
    assert (ops["L0.mlp_down.fwd.gemm"].k, ops["L0.mlp_down.fwd.gemm"].n) == (64, 32)
    assert ops["L0.rope.fwd"].role == "rope" and ops["L0.swiglu.rec"].role == "swiglu"
    assert ops["L0.attn.fwd"].reads == ("L0.rope.out",) and ops["L0.rope.bwd"].writes == ("d:L0.qkv.out",)
    assert ops["L0.ln1.fwd"].role == "rms_norm" and ops["L0.ln1.fwd.ar_x"].bytes == 4 * prog.tokens_per_micro_batch
    assert "head.grad.ar_data" not in ops  # data = 1
    prog4 = build_program(m, Grid.parse("2x2x1x2"), Options())
    names = {op.name for op in prog4.ops}
    assert {"emb.grad.ar_data", "head.grad.ar_data"} <= names
    assert not any(re.search(r"gelu|wpe", n) for n in names)


def test_kv_heads_split_error():
    m = load_model("llama-405b")  # 8 kv heads
    build_program(m, Grid.parse("1x8x16x16"), Options())
    with pytest.raises(TwinError, match="8 key/value heads of llama-405b are not divisible by G_y=16"):
        build_program(m, Grid.parse("1x16x8x16"), Options())
    r = runner.invoke(app, ["simulate", "--system", "frontier", "--model", "llama-405b", "--gpus", "2048",
                            "--grid", "1x16x1x128"])
    assert r.exit_code == 2 and r.output.strip().count("\n") == 0 and "key/value heads" in r.output


def test_memory_of_405b():
    """bf16 mixed precision: 18 bytes per parameter of the rank's shard; recomputed activations."""
    m = load_model("llama-405b")
    g = Grid.parse("8x8x4x16")
    mem = memory_per_gpu(m, g, Options())
    assert mem.parameters + mem.gradients + mem.optimizer == pytest.approx(18 * m.parameters(m.padded_vocab(8)) / 256,
                                                                           rel=1e-3)
    tokens = 2048 // 64 * 2048
    assert mem.activations > 126 * 2 * tokens * m.hidden // 8
    assert mem.logits == 4 * tokens * m.padded_vocab(8) // 8


def test_program_builds_in_linear_ops():
    """A 1,000-layer Llama builds (the gather lookup is a dict: linear in layers)."""
    m = replace(load_model("llama-tiny"), layers=1000, name="llama-1000")
    prog = build_program(m, Grid.parse("1x1x2x1"), Options())
    assert len(prog.ops) < 62 * 1000


def test_simulate_llama_cli():
    r = runner.invoke(app, ["simulate", "--system", "frontier", "--model", "llama-8b", "--gpus", "64",
                            "--grid", "2x4x8x1", "--batch", "64", "--seq", "1024", "--json"])
    assert r.exit_code == 0, r.output
    assert '"model": "llama-8b"' in r.stdout
