"""Generation from checkpoints of any grid (equal to a single-process decode), the KV cache, and the
memorization metrics (ROUGE-L on known cases, exact match)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backend.models.generate import Weights, forward, generate, load_weights  # noqa: E402
from backend.studies.memorization import (check_lengths, lcs_length, load_sequences, measure, rouge_l,  # noqa: E402
                                  score)
from backend.models.reference import ReferenceGPT  # noqa: E402
from topologies.common import TwinError  # noqa: E402
from twin.program.model import load_model  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny decodes: on a loaded 2-core machine two OpenMP threads made them 1,000x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_rouge_l_known_cases():
    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l([1, 2, 3], [4, 5, 6]) == 0.0
    assert rouge_l([], [1]) == 0.0 and rouge_l([1], []) == 0.0
    # "the cat sat on the mat" vs "the cat on the mat": LCS 5, P = 5/6, R = 1 -> F1 = 10/11
    cand, ref = "the cat sat on the mat".split(), "the cat on the mat".split()
    assert lcs_length(cand, ref) == 5 and rouge_l(cand, ref) == pytest.approx(10 / 11)
    # Lin (2004): S1 "police killed the gunman", S2 "police kill the gunman" (LCS 3: 3/4),
    # S3 "the gunman kill police" (LCS 2: "the gunman": 1/2)
    s1 = "police killed the gunman".split()
    assert rouge_l("police kill the gunman".split(), s1) == pytest.approx(0.75)
    assert rouge_l("the gunman kill police".split(), s1) == pytest.approx(0.5)
    assert lcs_length("ABCBDAB", "BDCABA") == 4  # CLRS's example
    assert rouge_l([1, 2], [1, 2, 3, 4]) == pytest.approx(2 * 1 * 0.5 / 1.5)


def test_score_and_lengths():
    truth = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    rep = score(np.array([[1, 2, 3, 4], [5, 6, 0, 8]]), truth, prefix=3)
    assert [s.exact for s in rep.sequences] == [True, False] and rep.exact_match == 0.5
    assert rep.sequences[1].matched_prefix == 2 and rep.sequences[1].rouge_l == pytest.approx(0.75)
    assert rep.rouge_l == pytest.approx(0.875) and "exact match 50.0%" in rep.table()
    assert json.loads(json.dumps(rep.to_dict()))["per_sequence"][0]["exact"] is True
    assert check_lengths(64, 32, None) == 32
    for prefix, suffix in ((64, None), (80, None), (0, None), (32, 40), (32, 0)):
        with pytest.raises(TwinError):
            check_lengths(64, prefix, suffix)


def _weights(seed: int = 3) -> tuple[Weights, ReferenceGPT]:
    spec = load_model("gpt-tiny")
    ref = ReferenceGPT(spec, seed=seed)
    return Weights(spec, {k: v.detach().clone() for k, v in ref.state_dict().items()}), ref


def test_decoder_is_the_reference_model_and_the_cache_is_exact():
    w, ref = _weights()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (3, 32), generator=g)
    targets = torch.roll(tokens, -1, 1)
    logits = forward(w, tokens)
    ours = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    assert float(ours) == pytest.approx(float(ref(tokens, targets).detach()), rel=1e-6)
    # the cache: the prompt in one piece, then token by token, equals the whole sequence at once
    cache = []
    parts = [forward(w, tokens[:, :10], cache)] + [forward(w, tokens[:, i:i + 1], cache) for i in range(10, 32)]
    assert torch.allclose(torch.cat(parts, 1), logits, atol=1e-5)
    prompt = tokens[:, :8]
    greedy = generate(w, prompt, 24)
    assert torch.equal(greedy, generate(w, prompt, 24, use_cache=False))
    assert torch.equal(generate(w, prompt, 24, temperature=1.0, top_k=1), greedy)
    a, b = generate(w, prompt, 24, temperature=1.0, seed=5), generate(w, prompt, 24, temperature=1.0, seed=5)
    assert torch.equal(a, b) and not torch.equal(a, greedy)
    assert generate(w, prompt[0], 4).shape == (4,)
    with pytest.raises(TwinError, match="exceeds the context"):
        generate(w, prompt, 25)


def _save_sharded(ctx, ref_state: dict, ckpt_dir: str) -> None:
    from backend.runtime import checkpoint
    from backend.models.gpt import GPT
    from backend.models.reference import load_from_reference
    from twin.program.program import Options

    spec = load_model("gpt-tiny")
    model = GPT(spec, ctx, Options())
    load_from_reference(model, ref_state)
    meta = checkpoint.make_meta(7, ctx.grid, spec)
    checkpoint.save(ckpt_dir, 7, ctx.rank, {"step": 7, "model": model.state_dict()}, meta)


def test_checkpoint_of_a_4d_grid_decodes_like_one_process(tmp_path, monkeypatch):
    from backend_helpers import run_on_grid

    w, _ = _weights(seed=9)
    state = {k: v.clone() for k, v in w.tensors.items()}
    run_on_grid("2x2x2x1", _save_sharded, state, str(tmp_path / "ckpt"))
    got = load_weights(tmp_path / "ckpt")
    assert got.grid == "2x2x2x1" and got.step == 7 and set(got.tensors) == set(state)
    for k, v in state.items():  # the reference pads the vocabulary to 128 rows, as G_y = 2 does
        assert torch.equal(got.tensors[k], v), k
    prompt = torch.randint(0, 256, (4, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(generate(got, prompt, 20), generate(w, prompt, 20))
    seqs = torch.cat([prompt, generate(w, prompt, 20)], 1).numpy()
    rep = measure(got, seqs, prefix=6)  # its own greedy continuations: memorized by definition
    assert rep.exact_match == 1.0 and rep.rouge_l == 1.0
    # bad input: another model, a missing rank, a tensor of the wrong shape
    with pytest.raises(TwinError, match="gpt-small"):
        load_weights(tmp_path / "ckpt", model="gpt-small")
    step = tmp_path / "ckpt" / "step_00000007"
    (step / "rank_00005.pt").unlink()
    with pytest.raises(TwinError, match="no file for rank 5"):
        load_weights(step)
    bad = torch.load(step / "rank_00001.pt", weights_only=False)
    bad["model"]["emb.wte"] = bad["model"]["emb.wte"][:3]
    torch.save(bad, step / "rank_00001.pt")
    with pytest.raises(TwinError, match="checksum"):  # read through the checkpoint's API: verified
        load_weights(step)
    with pytest.raises(TwinError, match="no checkpoint"):
        load_weights(tmp_path)
    # a checkpoint whose tensors are not the model's (say, written by another version of the code)
    from backend.runtime import checkpoint
    good = tmp_path / "ckpt2"
    run_on_grid("1x1x1x1", _save_sharded, state, str(good))
    real = checkpoint.read_rank

    def other_shapes(path, rank, map_location="cpu"):
        out = real(path, rank, map_location)
        out["model"]["emb.wte"] = out["model"]["emb.wte"][:3]
        return out
    monkeypatch.setattr(checkpoint, "read_rank", other_shapes)
    with pytest.raises(TwinError, match="does not match its model"):
        load_weights(good)


def test_sequence_files(tmp_path):
    np.save(tmp_path / "s.npy", np.arange(40).reshape(4, 10))
    assert load_sequences(tmp_path / "s.npy", 0, 256).shape == (4, 10)
    (tmp_path / "t.txt").write_bytes(b"abcdefghij" * 3)
    assert load_sequences(tmp_path / "t.txt", 8, 256).shape == (3, 8)
    np.save(tmp_path / "big.npy", np.full((2, 5), 300))
    for path, match in (("big.npy", "token ids"), ("nope.npy", "does not exist")):
        with pytest.raises(TwinError, match=match):
            load_sequences(tmp_path / path, 8, 256)


def test_a_png_without_a_browser_is_one_line_and_the_html_chart_stays(tmp_path, monkeypatch):
    """`--png` on a machine with no Chromium (none at CHROMIUM, none of playwright's own): render_png
    says what to install instead of playwright's traceback, and the study's chart is still written."""
    pytest.importorskip("playwright")
    pytest.importorskip("plotly")
    import playwright.sync_api as api
    from backend.studies.study import NoBrowser, chart

    class Chromium:
        def launch(self, **_):
            raise api.Error("BrowserType.launch: Executable doesn't exist")

    class Session:
        chromium = Chromium()

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

    monkeypatch.setattr(api, "sync_playwright", lambda: Session())
    monkeypatch.setenv("CHROMIUM", str(tmp_path / "no-chromium"))
    result = {"config": {"canaries": 1, "texts": 1, "seq_len": 8, "prefix": 4, "suffix": 4, "goldfish_k": 4,
                         "goldfish_h": 13, "losses": ["standard"]},
              "records": [{"loss": "standard", "epoch": 1, "exact_match": 0.0, "rouge_l": 0.5, "held_out_loss": 3.0}],
              "wall_s": 1.0, "cores": 2}
    with pytest.raises(NoBrowser, match="apt-get install chromium"):
        chart(result, tmp_path / "chart.html", tmp_path / "chart.png")
    assert (tmp_path / "chart.html").stat().st_size > 1000 and not (tmp_path / "chart.png").exists()
