"""What you simulate is what you run: an edited program (an all-gather issued earlier, an overlap
turned off) runs as edited on the backend, and its gradients are those of the original."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from backend_helpers import random_batch, run_on_grid  # noqa: E402
from test_programfile import edited  # noqa: E402

from backend.models.gpt import GPT  # noqa: E402
from backend.models.reference import ReferenceGPT, gather_full_grads, load_from_reference  # noqa: E402
from backend.training.optim import local_batch, reduce_gradients  # noqa: E402
from backend.runtime.recorder import Recorder  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from twin.program.program import STREAMS, Options, build_program  # noqa: E402

GRID, BATCH = "1x2x2x1", 8


def _grads(ctx, program) -> tuple[dict, list]:
    spec = load_model("gpt-tiny")
    ref = ReferenceGPT(spec, seed=7)
    rec = Recorder()
    model = GPT(spec, ctx, recorder=rec, program=program)
    load_from_reference(model, ref.state_dict())
    tokens, targets = random_batch(spec, BATCH, 0)
    loss = model(local_batch(tokens, model), local_batch(targets, model), total_tokens=int((targets >= 0).sum()))
    loss.backward()
    reduce_gradients(model)
    records = [(r.name, r.stream, r._start, r._end) for r in rec.records]
    return gather_full_grads(model), records


def _both(ctx, original, changed) -> dict:
    want, _ = _grads(ctx, original)
    got, records = _grads(ctx, changed)
    err = max(float((got[k] - want[k]).abs().max() / (want[k].abs().max() + 1e-12)) for k in want)
    return {"err": err, "records": records}


def test_backend_runs_the_edited_program() -> None:
    original = build_program(load_model("gpt-tiny"), Grid.parse(GRID), Options(), batch=BATCH)
    changed = edited(original)
    for rank, r in enumerate(run_on_grid(GRID, _both, original, changed)):
        assert r["err"] < 1e-5, f"rank {rank}: gradients changed by {r['err']:.2e}"
        got = r["records"]
        for stream in STREAMS:  # the recorded order on every stream is the edited program's
            want = [op.name for op in changed.ops if op.stream == stream and op.phase != "opt"]
            assert [n for n, s, _, _ in got if s == stream] == want, f"rank {rank}: {stream} stream"
        z = [n for n, s, _, _ in got if s == "z"]
        assert z[:2] == ["emb.fwd.ag_z", "L1.qkv.fwd.ag_z"]  # the gather moved to the front
        times = {n: (t0, t1) for n, _, t0, t1 in got}
        # the overlap turned off: the wgrad starts after its all-reduce completed (callback stamp, 2 ms slack)
        assert times["L1.mlp_up.bwd.wgrad"][0] >= times["L1.mlp_up.bwd.ar_y"][1] - 2e-3
