"""The goldfish loss: a mask that depends only on the text, the same on every rank and grid, and a
4D-parallel loss and gradients equal to a single-process computation with that mask."""

from __future__ import annotations

import numpy as np
import pytest

from backend.training.goldfish import IGNORE, drop_mask, mask_rows, mask_targets, window_hash
from topologies.common import TwinError
from twin.program.grid import Grid
from twin.program.model import load_model
from twin.program.program import Options, build_program


def test_about_one_token_in_k_is_dropped():
    ids = np.random.default_rng(0).integers(0, 50_257, size=200_000)
    for k in (2, 4, 10):
        rate = drop_mask(ids, k, 13)[13:].mean()
        assert rate == pytest.approx(1 / k, abs=0.01), k
    every = drop_mask(ids[:100], 1, 5)
    assert not every[:5].any() and every[5:].all()  # k = 1: all tokens with a full context


def test_mask_depends_only_on_the_h_tokens_before():
    rng = np.random.default_rng(1)
    text = rng.integers(0, 256, size=300)
    h = 7
    want = drop_mask(text, 4, h)
    # the same text at another position of another row, after other tokens
    row = np.concatenate([rng.integers(0, 256, size=41), text])
    assert np.array_equal(drop_mask(row, 4, h)[41 + h:], want[h:])
    # changing a token changes the fate of (at most) the h tokens after it, nothing else
    other = text.copy()
    other[100] = (other[100] + 1) % 256
    diff = np.nonzero(drop_mask(other, 4, h) != want)[0]
    assert diff.size and diff.min() > 100 and diff.max() <= 100 + h
    # batched rows equal rows one by one
    rows = rng.integers(0, 256, size=(5, 64))
    assert np.array_equal(drop_mask(rows, 3, h), np.stack([drop_mask(r, 3, h) for r in rows]))


def test_any_vocabulary_without_overflow():
    ids = np.array([0, 1, 2**16 - 1, 2**31, 2**40 + 7, 2**62, 2**63 - 1] * 20, dtype=np.int64)
    with np.errstate(all="raise"):
        h = window_hash(ids, 5)
        mask = drop_mask(ids, 4, 5)
    assert h.dtype == np.uint64 and mask.shape == ids.shape
    small = np.array([3, 9, 250, 7, 1, 0, 4] * 20)
    assert np.array_equal(drop_mask(small.astype(np.uint16), 4, 5), drop_mask(small.astype(np.int64), 4, 5))
    # distinct large ids that agree modulo 2^32 hash differently
    assert window_hash(np.array([2**40 + 5]), 1)[0] != window_hash(np.array([5]), 1)[0]


def test_targets_and_bad_arguments():
    rows = np.arange(20).reshape(1, 20) * 7 % 256
    t = mask_targets(rows[:, :-1], rows[:, 1:], 2, 3)
    dropped = drop_mask(rows, 2, 3)[:, 1:]
    assert np.array_equal(t == IGNORE, dropped) and np.array_equal(t[~dropped], rows[:, 1:][~dropped])
    assert np.array_equal(mask_rows(rows, 2, 3), t)
    for k, h in ((0, 13), (-1, 13), (2, 0), (2.5, 13)):
        with pytest.raises(TwinError, match="goldfish"):
            drop_mask(rows, k, h)


def test_loader_masks_by_position_in_the_source_on_every_shard():
    """Every shard's targets equal the mask of the whole source at the windows' positions: the
    same tokens are dropped whatever the shard count (grid) or where a window starts."""
    from backend.training.data import ShardedLoader, TokenSource

    tokens = np.random.default_rng(2).integers(0, 256, size=5_000)
    source = TokenSource(tokens, "test")
    k, h, s, B = 4, 13, 32, 8
    whole = drop_mask(tokens, k, h)
    for shards in (1, 2, 4):
        for step in range(3):
            got = []
            for shard in range(shards):
                loader = ShardedLoader(source, B, s, shard, shards, micro_batches=1, seed=5,
                                       goldfish_k=k, goldfish_h=h)
                got += [b.targets.numpy() for b in loader.batches(step)]
            got = np.concatenate(got)
            offsets = loader.offsets(step)
            for row, o in zip(got, offsets):
                want = np.where(whole[o + 1:o + s + 1], IGNORE, tokens[o + 1:o + s + 1])
                assert np.array_equal(row, want)


def test_program_counts_the_mask_without_flops():
    spec, grid = load_model("gpt-tiny"), Grid.parse("2x2x1x2")
    plain = build_program(spec, grid, Options(micro_batches=2))
    fish = build_program(spec, grid, Options(micro_batches=2, goldfish_h=13))
    masks = [op for op in fish.ops if op.name.endswith("loss.fwd.mask")]
    assert [op.name for op in masks] == ["mb0.loss.fwd.mask", "mb1.loss.fwd.mask"]
    assert all(op.flops == 0 and op.bytes == 16 * fish.tokens_per_micro_batch for op in masks)
    assert fish.model_flops() == plain.model_flops() and len(fish.ops) == len(plain.ops) + 2


# -- exact under a 4D grid ------------------------------------------------------------------------
def _goldfish_step(ctx, k: int, h: int) -> dict:
    import torch

    from backend.training.data import ShardedLoader, TokenSource
    from backend.training.evaluate import held_out_loss
    from backend.models.gpt import GPT
    from backend.models.reference import ReferenceGPT, gather_full_grads, load_from_reference
    from backend.training.optim import reduce_gradients

    spec = load_model("gpt-tiny")
    tokens = np.random.default_rng(3).integers(0, spec.vocab, size=4_000)
    source = TokenSource(tokens, "test")
    B = 8
    ref = ReferenceGPT(spec, seed=11)
    model = GPT(spec, ctx, Options())
    load_from_reference(model, ref.state_dict())
    full = ShardedLoader(source, B, spec.seq_len, 0, 1, goldfish_k=k, goldfish_h=h).batches(0)[0]
    mine = ShardedLoader(source, B, spec.seq_len, ctx.batch_shard, ctx.batch_shards,
                         goldfish_k=k, goldfish_h=h).batches(0)[0]
    ref_loss = ref(full.inputs, full.targets)
    ref_loss.backward()
    loss = model(mine.inputs, mine.targets)
    loss.backward()
    reduce_gradients(model)
    grads = gather_full_grads(model)
    rel = max(float((grads[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-12)) for n, p in ref.named_parameters())
    # held-out evaluation: the forward alone on unmasked windows, the global mean on every rank
    plain_full = ShardedLoader(source, B, spec.seq_len, 0, 1).batches(1)[0]
    plain_mine = ShardedLoader(source, B, spec.seq_len, ctx.batch_shard, ctx.batch_shards).batches(1)[0]
    with torch.no_grad():
        plain = ref(plain_full.inputs, plain_full.targets)
    held_out = held_out_loss(model, [(plain_mine.inputs, plain_mine.targets)])
    return {"loss": float(loss), "ref": float(ref_loss), "rel": rel, "plain": float(plain), "held_out": held_out,
            "dropped": int((full.targets == IGNORE).sum()), "tokens": full.targets.numel()}


def test_goldfish_loss_on_a_4d_grid_equals_one_process():
    pytest.importorskip("torch")
    from backend_helpers import run_on_grid

    results = run_on_grid("2x2x1x2", _goldfish_step, 4, 13)
    for rank, r in enumerate(results):
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5), rank
        assert r["rel"] < 1e-4, rank
        assert r["held_out"] == pytest.approx(r["plain"], rel=1e-5), rank
    r = results[0]
    assert 0.15 < r["dropped"] / r["tokens"] < 0.35 and r["loss"] != pytest.approx(r["plain"], rel=1e-6)


def test_run_with_goldfish_and_held_out_loss(tmp_path):
    """`backend run --goldfish-k 4 --eval-data ...` on a 2-rank grid: it trains, and the held-out loss
    is in the log and on the progress line at the steps asked for."""
    pytest.importorskip("torch")
    import json
    import os
    import subprocess
    import sys

    held = tmp_path / "held.txt"
    held.write_bytes(bytes(range(256)) * 4)
    r = subprocess.run([sys.executable, "-m", "backend.cli", "run", "--model", "gpt-tiny", "--grid", "1x1x1x2",
                        "--steps", "4", "--goldfish-k", "4", "--goldfish-h", "5", "--eval-data", str(held),
                        "--eval-every", "2", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    evals = {rec["step"]: rec["val_loss"] for rec in log if "val_loss" in rec}
    assert sorted(evals) == [2, 4] and all(0 < v < 10 for v in evals.values())
    assert "held-out loss" in r.stdout
