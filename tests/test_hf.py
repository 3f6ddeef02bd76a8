"""Hugging Face Llama checkpoints in and out: a tiny random Llama saved by transformers is imported on
several grids (each rank reading only its slices) and computes what transformers computes; a
checkpoint exports to a directory that transformers loads with identical weights and logits; a fine-tune
from Hugging Face on a 2x2x2x1 grid lowers its loss and exports; bad input gets one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from typer.testing import CliRunner  # noqa: E402

from backend.cli.main import app  # noqa: E402
from backend.hf.load import HFCheckpoint  # noqa: E402
from backend.hf.config import HFError, read_config  # noqa: E402
from backend.hf.export import IndexView, export  # noqa: E402

VOCAB, SEQ = 300, 16  # 300: padded to 384 by every grid, so export must drop the padding rows


def hf_logits(model_dir, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits.float()


def masked_loss(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                   ignore_index=-100))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama saved by transformers: one file (`single`) and sharded with an index (`sharded`)."""
    root = tmp_path_factory.mktemp("hf")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))  # not all ones: a misplaced norm shard would show
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="60KB")
    tokens = torch.from_numpy(np.random.default_rng(1).integers(0, VOCAB, size=(4, SEQ)))
    # Llama 3.1's rope: "llama3" frequency scaling (its original context shorter than the sequence here)
    scaled = transformers.LlamaConfig(**{**cfg.to_dict(), "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}})
    llama3 = transformers.LlamaForCausalLM(scaled).eval()
    llama3.save_pretrained(root / "llama3")
    # Llama 3.2 1B/3B: a head tied to the embedding (no lm_head.weight in the files)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg.to_dict(), "tie_word_embeddings": True})).eval()
    tied.save_pretrained(root / "tied")
    with torch.no_grad():
        logits = model(tokens).logits.float()
        logits3 = llama3(tokens).logits.float()
        logits_tied = tied(tokens).logits.float()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"single": root / "single", "sharded": root / "sharded", "llama3": root / "llama3", "tied": root / "tied",
            "tokens": tokens, "logits": logits, "logits_llama3": logits3, "logits_tied": logits_tied, "state": state}


# -- reading ---------------------------------------------------------------------------------------
def test_config_becomes_a_llama_spec(tiny):
    spec = HFCheckpoint(tiny["sharded"]).spec()
    assert (spec.arch, spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab, spec.seq_len) == \
        ("llama", 2, 64, 4, 2, 128, VOCAB, SEQ)
    assert spec.norm_eps == 1e-5 and spec.rope_theta == 10000.0 and not spec.tied_embeddings
    assert len(list(tiny["sharded"].glob("*.safetensors"))) > 2  # really sharded


def test_index_view_gives_the_flat_indices_of_a_block():
    v = IndexView((5, 7), base=100)
    assert (v[1:3, 2:4] == torch.tensor([[109, 110], [116, 117]])).all()
    assert (v[2:4] == torch.arange(114, 128).view(2, 7)).all() and v.get_shape() == [5, 7]


class Recorder:
    """Wraps a safetensors slice; records the size of every block read from it."""

    def __init__(self, view, reads):
        self.view, self.reads = view, reads

    def __getitem__(self, key):
        out = self.view[key]
        self.reads.append((out.numel(), int(np.prod(self.view.get_shape()))))
        return out


def _import_on_grid(ctx, model_dir: str, tokens, targets, ckpt_dir: str) -> dict:
    from safetensors import safe_open

    from backend.runtime import checkpoint
    from backend.hf.load import load_into
    from backend.models.llama import Llama, gather_hf

    spec = HFCheckpoint(model_dir).spec()
    model = Llama(spec, ctx)
    reads: list = []
    load_into(model, model_dir, wrap=lambda view: Recorder(view, reads))
    with torch.no_grad():
        loss = float(model(tokens.chunk(ctx.batch_shards)[ctx.batch_shard], targets.chunk(ctx.batch_shards)[ctx.batch_shard]))
    full = gather_hf(model)
    want = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, f), framework="pt") as st:
                want.update({k: st.get_tensor(k) for k in st.keys()})
    same = all(torch.equal(full[k], want[k]) for k in want) and set(full) == set(want)
    checkpoint.save(ckpt_dir, 1, ctx.rank, {"model": model.state_dict()}, checkpoint.make_meta(1, ctx.grid, spec))
    return {"loss": loss, "same": same, "reads": reads}


@pytest.mark.parametrize("grid,layout", [("1x1x1x1", "single"), ("2x1x1x1", "sharded"), ("1x2x1x1", "llama3"),
                                         ("1x1x2x1", "sharded"), ("1x1x1x1", "tied")])
def test_import_on_a_grid_computes_what_transformers_computes_and_exports_back(tiny, tmp_path, grid, layout):
    from backend_helpers import run_on_grid

    tokens = tiny["tokens"]
    targets = torch.roll(tokens, -1, 1)
    results = run_on_grid(grid, _import_on_grid, str(tiny[layout]), tokens, targets, str(tmp_path / "ckpt"))
    logits = tiny[{"llama3": "logits_llama3", "tied": "logits_tied"}.get(layout, "logits")]
    want = masked_loss(logits, targets)
    for rank, r in enumerate(results):
        assert r["same"] or layout == "tied", rank  # every tensor gathered back bit for bit
        assert r["loss"] == pytest.approx(want, rel=1e-5, abs=1e-6), rank
        if grid != "1x1x1x1":  # a rank never reads a whole matrix: only its blocks
            assert all(n < full for n, full in r["reads"] if full > 64), rank
    files = export(tmp_path / "ckpt", tmp_path / "out", max_shard_bytes=40_000)
    assert (tmp_path / "out" / "model.safetensors.index.json") in files
    assert torch.equal(hf_logits(tmp_path / "out", tokens), logits)  # identical weights and config: identical logits
    if layout == "single":
        one_line(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt-ids", "1"], "backend export")


def test_reference_llama_has_the_logits_of_transformers(tiny):
    from backend.models.llama import ReferenceLlama

    ref = ReferenceLlama(HFCheckpoint(tiny["single"]).spec())
    ref.load_state_dict(tiny["state"])
    with torch.no_grad():
        diff = float((ref.logits(tiny["tokens"]) - tiny["logits"]).abs().max())
    assert diff < 1e-5, diff


# -- fine-tuning from Hugging Face on a 2x2x2x1 grid ------------------------------------------------
def _examples(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(v) for v in rng.integers(0, 50, 2))
        out.append({"prompt": f"{a}+{b}=", "response": f"{a + b};"})
    return out


def test_finetune_from_hugging_face_on_2x2x2x1_lowers_the_loss_and_exports(tiny, tmp_path):
    from backend.training.finetune import ByteTokenizer, ExampleLoader, encode_examples

    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(e) + "\n" for e in _examples(64, 0)))
    held.write_text("".join(json.dumps(e) + "\n" for e in _examples(8, 1)))
    out, ckpt, hf_out = tmp_path / "run", tmp_path / "ckpt", tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "backend.cli", "finetune", "--init-from", str(tiny["single"]),
                        "--data", str(train), "--eval-data", str(held), "--grid", "2x2x2x1", "--steps", "8",
                        "--lr", "3e-3", "--eval-every", "4", "--out", str(out), "--ckpt-dir", str(ckpt),
                        "--export", str(hf_out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = [rec["loss"] for rec in log]
    evals = {rec["step"]: rec["val_loss"] for rec in log if "val_loss" in rec}
    assert sorted(evals) == [4, 8] and evals[8] < evals[4] and losses[-1] < losses[0]
    # step 1's loss is the imported model's: transformers' loss on the same batch
    pairs = [(e["prompt"], e["response"]) for e in _examples(64, 0)]
    ex = encode_examples(pairs, ByteTokenizer(), SEQ, VOCAB)
    first = ExampleLoader(ex, 8, 0, 1).batches(0)[0]
    assert losses[0] == pytest.approx(masked_loss(hf_logits(tiny["single"], first.inputs), first.targets), rel=1e-5)
    # the export: transformers' held-out loss equals the run's last held-out loss
    hex_ = encode_examples([(e["prompt"], e["response"]) for e in _examples(8, 1)], ByteTokenizer(), SEQ, VOCAB)
    tuned = hf_logits(hf_out, torch.from_numpy(hex_.inputs))
    assert masked_loss(tuned, torch.from_numpy(hex_.targets)) == pytest.approx(evals[8], rel=1e-5)


# -- bad input: one line, exit 2 --------------------------------------------------------------------
def one_line(args: list[str], *words: str) -> None:
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.output, r.output
    for w in words:
        assert w in lines[0], lines[0]


def test_bad_checkpoints_and_grids_get_one_line(tiny, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "response": "2;"}) + "\n" + json.dumps({"prompt": "2+2=", "response": "4;"}) + "\n")
    base = ["finetune", "--data", str(data), "--out", str(tmp_path / "run")]
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    one_line(base + ["--init-from", str(gpt)], "not a Llama")
    one_line(["run", "--init-from", str(gpt), "--out", str(tmp_path / "run")], "not a Llama")
    wrong = tmp_path / "wrong"
    shutil.copytree(tiny["single"], wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    one_line(base + ["--init-from", str(wrong)], "shape (128, 64)", "(96, 64)")
    gone = tmp_path / "gone"
    shutil.copytree(tiny["sharded"], gone)
    next(gone.glob("model-00002-*.safetensors")).unlink()
    one_line(base + ["--init-from", str(gone)], "missing")
    one_line(base + ["--init-from", str(tiny["single"]), "--grid", "1x4x1x1"], "key/value heads")
    one_line(base + ["--init-from", str(tmp_path / "nowhere")], "not a folder")
    one_line(["finetune", "--data", str(data)], "--init-from")
    one_line(["export", "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "x")], "does not exist")
    with pytest.raises(HFError, match="rope scaling 'yarn'"):
        (gone / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
        read_config(gone)


def test_a_truncated_safetensors_file_is_refused_before_any_rank_starts(tiny, tmp_path, monkeypatch):
    """An interrupted download: one line naming the file, before any rank is spawned."""
    import backend.launch.spawn as spawn

    monkeypatch.setattr(spawn, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    cut = tmp_path / "cut"
    shutil.copytree(tiny["single"], cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    one_line(["run", "--init-from", str(cut), "--grid", "1x1x1x2", "--out", str(tmp_path / "o")],
             f"{cut / 'model.safetensors'} is truncated", f"{len(data) // 2:,} bytes", f"describes {len(data):,}")
    shard = tmp_path / "shard"
    shutil.copytree(tiny["sharded"], shard)
    last = sorted(shard.glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-100])
    one_line(["run", "--init-from", str(shard), "--grid", "1x1x1x2", "--out", str(tmp_path / "o")],
             f"{last} is truncated")
    (cut / "model.safetensors").write_bytes(data[:4])
    one_line(["run", "--init-from", str(cut), "--out", str(tmp_path / "o")], "is not a safetensors file")


def test_weights_with_a_nan_are_refused_naming_the_tensor(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan"
    shutil.copytree(tiny["single"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    r = subprocess.run([sys.executable, "-m", "backend.cli", "run", "--init-from", str(bad), "--grid", "1x1x1x2",
                        "--steps", "2", "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: rank ") and "model.layers.1.mlp.down_proj.weight holds NaN" in lines[0], lines[0]
