"""The memorization study's data and checks, a tiny study end to end, and the memorization commands'
bad input (one clear line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from backend.cli.main import app
from backend.studies.study import StudyConfig, check, lexicon, pseudo_text, sequences
from topologies.common import TwinError


def test_pseudo_text_is_a_seeded_language():
    words = lexicon()
    assert len(set(words)) == len(words) == 400
    a, b = pseudo_text(2000, 1), pseudo_text(2000, 2)
    assert a == pseudo_text(2000, 1) and a != b and len(a) == 2000
    assert set(a) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,.")
    seen = {w.strip(",.").lower() for w in a.split()[:-1]}
    assert seen <= set(words)
    data = sequences(StudyConfig(canaries=4, texts=6, held_out=8, seq_len=20))
    assert data["canary"].shape == (4, 20) and data["text"].shape == (6, 20) and data["held_out"].shape == (8, 20)
    assert not np.isin(data["held_out"][:, :10].tolist(), data["text"][:, :10].tolist()).all()


@pytest.mark.parametrize("change,match", [
    ({"goldfish_k": 0}, "goldfish-k"), ({"prefix": 64}, "prefix"), ({"suffix": 40}, "suffix"),
    ({"batch": 5}, "batch"), ({"epochs": 0}, "epochs"), ({"heads": 3}, "heads"), ({"threads": -1}, "threads"),
])
def test_study_checks(change, match):
    with pytest.raises(TwinError, match=match):
        check(StudyConfig(**change))


def _bad(*args: str) -> str:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_memorization_commands_refuse_bad_input(tmp_path):
    assert "goldfish-k" in _bad("memorization-study", "--goldfish-k", "0")
    assert "goldfish-k" in _bad("run", "--goldfish-k", "0")
    assert "prefix" in _bad("memorization-study", "--prefix", "80")
    assert "does not exist" in _bad("generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "a")
    assert "exactly one" in _bad("generate", "--checkpoint", str(tmp_path))


def test_tiny_study_end_to_end(tmp_path):
    """Two epochs of the study on a tiny configuration: records for both losses, a chart, and the
    memorization command on a checkpoint of the same kind."""
    pytest.importorskip("torch")
    out = tmp_path / "study"
    r = subprocess.run([sys.executable, "-m", "backend.cli", "memorization-study", "--epochs", "2",
                        "--eval-every", "1", "--canaries", "4", "--texts", "4", "--seq-len", "24", "--prefix", "12",
                        "--suffix", "12", "--batch", "4", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    result = json.loads((out / "study.json").read_text())
    assert [(x["loss"], x["epoch"]) for x in result["records"]] == [
        ("standard", 1), ("standard", 2), ("goldfish", 1), ("goldfish", 2)]
    for x in result["records"]:
        assert 0 <= x["exact_match"] <= 1 and 0 <= x["rouge_l"] <= 1 and x["held_out_loss"] > 0
    assert (out / "memorization.html").is_file() and "goldfish" in r.stdout


def test_memorization_command_on_a_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    from backend.runtime import checkpoint
    from backend.runtime.dist import ParallelContext
    from backend.models.gpt import GPT
    from twin.program.grid import Grid
    from twin.program.model import load_model

    spec, grid = load_model("gpt-tiny"), Grid.parse("1x1x1x1")
    model = GPT(spec, ParallelContext(grid, 0, torch.device("cpu"), "gloo", {}), seed=3)
    checkpoint.save(tmp_path / "ckpt", 5, 0, {"model": model.state_dict()}, checkpoint.make_meta(5, grid, spec))
    np.save(tmp_path / "seqs.npy", np.random.default_rng(0).integers(0, 256, (3, 32)))
    r = CliRunner().invoke(app, ["memorization", "--checkpoint", str(tmp_path / "ckpt"), "--data",
                                 str(tmp_path / "seqs.npy"), "--prefix", "16", "--out", str(tmp_path / "m.json")])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "m.json").read_text())
    assert report["sequences"] == 3 and report["suffix"] == 16 and len(report["per_sequence"]) == 3
    assert "overall: 3 sequences" in r.output
    assert "not shorter" in _bad("memorization", "--checkpoint", str(tmp_path / "ckpt"), "--data",
                                 str(tmp_path / "seqs.npy"), "--prefix", "32")
    assert "gpt-small" in _bad("memorization", "--checkpoint", str(tmp_path / "ckpt"), "--data",
                               str(tmp_path / "seqs.npy"), "--model", "gpt-small")
    r = CliRunner().invoke(app, ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "ab", "-n", "5",
                                 "--json"])
    assert r.exit_code == 0 and len(json.loads(r.output)["ids"]) == 5
