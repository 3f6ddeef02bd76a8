"""The 4D-parallel GPT against the single-process ReferenceGPT on gpt-tiny (gloo, CPU processes).

One spawn per grid checks: the forward loss, every gradient (after the end-of-step reductions), a
few AdamW steps with gradient clipping, and the recorded op list of a real step against the program.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from backend_helpers import random_batch, run_on_grid, sharded_gradients, steps_against_reference  # noqa: E402

from backend.models.gpt import GPT  # noqa: E402
from backend.models.reference import ReferenceGPT, gather_full, gather_full_grads, load_from_reference  # noqa: E402
from backend.training.optim import (local_batch, make_optimizer, make_reference_optimizer,  # noqa: E402
                           reduce_gradients, train_step)
from backend.runtime.recorder import Recorder  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from twin.program.program import Options, build_program  # noqa: E402

STEPS, LR, MAX_NORM = 3, 1e-2, 0.5




def _compare(ctx, options: Options, batch: int) -> dict:
    spec = load_model("gpt-tiny")
    ref = ReferenceGPT(spec, seed=7)
    model = GPT(spec, ctx, options)
    load_from_reference(model, ref.state_dict())
    back = gather_full(model, "param")
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items()) and len(back) == len(ref.state_dict())
    n = options.micro_batches

    # forward and gradients of one batch
    tokens, targets = random_batch(spec, batch, 0)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    loss = sharded_gradients(model, tokens, targets, n)
    full = gather_full_grads(model)
    abs_err, rel_err = {}, {}
    for k, p in ref.named_parameters():
        diff = float((full[k] - p.grad).abs().max())
        abs_err[k], rel_err[k] = diff, diff / (float(p.grad.abs().max()) + 1e-12)

    # a few AdamW steps with clipping; the first one recorded
    ref_opt = make_reference_optimizer(ref, lr=LR)
    opt = make_optimizer(model, lr=LR)
    same = [random_batch(spec, batch, 1)] * STEPS  # the same batch: the loss must go down
    losses, ref_losses, ops = steps_against_reference(model, opt, ref, ref_opt, same, n, MAX_NORM)
    return {"loss": loss, "ref_loss": float(ref_loss), "abs_err": abs_err, "rel_err": rel_err,
            "losses": losses, "ref_losses": ref_losses, "ops": ops}


def _program_ops(grid: Grid, options: Options, batch: int) -> list[tuple]:
    prog = build_program(load_model("gpt-tiny"), grid, options, batch=batch)
    return [(o.name, o.kind, o.stream, o.axis, o.bytes, o.m, o.n, o.k, o.layout)
            for o in prog.ops if o.kind == "gemm" or o.is_collective]


CASES = [
    ("2x2x2x1", Options(), 8),
    ("1x1x2x4", Options(micro_batches=2, cache_layers=1), 16),
    ("2x1x1x2", Options(oar=False, ors=False, oag=False, recompute=False), 8),
    ("1x2x2x2", Options(cache_layers=2, micro_batches=2, recompute=False), 16),
]


@pytest.mark.parametrize("grid,options,batch", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(grid: str, options: Options, batch: int) -> None:
    results = run_on_grid(grid, _compare, options, batch)
    want_ops = _program_ops(Grid.parse(grid), options, batch)
    for rank, r in enumerate(results):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-6), f"rank {rank}"
        worst = max(r["rel_err"], key=r["rel_err"].get)
        assert r["rel_err"][worst] < 1e-4, f"rank {rank}: gradient of {worst} off by {r['rel_err'][worst]:.2e}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-4), f"rank {rank}"
        got = [op for op in r["ops"] if op[1] == "gemm" or op[2] != "compute"]
        for stream in ("compute", "x", "y", "z", "data"):  # the order on each stream is the program's
            assert [o for o in got if o[2] == stream] == [o for o in want_ops if o[2] == stream], \
                f"rank {rank}: recorded {stream} ops differ from the program"
    assert len({tuple(r["losses"]) for r in results}) == 1  # every rank reports the same losses
    assert results[0]["losses"][-1] < results[0]["losses"][0]


def _compare_bf16(ctx, batch: int) -> dict:
    """The GPU's precision path on CPU: bf16 compute, fp32 shards and gradients, GEMM layout tuning."""
    ctx.dtype = torch.bfloat16
    spec = load_model("gpt-tiny")
    ref = ReferenceGPT(spec, seed=7)
    rec = Recorder()
    model = GPT(spec, ctx, Options(), recorder=rec, tune_gemms=True)
    load_from_reference(model, ref.state_dict())
    tokens, targets = random_batch(spec, batch, 0)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    loss = model(local_batch(tokens, model), local_batch(targets, model), total_tokens=int((targets >= 0).sum()))
    loss.backward()
    reduce_gradients(model)
    full = gather_full_grads(model)
    rel_err = {k: float((full[k] - p.grad).abs().max() / p.grad.abs().max()) for k, p in ref.named_parameters()}
    return {"loss": float(loss.detach()), "ref_loss": float(ref_loss.detach()), "rel_err": rel_err,
            "grad_dtypes": {str(p.grad.dtype) for p in model.parameters()},
            "sent": {r.args["dtype"] for r in rec.records if r.stream != "compute"},
            "tuned": all("impl" in r.args for r in rec.records if r.kind == "gemm")}


@pytest.mark.parametrize("grid", ["1x1x1x1", "2x2x2x1"])
def test_bf16_path_on_cpu(grid: str) -> None:
    """1x1x1x1 takes the fused layer norm, 2x2x2x1 the x-parallel one; bf16 is within 3% per tensor."""
    for rank, r in enumerate(run_on_grid(grid, _compare_bf16, 8)):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=2e-3), f"rank {rank}"
        worst = max(r["rel_err"], key=r["rel_err"].get)
        assert r["rel_err"][worst] < 3e-2, f"rank {rank}: gradient of {worst} off by {r['rel_err'][worst]:.2e}"
        assert r["grad_dtypes"] == {"torch.float32"} and r["tuned"]
        assert r["sent"] <= {"bfloat16", "float32"} and ("bfloat16" in r["sent"]) == (grid != "1x1x1x1")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_one_rank(tmp_path) -> None:
    """On one GPU (NCCL, bf16, GEMM layout tuning, CUDA-event timing): close to the fp32 reference."""
    import torch.distributed as dist

    from backend.runtime.dist import ParallelContext
    from backend_helpers import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ctx = ParallelContext.build(Grid.parse("1x1x1x1"))
        assert ctx.device.type == "cuda" and ctx.compute_dtype == torch.bfloat16
        spec = load_model("gpt-tiny")
        ref = ReferenceGPT(spec, seed=7)
        rec = Recorder(device=ctx.device)
        model = GPT(spec, ctx, Options(), recorder=rec)
        load_from_reference(model, ref.state_dict())
        tokens, targets = random_batch(spec, 8, 0)
        loss = model(tokens, targets)
        loss.backward()
        assert float(loss) == pytest.approx(float(ref(tokens, targets)), rel=2e-2)
        spans = rec.spans(0)
        assert spans and all(s.duration_s >= 0 for s in spans)
        assert all("impl" in r.args for r in rec.records if r.kind == "gemm")
        opt = make_optimizer(model, lr=LR)  # fused AdamW on GPU
        assert opt.param_groups[0]["fused"]
        losses = [train_step(model, opt, [(tokens, targets)], max_norm=MAX_NORM) for _ in range(STEPS)]
        assert losses[-1] < losses[0]
    finally:
        dist.destroy_process_group()
