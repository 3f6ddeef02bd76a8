"""Model specs: shipped files load, counts follow the formulas, bad files fail clearly."""

import pytest

from twin import TwinError, list_models, load_model


def test_shipped_models_load():
    names = list_models()
    for n in ["gpt-5b", "gpt-10b", "gpt-20b", "gpt-40b", "gpt-60b", "gpt-80b", "gpt-160b",
              "gpt-320b", "gpt-640b", "gpt-tiny", "gpt-small", "gpt-1b"]:
        assert n in names
        assert load_model(n).name == n


@pytest.mark.parametrize("name,billions", [("gpt-5b", 5), ("gpt-20b", 20), ("gpt-40b", 40),
                                           ("gpt-80b", 80), ("gpt-320b", 320), ("gpt-640b", 640)])
def test_parameter_count_close_to_name(name, billions):
    m = load_model(name)
    approx = 12 * m.layers * m.hidden**2 + m.padded_vocab() * m.hidden  # the usual 12 l h^2 + V h
    assert abs(m.parameters() - approx) / approx < 0.01
    assert 0.8 * billions < m.parameters() / 1e9 < 1.3 * billions


def test_reference_flops_formula():
    m = load_model("gpt-5b")
    B, s, l, h, V = 2048, 2048, 24, 4096, m.padded_vocab()
    expected = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert m.reference_flops() == pytest.approx(expected, rel=1e-12)
    assert m.reference_flops(recompute=False) < expected


def test_padded_vocab():
    m = load_model("gpt-5b")
    assert m.padded_vocab() == 50304
    assert m.padded_vocab(256) % 256 == 0 and m.padded_vocab(256) >= 50257


def test_user_model_file(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('layers = 2\nhidden = 128\nheads = 4\nvocab = 256\nseq_len = 64\nglobal_batch = 8\n')
    m = load_model(str(p))
    assert m.name == "mine" and m.layers == 2


@pytest.mark.parametrize("text,msg", [
    ("layers = 2\nhidden = 128\n", "heads is missing"),
    ("layers = [", "malformed"),
    ("layers = 2\nhidden = 130\nheads = 4\nvocab = 256\nseq_len = 64\nglobal_batch = 8\n", "not divisible"),
    ("layers = 2\nhidden = 128\nheads = 4\nvocab = 256\nseq_len = 64\nglobal_batch = 8\ncolour = 1\n", "colour is not a known key"),
    ("layers = -2\nhidden = 128\nheads = 4\nvocab = 256\nseq_len = 64\nglobal_batch = 8\n", "layers must be an integer in"),
])
def test_bad_model_file(tmp_path, text, msg):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(TwinError, match=msg):
        load_model(str(p))


def test_unknown_model():
    with pytest.raises(TwinError, match="unknown model"):
        load_model("gpt-7t")
