"""The command lines: help, `twin program`, and one clear line with exit 2 for bad input."""

import json

import pytest
from typer.testing import CliRunner

from backend.cli.main import app as backend_app
from twin.cli.main import app

runner = CliRunner()


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("program", "simulate", "search", "systems", "topology", "models"):
        assert cmd in r.output
    r = runner.invoke(backend_app, ["--help"])
    assert r.exit_code == 0 and "run" in r.output and "replay" in r.output


def test_models_lists_gpt_family():
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0 and "gpt-320b" in r.output and "gpt-tiny" in r.output


def test_program_summary_and_json(tmp_path):
    out = tmp_path / "prog.json"
    r = runner.invoke(app, ["program", "--model", "gpt-5b", "--grid", "2x2x2x64", "--gpus", "512",
                            "--json-out", str(out)])
    assert r.exit_code == 0, r.output
    assert "all_gather" in r.output and "memory per GPU" in r.output
    data = json.loads(out.read_text())
    assert data["summary"]["gpus"] == 512 and len(data["ops"]) == data["summary"]["ops"]


@pytest.mark.parametrize("args,msg", [
    (["--model", "gpt-7t"], "unknown model"),
    (["--grid", "2x2x2"], "not of the form"),
    (["--grid", "2x2x2x64", "--gpus", "256"], "512 GPUs but --gpus is 256"),
    (["--grid", "3x1x1x1"], "not divisible by G_x=3"),
    (["--grid", "1x64x1x1"], "heads"),
    (["--grid", "1x1x2x2", "--batch", "6"], "not divisible by G_z*G_data=4"),
    (["--grid", "1x1x2x2", "--micro-batches", "3"], "micro-batches"),
    (["--model", "gpt-320b", "--grid", "2x2x2x64", "--hbm-gib", "64"], "does not fit"),
    (["--model", "/nonexistent/model.toml"], "model file /nonexistent/model.toml does not exist"),
])
def test_bad_input_one_line_exit_2(args, msg):
    r = runner.invoke(app, ["program", *args])
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert msg in err and len(err.splitlines()) == 1 and "Traceback" not in r.output


def test_malformed_model_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("layers = [\n")
    r = runner.invoke(app, ["program", "--model", str(p)])
    assert r.exit_code == 2 and "malformed model file" in r.stderr


def test_json_file_not_clobbered_on_error(tmp_path):
    out = tmp_path / "prog.json"
    out.write_text("keep me")
    r = runner.invoke(app, ["program", "--grid", "3x1x1x1", "--json-out", str(out)])
    assert r.exit_code == 2 and out.read_text() == "keep me"


def test_twin_never_imports_torch_or_backend():
    """A user on a laptop simulates Frontier with the twin alone: no torch, no backend."""
    import subprocess
    import sys
    code = ("import sys, twin.cli.main, twin.predict.simulate, twin.predict.search, twin.engine.engine, twin.costs.collectives, twin.present.plots, "
            "topologies.network, topologies.routing; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'backend', 'calibration')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
