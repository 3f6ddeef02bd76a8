"""Pipelined grids on the backend (gloo, CPU processes): gradients and a few AdamW steps against the
single-process ReferenceGPT, and the recorded op order of a step against each stage's program, send
for send."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from backend_helpers import random_batch, relative_errors, run_on_grid, steps_against_reference  # noqa: E402
from test_backend_grads import LR, MAX_NORM, STEPS  # noqa: E402

from backend.models.gpt import GPT  # noqa: E402
from backend.models.reference import ReferenceGPT, gather_full_grads, load_from_reference  # noqa: E402
from backend.training.optim import (local_batch, make_optimizer, make_reference_optimizer, micro_batches,  # noqa: E402
                                    step_gradients)
from twin.program.grid import Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from twin.program.program import Options, build_program  # noqa: E402


def _spec(layers: int):
    return dataclasses.replace(load_model("gpt-tiny"), layers=layers)


def _compare(ctx, options: Options, batch: int, layers: int = 2) -> dict:
    spec = _spec(layers)
    ref = ReferenceGPT(spec, seed=7)
    model = GPT(spec, ctx, options)
    load_from_reference(model, ref.state_dict())
    n = options.micro_batches
    tokens, targets = random_batch(spec, batch, 0)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    opt = make_optimizer(model, lr=LR)
    opt.zero_grad(set_to_none=True)
    loss = step_gradients(model, micro_batches(local_batch(tokens, model), local_batch(targets, model), n))
    full = gather_full_grads(model)
    rel_err = relative_errors(ref, full)
    ref_opt = make_reference_optimizer(ref, lr=LR)
    same = [random_batch(spec, batch, 1)] * STEPS
    losses, ref_losses, ops = steps_against_reference(model, opt, ref, ref_opt, same, n, MAX_NORM)
    return {"loss": loss, "ref_loss": float(ref_loss), "rel_err": rel_err, "losses": losses,
            "ref_losses": ref_losses, "ops": ops, "stage": ctx.stage}


CASES = [
    ("1x1x1x2x1", Options(micro_batches=2), 4, 2),
    ("2x1x1x2x1", Options(micro_batches=4), 8, 2),
    ("1x2x1x2x2", Options(micro_batches=2, cache_layers=1), 8, 2),
    ("1x1x1x4x1", Options(micro_batches=4, schedule="interleaved", chunks=2), 8, 8),
    ("1x1x2x2x1", Options(micro_batches=3, schedule="gpipe", oag=False), 6, 4),
]


@pytest.mark.parametrize("grid,options,batch,layers", CASES, ids=[f"{c[0]}-{c[1].schedule}" for c in CASES])
def test_pipelined_grid_matches_reference(grid: str, options: Options, batch: int, layers: int) -> None:
    g = Grid.parse(grid)
    results = run_on_grid(g, _compare, options, batch, layers, timeout_s=300)
    spec = _spec(layers)
    for rank, r in enumerate(results):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-6), f"rank {rank}"
        worst = max(r["rel_err"], key=r["rel_err"].get)
        assert r["rel_err"][worst] < 1e-4, f"rank {rank}: gradient of {worst} off by {r['rel_err'][worst]:.2e}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-4), f"rank {rank}"
        prog = build_program(spec, g, options, batch=batch, stage=r["stage"])
        for stream in ("compute", "x", "y", "z", "data", "pipe"):  # each stream in the program's order
            want = [(o.name, o.kind) for o in prog.ops
                    if o.stream == stream and (stream != "compute" or o.kind == "gemm")]
            got = [(o[0], o[1]) for o in r["ops"] if o[2] == stream and (stream != "compute" or o[1] == "gemm")]
            assert got == want, f"rank {rank}: recorded {stream} ops differ from its stage's program"
    assert results[0]["losses"][-1] < results[0]["losses"][0]


def test_killed_pipelined_run_resumes_exactly(tmp_path):
    """A run on 2 stages x 2 data replicas killed after step 3 resumes from its step-2 checkpoint, and
    its losses are those of an uninterrupted run (as tests/test_backend_resume.py checks for 4D grids)."""
    from test_backend_resume import backend, losses
    args = ["run", "--model", "gpt-tiny", "--grid", "1x1x1x2x2", "--micro-batches", "2", "--steps", "5",
            "--warmup", "2", "--lr", "3e-3"]
    ckpt = tmp_path / "ckpt"
    full = backend(args + ["--out", str(tmp_path / "full")])
    assert full.returncode == 0, full.stderr
    crashed = backend(args + ["--out", str(tmp_path / "a"), "--ckpt-dir", str(ckpt), "--ckpt-every", "2"],
                      env={"BACKEND_TEST_CRASH_AFTER_STEP": "3"})
    assert crashed.returncode != 0 and (ckpt / "latest").read_text().strip() == "step_00000002"
    resumed = backend(args + ["--out", str(tmp_path / "b"), "--ckpt-dir", str(ckpt), "--ckpt-every", "2"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed after step 2" in resumed.stdout
    want, after = losses(tmp_path / "full" / "log.jsonl"), losses(tmp_path / "b" / "log.jsonl")
    assert sorted(after) == [3, 4, 5]
    for step, loss in after.items():
        assert loss == pytest.approx(want[step], rel=1e-6, abs=1e-6), (step, loss, want[step])


@pytest.mark.parametrize("args,words", [
    (["--grid", "1x1x1x3x1"], "do not split evenly"),
    (["--grid", "1x1x1x2x1", "--micro-batches", "1"], "needs at least G_pipe = 2 micro-batches"),
])
def test_backend_refuses_a_bad_pipeline_in_one_line(args, words):
    from test_backend_resume import backend
    r = backend(["run", "--model", "gpt-tiny", "--steps", "1", *args])
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _compare_llama(ctx, options: Options, batch: int) -> dict:
    from test_llama_backend import _spec as llama_spec

    from backend.models.build import make_model
    from backend.models.llama import ReferenceLlama, gather_hf, load_hf
    spec = llama_spec()
    ref = ReferenceLlama(spec, seed=7)
    state = ref.state_dict()
    model = make_model(spec, ctx, options=options)
    load_hf(model, lambda name: state[name])
    tokens, targets = random_batch(spec, batch, 0)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    opt = make_optimizer(model, lr=LR)
    opt.zero_grad(set_to_none=True)
    loss = step_gradients(model, micro_batches(local_batch(tokens, model), local_batch(targets, model),
                                               options.micro_batches))
    full = gather_hf(model, "grad")
    rel_err = relative_errors(ref, full)
    return {"loss": loss, "ref_loss": float(ref_loss), "rel_err": rel_err}


def test_pipelined_llama_matches_reference() -> None:
    for rank, r in enumerate(run_on_grid("2x1x1x2x1", _compare_llama, Options(micro_batches=2), 8, timeout_s=300)):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-6), f"rank {rank}"
        worst = max(r["rel_err"], key=r["rel_err"].get)
        assert r["rel_err"][worst] < 1e-4, f"rank {rank}: gradient of {worst} off by {r['rel_err'][worst]:.2e}"


def test_a_pipelined_program_file_runs_and_trains_as_its_4d_twin(tmp_path):
    """`backend run --program` on a GPipe program file of 2 stages: the losses of the 4D grid with the
    same data split (1x1x1x2: data over 2 ranks there, stages here; the same math)."""
    from test_backend_resume import backend, losses

    from twin.program.pipeline import stage_programs
    from twin.program.programfile import save_program
    spec, o = load_model("gpt-tiny"), Options(micro_batches=2, schedule="gpipe")
    save_program(stage_programs(spec, Grid.parse("1x1x1x2x1"), o, batch=4), tmp_path / "pipe.json")
    piped = backend(["run", "--program", str(tmp_path / "pipe.json"), "--steps", "3", "--out", str(tmp_path / "p")])
    assert piped.returncode == 0, piped.stderr
    flat = backend(["run", "--model", "gpt-tiny", "--grid", "1x1x1x1", "--batch", "4", "--micro-batches", "2",
                    "--steps", "3", "--out", str(tmp_path / "f")])
    assert flat.returncode == 0, flat.stderr
    want = losses(tmp_path / "f" / "log.jsonl")
    assert losses(tmp_path / "p" / "log.jsonl") == pytest.approx(want, rel=1e-5)
