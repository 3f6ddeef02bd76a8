"""Checkpoints in torch.distributed.checkpoint resume on any grid: a run saved on 2x2x2x1 continues on
1x2x2x2, 4x1x1x2, 1x1x1x1 and a pipelined grid with the loss curve of a run that never switched; a
Llama trained with the goldfish loss does too; a crash in the middle of a save leaves `latest` good;
plain DCP reads a checkpoint into full tensors; the older per-rank format is refused on another grid
with one line that says what to do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from backend.runtime import checkpoint  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402

from backend_helpers import fake_grid  # noqa: E402

STEPS = 7  # saved after step 2, the 5 steps 3..7 run on the other grid
BASE = ["run", "--steps", str(STEPS), "--warmup", "2", "--lr", "3e-3", "--device", "cpu"]


def backend(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.cli", *args], capture_output=True, text=True,
                          timeout=180, env={**os.environ, **(env or {})})


def losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _saved_and_reference(root, model: str, extra: list[str], grid: str = "2x2x2x1"):
    """The uninterrupted run's losses on `grid`, and a checkpoint of its step 2 (written on `grid`)."""
    args = BASE + ["--model", model, "--grid", grid, *extra]
    full = backend(args + ["--out", str(root / "full")])
    assert full.returncode == 0, full.stderr
    first = backend([a if a != str(STEPS) else "2" for a in args]
                    + ["--out", str(root / "first"), "--ckpt-dir", str(root / "ck"), "--ckpt-every", "2"])
    assert first.returncode == 0, first.stderr
    return losses(root / "full" / "log.jsonl"), root / "ck"


@pytest.fixture(scope="module")
def gpt_saved(tmp_path_factory):
    return _saved_and_reference(tmp_path_factory.mktemp("gpt"), "gpt-tiny", [])


def _resume(ckpt, tmp_path, model: str, grid: str, extra: list[str]) -> dict[int, float]:
    mine = tmp_path / "ck"
    shutil.copytree(ckpt, mine)
    r = backend(BASE + ["--model", model, "--grid", grid, *extra, "--out", str(tmp_path / "out"),
                        "--ckpt-dir", str(mine)])
    assert r.returncode == 0, r.stderr
    assert "resumed after step 2" in r.stdout
    return losses(tmp_path / "out" / "log.jsonl")


def _assert_continues(want: dict, got: dict) -> None:
    assert sorted(got) == list(range(3, STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-5), (step, loss, want[step])


@pytest.mark.parametrize("grid, extra", [("1x2x2x2", []), ("4x1x1x2", []), ("1x1x1x1", []),
                                         ("2x1x2x2x1", ["--micro-batches", "2"])])
def test_a_2x2x2x1_checkpoint_continues_the_loss_curve_on_another_grid(gpt_saved, tmp_path, grid, extra):
    want, ckpt = gpt_saved
    _assert_continues(want, _resume(ckpt, tmp_path, "gpt-tiny", grid, extra))


def test_a_goldfish_llama_continues_on_another_grid(tmp_path):
    gold = ["--goldfish-k", "4"]
    want, ckpt = _saved_and_reference(tmp_path, "llama-tiny", gold, grid="1x1x2x1")  # 2 ranks: quick
    _assert_continues(want, _resume(ckpt, tmp_path / "other", "llama-tiny", "2x1x1x1", gold))
    refused = backend(BASE + ["--model", "llama-tiny", "--grid", "1x1x1x1", "--out", str(tmp_path / "x"),
                              "--ckpt-dir", str(tmp_path / "other" / "ck")])
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode != 0 and len(lines) == 1 and "goldfish k=4" in lines[0], refused.stderr


def test_plain_dcp_loads_a_checkpoint_into_full_tensors(gpt_saved, tmp_path):
    """The recipe of docs/checkpoints.md: torch.distributed.checkpoint alone, no backend code."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from backend.models.generate import load_weights
    from backend.models.reference import ReferenceGPT

    _, ckpt = gpt_saved
    step = ckpt / (ckpt / "latest").read_text().strip()
    dcp_to_torch_save(step, tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=False)
    weights = {k: v[0] for k, v in saved.items() if isinstance(v, torch.Tensor)}  # [weight, exp_avg, exp_avg_sq]
    spec = load_model("gpt-tiny")
    ref = ReferenceGPT(spec, vocab=weights["wte"].shape[0])
    ref.load_state_dict(weights)  # strict: every tensor, with the reference's shapes
    assert saved["train"]["step"] == 2 and saved["train"]["data"]["step"] == 2
    assert saved["train"]["optimizer_steps"] == 2
    assert float(saved["blocks.0.qkv"][1].abs().sum()) > 0 and float(saved["blocks.0.qkv"][2].min()) >= 0
    gathered = load_weights(ckpt)  # backend generate's reader
    for name, t in weights.items():
        assert torch.equal(gathered.tensors[name], t), name


def test_every_shard_is_its_boxes_of_the_full_tensors():
    """The placement of each rank's shards (GPT and Llama with GQA, fused gate/up and padding rows, a
    pipelined grid): every box views exactly its block of the full tensor, and one copy of each shard
    (data 0; norms: y = z = 0; a pipeline: the owner stage) covers every element once."""
    from backend.models.build import make_model
    from backend.models.llama import ReferenceLlama, load_hf
    from backend.models.placement import placements
    from backend.models.reference import ReferenceGPT, load_from_reference

    for name, grid in (("gpt-tiny", "2x2x2x1"), ("gpt-tiny", "1x1x4x2"), ("llama-tiny", "2x2x2x1"),
                       ("llama-tiny", "1x2x1x2x1")):
        spec, g = load_model(name), Grid.parse(grid)
        ref = ReferenceLlama(spec, seed=1) if spec.is_llama else ReferenceGPT(spec, spec.padded_vocab(g.y), seed=1)
        full = {k: v.detach() for k, v in ref.state_dict().items()}
        count = {k: torch.zeros_like(v) for k, v in full.items()}
        for rank in range(g.size):
            with fake_grid(g, rank) as ctx:
                model = make_model(spec, ctx)
                (load_hf(model, full.__getitem__) if spec.is_llama else load_from_reference(model, full))
                params = dict(model.named_parameters())
                places = placements(model)
                assert set(places) == set(params)
                for pname, pls in places.items():
                    for pl in pls:
                        for box in pl.boxes:
                            block = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
                            assert torch.equal(box.view(params[pname].detach().reshape(-1)), full[pl.name][block])
                            if ctx.coords[3] == 0 and pl.owner in (None, ctx.stage) and \
                                    (len(pl.shape) > 1 or ctx.coords[1:3] == (0, 0)):
                                count[pl.name][block] += 1
        for k, c in count.items():
            assert bool((c == 1).all()), (name, grid, k, c.unique())


def test_a_kill_during_a_save_leaves_latest_loadable(tmp_path):
    args = ["run", "--model", "gpt-tiny", "--grid", "1x1x2x1", "--steps", "4", "--warmup", "2", "--device", "cpu",
            "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "2"]
    killed = backend(args + ["--out", str(tmp_path / "a")], env={checkpoint.CRASH_IN_SAVE_ENV: "4"})
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_00000002"
    assert list((tmp_path / "ck").glob(".tmp.step_00000004"))  # the save that died: never published
    again = backend(args + ["--out", str(tmp_path / "b")])
    assert again.returncode == 0, again.stderr
    assert "resumed after step 2" in again.stdout
    assert checkpoint.latest(tmp_path / "ck").name == "step_00000004"
    assert not list((tmp_path / "ck").glob(".tmp.*"))


def test_an_old_format_checkpoint_is_refused_on_another_grid_with_how_to_convert(tmp_path):
    grid, model = Grid.parse("1x1x1x1"), load_model("gpt-tiny")
    path = checkpoint.save(tmp_path, 2, 0, {"step": 2}, checkpoint.make_meta(2, grid, model))  # per-rank files
    assert checkpoint.check_compatible(path, grid, model)["format"] == checkpoint.OLD_FORMAT  # its own grid reads it
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check_compatible(path, Grid.parse("2x1x1x1"), model)
    assert "resume once with --grid 1x1x1x1" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(checkpoint.CheckpointError, match="written for model"):
        checkpoint.check_compatible(path, grid, load_model("llama-tiny"))


def test_a_flat_range_is_cut_into_rectangles_in_order():
    """A z-chunk that starts or ends mid-row: a partial row, whole rows, a partial row."""
    from backend.models.placement import flat_rectangles

    for rows, cols in ((4, 6), (3, 5), (1, 7)):
        for a in range(rows * cols):
            for b in range(a, rows * cols + 1):
                cells = [r * cols + c for r0, r1, c0, c1 in flat_rectangles(rows, cols, a, b)
                         for r in range(r0, r1) for c in range(c0, c1)]
                assert cells == list(range(a, b)), (rows, cols, a, b)
                assert len(flat_rectangles(rows, cols, a, b)) <= 3


def test_moe_experts_resume_on_their_grid_and_are_refused_on_another(tmp_path):
    # the experts are saved per rank (no global placement maps them yet): the same grid continues the
    # run exactly, another grid gets one line before anything is read
    ref, ckpt = _saved_and_reference(tmp_path / "moe", "mixtral-tiny", [], grid="1x1x1x2e2")
    assert _resume(ckpt, tmp_path / "same", "mixtral-tiny", "1x1x1x2e2", []) == pytest.approx(
        {s: v for s, v in ref.items() if s > 2}, rel=1e-5)
    r = backend(BASE + ["--model", "mixtral-tiny", "--grid", "1x1x1x2", "--out", str(tmp_path / "other"),
                        "--ckpt-dir", str(ckpt)])
    assert r.returncode != 0
    assert "per rank" in r.stderr and "resume it on 1x1x1x2e2" in r.stderr and "Traceback" not in r.stderr
