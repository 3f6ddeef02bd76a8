"""The 4D-parallel Llama against the single-process ReferenceLlama (gloo, CPU processes), the
ReferenceLlama against transformers' LlamaForCausalLM, and the Hugging Face slicing API.

One spawn per grid checks: weights in through `load_hf` (reading slices) and back out through
`gather_hf`, the forward loss, every gradient, a few AdamW steps with clipping, and the recorded op
list of a real step against the program.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from backend_helpers import (fake_grid, random_batch, relative_errors, run_on_grid, sharded_gradients,  # noqa: E402
                             steps_against_reference)

from backend.models.llama import Llama, ReferenceLlama, gather_hf, hf_shapes, hf_slices, load_hf  # noqa: E402
from backend.models.build import make_model  # noqa: E402
from backend.training.optim import (local_batch, make_optimizer, make_reference_optimizer, micro_batches,  # noqa: E402
                           train_step)
from backend.runtime.recorder import Recorder  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from twin.program.program import STREAMS, Options, build_program  # noqa: E402

STEPS, LR, MAX_NORM = 3, 1e-2, 0.5


def _spec(vocab: int = 256):
    return replace(load_model("llama-tiny"), vocab=vocab)




class _Sliced:
    """A view that allows only basic slicing (as a safetensors slice does) and counts what is read."""

    def __init__(self, t: torch.Tensor, log: list):
        self.t, self.log = t, log

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        assert all(isinstance(k, slice) and k.step is None for k in key), key
        out = self.t[key]
        self.log.append(out.numel())
        return out.clone()


def _compare(ctx, options: Options, batch: int, vocab: int) -> dict:
    spec = _spec(vocab)
    ref = ReferenceLlama(spec, seed=7)
    state = ref.state_dict()
    model = make_model(spec, ctx, options=options)
    assert isinstance(model, Llama)
    log: list[int] = []
    load_hf(model, lambda name: _Sliced(state[name], log))
    biggest = max(log)
    back = gather_hf(model, "param")
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())
    n = options.micro_batches

    tokens, targets = random_batch(spec, batch, 0)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    loss = sharded_gradients(model, tokens, targets, n)
    full = gather_hf(model, "grad")
    rel_err = relative_errors(ref, full)

    ref_opt = make_reference_optimizer(ref, lr=LR)
    opt = make_optimizer(model, lr=LR)
    same = [random_batch(spec, batch, 1)] * STEPS
    losses, ref_losses, ops = steps_against_reference(model, opt, ref, ref_opt, same, n, MAX_NORM)
    return {"loss": loss, "ref_loss": float(ref_loss), "rel_err": rel_err, "losses": losses,
            "ref_losses": ref_losses, "ops": ops, "biggest_read": biggest}


CASES = [  # grid, options, batch, vocab (250: padded to 256, the padding rows masked in the loss)
    ("2x2x2x1", Options(), 8, 256),
    ("1x2x2x2", Options(micro_batches=2, recompute=False, cache_layers=1), 16, 250),
    ("1x1x2x1", Options(oar=False, ors=False, oag=False), 8, 256),
]


@pytest.mark.parametrize("grid,options,batch,vocab", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(grid: str, options: Options, batch: int, vocab: int) -> None:
    results = run_on_grid(grid, _compare, options, batch, vocab)
    g = Grid.parse(grid)
    prog = build_program(_spec(vocab), g, options, batch=batch)
    want = [(o.name, o.kind, o.stream, o.axis, o.bytes, o.m, o.n, o.k, o.layout)
            for o in prog.ops if o.kind == "gemm" or o.is_collective]
    biggest_tensor = max(torch.Size(s).numel() for s in hf_shapes(_spec(vocab)).values())
    for rank, r in enumerate(results):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-6), f"rank {rank}"
        worst = max(r["rel_err"], key=r["rel_err"].get)
        assert r["rel_err"][worst] < 1e-4, f"rank {rank}: gradient of {worst} off by {r['rel_err'][worst]:.2e}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-4), f"rank {rank}"
        got = [op for op in r["ops"] if op[1] == "gemm" or op[2] != "compute"]
        for stream in STREAMS:
            assert [o for o in got if o[2] == stream] == [o for o in want if o[2] == stream], \
                f"rank {rank}: recorded {stream} ops differ from the program"
        if g.tensor_size > 1:  # no rank reads a whole tensor
            assert r["biggest_read"] < biggest_tensor
    assert len({tuple(r["losses"]) for r in results}) == 1
    assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.parametrize("grid,options", [("2x2x2x2", Options()), ("4x2x2x1", Options(cache_layers=1, micro_batches=2)),
                                          ("1x2x4x1", Options(recompute=False, oag=False))])
def test_oplist_fake_grid(grid: str, options: Options) -> None:
    """Larger grids on PyTorch's fake process group: the recorded ops are the program's, per stream."""
    g, spec, batch = Grid.parse(grid), load_model("llama-tiny"), 8
    with fake_grid(g, rank=g.size - 1) as ctx:
        rec = Recorder()
        model = make_model(spec, ctx, options=options)
        opt = make_optimizer(model)
        tokens = torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=torch.Generator().manual_seed(0))
        mine = local_batch(tokens, model)
        train_step(model, opt, micro_batches(mine, mine, options.micro_batches))
        train_step(model, opt, micro_batches(mine, mine, options.micro_batches), recorder=rec)
    prog = build_program(spec, g, options, batch=batch)
    for stream in STREAMS:
        want = [(o.name, o.kind, o.stream) for o in prog.ops if o.stream == stream]
        assert [(r.name, r.kind, r.stream) for r in rec.records if r.stream == stream] == want, stream


def test_reference_matches_transformers(tmp_path) -> None:
    """ReferenceLlama loads LlamaForCausalLM's state_dict (same names and shapes) and gives its
    logits, with and without Llama 3.1's rope scaling; and a safetensors file feeds hf_slices."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open
    from safetensors.torch import save_file

    spec = _spec()
    for scaling in (None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}):
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                       tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(scaling or {})})
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(cfg).float().eval()
        s = replace(spec, rope_scaling=8.0, rope_original_context=16) if scaling else spec
        ref = ReferenceLlama(s)
        ref.load_state_dict(hf.state_dict())
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = hf(tokens).logits.float()
            assert torch.allclose(ref.logits(tokens), want, atol=1e-5, rtol=1e-5)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path))
    with fake_grid("2x2x2x1", rank=5) as ctx, safe_open(str(path), "pt") as f:
        model = make_model(spec, ctx)
        load_hf(model, f.get_slice)
        direct = make_model(spec, ctx)
        state = hf.state_dict()
        load_hf(direct, state.__getitem__)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), direct.parameters()))
        assert len(hf_slices(model)) == len(list(model.parameters()))
