"""Without PyTorch (the twin-only install), every `backend` command ends in one line saying how to
install it, exit code 2, no traceback."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner


@pytest.mark.parametrize("command", [["run"], ["bench", "--grid", "1x1x2x1"], ["replay"], ["generate", "--checkpoint", "c"]])
def test_backend_without_torch_is_one_line(command, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    from backend.cli.main import app
    r = CliRunner().invoke(app, command)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    line, = r.stderr.strip().splitlines()
    assert line.startswith("error: the backend needs PyTorch") and "pip install torch" in line, line
