"""Mixture of experts in the backend: the routing math (capacity first come first served, the
load-balancing loss and its gradients), the single-process references with MoE blocks, and
Hugging Face Mixtral in and out with transformers' logits."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from backend.models.llama import ReferenceLlama, hf_shapes  # noqa: E402
from backend.models.moe import moe_forward  # noqa: E402
from backend.models.reference import ReferenceGPT  # noqa: E402
from backend.runtime.moe import (aux_grad, aux_loss, capacity, expert_counts, keep_mask, route,  # noqa: E402
                                 weights_grad_to_logits)
from twin.program.model import ModelSpec, load_model  # noqa: E402


def mixtral_tiny(**kw) -> ModelSpec:
    """mixtral-tiny (4 SwiGLU experts, top-2, every block), changed by `kw`."""
    return replace(load_model("mixtral-tiny"), **kw)


# -- routing ---------------------------------------------------------------------------------------
def test_routing_renormalises_the_top_k_and_capacity_keeps_the_first_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 0.0, 1.0], [2.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    probs, idx, w = route(logits, 2)
    assert torch.allclose(probs.sum(-1), torch.ones(4)) and torch.allclose(w.sum(-1), torch.ones(4))
    assert idx[:, 0].tolist() == [0, 0, 0, 2]
    assert capacity(4, 2, 3, 1.0) == 3 and capacity(4, 2, 3, 0.0) is None
    keep = keep_mask(idx, 3, 2)  # expert 0 is chosen by tokens 0, 1, 2: the third is dropped
    assert keep[:, 0].tolist() == [True, True, False, True]
    assert keep[:, 1].tolist() == [True, True, True, False]  # expert 1: tokens 0, 2, 3
    assert keep_mask(idx, 3, None).all()


def test_balanced_routing_has_aux_loss_top_k_and_the_hand_gradients_match_autograd():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 4, generator=g, requires_grad=True)
    probs, idx, w = route(logits, 2)
    balanced = torch.arange(8).view(4, 2) % 4
    assert float(aux_loss(torch.full((4, 4), 0.25), balanced)) == pytest.approx(2.0)  # balanced: top_k
    (want,) = torch.autograd.grad(0.3 * aux_loss(probs, idx), logits, retain_graph=True)
    assert torch.allclose(aux_grad(probs.detach(), expert_counts(idx, 4), 12, 0.3), want, atol=1e-7)
    dw = torch.randn(12, 2, generator=g)
    (want,) = torch.autograd.grad((w * dw).sum(), logits)
    assert torch.allclose(weights_grad_to_logits(probs.detach(), idx, dw), want, atol=1e-6)


def test_capacity_and_aux_loss_are_per_group():
    """Two groups with a capacity: each group is routed as if alone (what a rank's micro-batch is);
    the auxiliary loss is over the micro-batch's groups together."""
    g = torch.Generator().manual_seed(1)
    x, wr = torch.randn(16, 8, generator=g), torch.randn(8, 4, generator=g)
    ups = [torch.randn(8, 8, generator=g) for _ in range(4)]

    def run(t, groups):
        return moe_forward(t, lambda u: u @ wr, lambda e, u: torch.tanh(u @ ups[e]), 4, 2, 0.5, groups)

    y, aux = run(x, 2)
    (y0, a0), (y1, a1) = run(x[:8], 1), run(x[8:], 1)
    assert torch.equal(y, torch.cat([y0, y1])) and float(aux) != pytest.approx(float(a0 + a1) / 2)
    # two micro-batches: the loss of each group alone, averaged
    assert float(moe_forward(x, lambda u: u @ wr, lambda e, u: u, 4, 2, 0.5, 2, 2)[1]) == \
        pytest.approx(float(a0 + a1) / 2)
    dropped = (run(x, 1)[0] - y).abs().max()
    assert dropped > 0  # grouping changes which tokens a capacity drops


def test_reference_models_with_moe_blocks_train():
    """ReferenceGPT and ReferenceLlama with MoE on every second block: the loss includes the aux term
    and every expert and router gets a gradient."""
    for arch in ("gpt", "llama"):
        if arch == "llama":
            spec = mixtral_tiny(moe_every=2, capacity_factor=1.0)
            ref = ReferenceLlama(spec, seed=3)
            assert hasattr(ref.model.layers[1], "block_sparse_moe") and hasattr(ref.model.layers[0], "mlp")
        else:
            base = load_model("gpt-tiny")
            spec = replace(base, experts=4, top_k=2, moe_every=2)
            ref = ReferenceGPT(spec, seed=3)
            assert hasattr(ref.blocks[1], "moe") and not hasattr(ref.blocks[1], "mlp_up")
        tokens = torch.randint(0, spec.vocab, (4, spec.seq_len), generator=torch.Generator().manual_seed(0))
        loss = ref(tokens, torch.roll(tokens, -1, 1), groups=2)
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in ref.named_parameters()
                   if "experts" in n or "gate" in n or "router" in n), arch


# -- Hugging Face Mixtral ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    root = tmp_path_factory.mktemp("mixtral")
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32, rms_norm_eps=1e-5,
                                     tie_word_embeddings=False, router_aux_loss_coef=0.02,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            elif "gate.weight" in name:
                p.mul_(20)  # a router far from uniform, so a misrouted token shows
    model.save_pretrained(root / "mixtral")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return {"dir": root / "mixtral", "tokens": tokens, "logits": logits}


def _files_state(folder) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def test_a_mixtral_config_becomes_a_moe_spec(hf_mixtral):
    from backend.hf.config import read_config

    cfg = read_config(hf_mixtral["dir"])
    assert (cfg.experts, cfg.top_k, cfg.aux_coef, cfg.ffn) == (4, 2, 0.02, 128)


def test_reference_mixtral_reads_transformers_files_and_gives_its_logits(hf_mixtral, tmp_path):
    """The files' tensors load into ReferenceLlama by name (block_sparse_moe.gate, experts.N.w1/w2/w3),
    its logits are transformers' (fp32), and its state saved with a Mixtral config loads back into
    transformers with the same logits."""
    transformers = pytest.importorskip("transformers")
    import json

    from safetensors.torch import save_file

    from backend.hf.config import config_from_spec

    spec = mixtral_tiny(router_aux_coef=0.02, rope_theta=1e6, norm_eps=1e-5, seq_len=32, vocab=256)
    state = _files_state(hf_mixtral["dir"])
    assert set(state) == set(hf_shapes(spec))
    assert all(tuple(v.shape) == hf_shapes(spec)[k] for k, v in state.items())
    ref = ReferenceLlama(spec)
    ref.load_state_dict(state)
    with torch.no_grad():
        got = ref.logits(hf_mixtral["tokens"])
    assert torch.allclose(got, hf_mixtral["logits"], atol=1e-5, rtol=1e-5)
    out = tmp_path / "back"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_from_spec(spec)))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        assert torch.equal(back(hf_mixtral["tokens"]).logits.float(), hf_mixtral["logits"])


def _import_on_grid(ctx, model_dir: str, tokens, targets, ckpt_dir: str) -> dict:
    from backend.hf.load import HFCheckpoint, load_into
    from backend.models.llama import Llama, gather_hf
    from backend.runtime import checkpoint

    spec = HFCheckpoint(model_dir).spec(seq_len=tokens.shape[1])
    model = Llama(spec, ctx)
    load_into(model, model_dir)
    with torch.no_grad():
        loss = float(model(tokens.chunk(ctx.batch_shards)[ctx.batch_shard], targets.chunk(ctx.batch_shards)[ctx.batch_shard]))
    same = all(torch.equal(v, _files_state_dir(model_dir)[k]) for k, v in gather_hf(model).items())
    checkpoint.save(ckpt_dir, 1, ctx.rank, {"model": model.state_dict()}, checkpoint.make_meta(1, ctx.grid, spec))
    return {"loss": loss, "same": same, "experts": spec.experts}


def _files_state_dir(folder: str) -> dict:
    from pathlib import Path

    return _files_state(Path(folder))


def test_mixtral_import_on_an_expert_grid_and_export_back_give_transformers_logits(hf_mixtral, tmp_path):
    """A transformers Mixtral imported on 2x1x1x2e2 (experts over 2 ranks, features over x): every
    tensor gathers back bit for bit, the loss is the reference's on the same files (transformers'
    logits), and `export` of the run's checkpoint loads into transformers with identical logits."""
    from backend_helpers import run_on_grid

    from backend.hf.export import export
    from backend.hf.load import HFCheckpoint

    transformers = pytest.importorskip("transformers")
    tokens = hf_mixtral["tokens"]
    targets = torch.roll(tokens, -1, 1)
    results = run_on_grid("2x1x1x2e2", _import_on_grid, str(hf_mixtral["dir"]), tokens, targets, str(tmp_path / "ckpt"))
    spec = HFCheckpoint(hf_mixtral["dir"]).spec(seq_len=32)
    ref = ReferenceLlama(spec)
    ref.load_state_dict(_files_state(hf_mixtral["dir"]))
    with torch.no_grad():
        want = float(ref(tokens, targets, groups=2))
    for rank, r in enumerate(results):
        assert r["same"] and r["experts"] == 4, rank
        assert r["loss"] == pytest.approx(want, rel=1e-5), rank
    export(tmp_path / "ckpt", tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(back).__name__ == "MixtralForCausalLM" and back.config.num_local_experts == 4
    with torch.no_grad():
        assert torch.equal(back(tokens).logits.float(), hf_mixtral["logits"])


@pytest.mark.parametrize("args,words", [
    (["--model", "mixtral-tiny", "--grid", "1x1x1x6e3", "--batch", "6"], ("4 experts", "E_p=3")),
    (["--model", "mixtral-tiny", "--grid", "1x1x1x4e3"], ("E_p=3", "G_data=4")),
    (["--model", "{dir}/topk.toml", "--grid", "1x1x1x2e2"], ("top_k 5",)),
    (["--model", "{dir}/cf.toml", "--grid", "1x1x1x2e2"], ("capacity_factor",)),
])
def test_bad_moe_input_to_backend_run_is_one_line_exit_2(tmp_path, args, words):
    from pathlib import Path

    from typer.testing import CliRunner

    from backend.cli.main import app
    from twin.program.model import MODELS_DIR

    text = (Path(MODELS_DIR) / "mixtral-tiny.toml").read_text()
    (tmp_path / "topk.toml").write_text(text.replace("top_k = 2", "top_k = 5"))
    (tmp_path / "cf.toml").write_text(text.replace("top_k = 2", "top_k = 2\ncapacity_factor = -1.0"))
    args = [a.replace("{dir}", str(tmp_path)) for a in args]
    r = CliRunner().invoke(app, ["run", *args, "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.output
