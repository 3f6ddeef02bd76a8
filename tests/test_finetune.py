"""Fine-tuning data: prompt/response examples whose loss counts only the response, on any grid."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend.training.data import DataError
from backend.training.finetune import (IGNORE, ByteTokenizer, Examples, ExampleLoader, default_lr, default_warmup,
                              encode_examples, read_examples, split_held_out)

PAIRS = [("What is 2+2? ", "4."), ("Say hi: ", "hi there"), ("", "no prompt at all"),
         ("A prompt of thirty characters.", "yes!!")]  # 35 tokens: cut at 33


def test_targets_count_only_the_response():
    ex = encode_examples(PAIRS, ByteTokenizer(), seq_len=32, vocab=256)
    assert ex.inputs.shape == ex.targets.shape == (4, 32)
    for row, (p, r) in enumerate(PAIRS):
        ids = list((p + r).encode())[:33]
        counted = [int(t) for t in ex.targets[row] if t != IGNORE]
        want = list(r.encode()) if p else list(r.encode())[1:]  # a response's first token needs a token before it
        assert counted == want[:len(ids) - max(len(p), 1)], row
        assert list(ex.inputs[row, :len(ids) - 1]) == ids[:-1]
    assert ex.counted == sum(len(r) for _, r in PAIRS) - 1 - 2 and ex.truncated == 1


def test_bad_lines_and_prompts_get_one_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n\n{not json\n")
    with pytest.raises(DataError, match=r"d.jsonl:3: not JSON"):
        read_examples(f)
    f.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    with pytest.raises(DataError, match=r":1: .*\"prompt\" and \"response\""):
        read_examples(f)
    with pytest.raises(DataError, match="no response token is left"):
        encode_examples([("x" * 40, "y")], ByteTokenizer(), 32, 256)
    with pytest.raises(DataError, match="vocabulary 100"):
        encode_examples([("a", "\u00e9")], ByteTokenizer(), 32, 100)


def test_loader_is_a_pure_function_of_the_step_and_splits_whole_examples():
    ex = encode_examples([(f"q{i} ", f"answer {i}") for i in range(10)], ByteTokenizer(), 16, 256)
    full = ExampleLoader(ex, 4, 0, 1, seed=3)
    epochs = np.concatenate([full.indices(s) for s in range(5)])  # 20 draws = two epochs of 10
    assert sorted(epochs[:10]) == list(range(10)) and sorted(epochs[10:]) == list(range(10))
    parts = [ExampleLoader(ex, 4, shard, 2, micro_batches=2, seed=3).batches(1) for shard in range(2)]
    rows = np.concatenate([b.inputs.numpy() for part in parts for b in part])
    assert (rows == ex.inputs[full.indices(1)]).all()
    loader = ExampleLoader(ex, 4, 0, 1, seed=3)
    loader.next(), loader.next()
    again = ExampleLoader(ex, 4, 0, 1, seed=3)
    again.load_state_dict(loader.state_dict())
    assert (again.next()[0].targets == loader.next()[0].targets).all()


def test_defaults_and_held_out_split():
    assert default_lr(4096) == pytest.approx(2e-5) and default_lr(16384) == pytest.approx(1e-5)
    assert 1e-4 < default_lr(64) < 2e-4
    assert default_warmup(10) == 1 and default_warmup(1000) == 30
    ex = Examples(np.zeros((40, 8), np.int64), np.zeros((40, 8), np.int64), 0)
    train, held = split_held_out(ex)
    assert (len(train), len(held)) == (38, 2)


# -- the loss over counted tokens on a 4D grid ------------------------------------------------------
def _masked_step(ctx, arch: str) -> dict:
    import torch

    from backend.models.gpt import GPT
    from backend.models.reference import ReferenceGPT, gather_full_grads, load_from_reference
    from backend.training.optim import make_optimizer, train_step
    from twin.program.model import load_model
    from twin.program.program import Options

    spec = load_model(f"{arch}-tiny")
    rng = np.random.default_rng(5)
    # prompts of very different lengths: some shards count many more tokens than others
    pairs = [("p" * int(rng.integers(0, 30)), "r" * int(rng.integers(1, 20))) for _ in range(8)]
    pairs[0] = ("x" * 31, "y")  # one counted target
    ex = encode_examples(pairs, ByteTokenizer(), spec.seq_len, spec.vocab)
    ex.inputs[:] = rng.integers(0, 256, size=ex.inputs.shape)  # random tokens, same masks
    if arch == "gpt":
        ref = ReferenceGPT(spec, seed=2)
        model = GPT(spec, ctx, Options(micro_batches=2))
        load_from_reference(model, ref.state_dict())
    else:
        from backend.models.llama import Llama, ReferenceLlama, gather_hf, load_hf
        ref = ReferenceLlama(spec, seed=2)
        model = Llama(spec, ctx, Options(micro_batches=2))
        load_hf(model, ref.state_dict().__getitem__)
    full = ExampleLoader(ex, 8, 0, 1).batches(0)[0]
    ref_loss = ref(full.inputs, full.targets)
    ref_loss.backward()
    mine = ExampleLoader(ex, 8, ctx.batch_shard, ctx.batch_shards, micro_batches=2).batches(0)
    opt = make_optimizer(model, lr=0.0)  # the step leaves weights and gradients as they are
    loss = train_step(model, opt, [(b.inputs, b.targets) for b in mine], max_norm=1e9)
    grads = gather_full_grads(model) if arch == "gpt" else gather_hf(model, "grad")
    rel = max(float((grads[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-12)) for n, p in ref.named_parameters())
    counts = [int((b.targets >= 0).sum()) for b in mine]
    return {"loss": loss, "ref": float(ref_loss), "rel": rel, "counts": counts}


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_response_only_loss_and_gradients_on_a_4d_grid_equal_one_process(arch):
    pytest.importorskip("torch")
    from backend_helpers import run_on_grid

    results = run_on_grid("1x1x2x2", _masked_step, arch)
    for rank, r in enumerate(results):
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5), rank
        assert r["rel"] < 1e-4, rank
    per_shard = {tuple(r["counts"]) for r in results}
    assert len(per_shard) > 1  # the shards count different numbers of tokens


def test_a_tokenizer_json_next_to_the_weights_is_used(tmp_path):
    """A model directory's tokenizer.json (read offline with `tokenizers`) encodes the examples and
    its end-of-text id closes each response; without one, bytes."""
    tokenizers = pytest.importorskip("tokenizers")
    from backend.training.finetune import HFTokenizer, tokenizer_for

    vocab = {c: i for i, c in enumerate(["<eos>", "[UNK]"] + list("0123456789+=; "))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.save(str(tmp_path / "tokenizer.json"))
    chosen = tokenizer_for(str(tmp_path), eos=0)
    assert isinstance(chosen, HFTokenizer) and isinstance(tokenizer_for(str(tmp_path / "none")), ByteTokenizer)
    ex = encode_examples([("12+3=", "15;")], chosen, seq_len=12, vocab=16)
    assert list(ex.inputs[0, :8]) == [3, 4, 12, 5, 13, 3, 7, 14]  # 1 2 + 3 = 1 5 ;
    assert [int(t) for t in ex.targets[0] if t != IGNORE] == [3, 7, 14, 0]  # the response, then <eos>
