"""The twin knows what a checkpoint costs: its bytes at the study's scale and the time to write and to
read it on the system file's [filesystem] (with its source), "no file-system figures" without one, and
the sweep's goodput under failures takes that write time when the sweep file gives none."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from topologies.common import InputError
from topologies.system import load_system
from twin.cli.main import app
from twin.predict.ckptcost import BYTES_PER_PARAMETER, checkpoint_cost
from twin.program.model import load_model
from twin.sweep.results import read_rows
from twin.sweep.run import run_sweep
from twin.sweep.spec import load_sweep

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def test_a_checkpoint_is_twelve_bytes_a_parameter_over_the_slower_of_file_system_and_nics():
    frontier, model = load_system("frontier"), load_model("gpt-5b")
    fs = frontier.filesystem
    assert fs is not None and "Orion" in fs.source and fs.write_bandwidth == 4.6e12
    total = model.parameters(model.padded_vocab(2)) * BYTES_PER_PARAMETER
    small = checkpoint_cost(frontier, model, 64, grid_y=2)  # 8 nodes: their NICs are the limit
    nics = 8 * frontier.nics_per_node * frontier.nic_bandwidth
    assert small.bytes_total == total and small.bytes_per_gpu == pytest.approx(total / 64)
    assert small.write_s == pytest.approx(total / min(4.6e12, nics))
    big = checkpoint_cost(frontier, model, 32768, grid_y=2)  # 4,096 nodes: the file system is the limit
    assert big.write_s == pytest.approx(total / 4.6e12) and big.read_s == pytest.approx(total / 5.5e12)
    none = checkpoint_cost(load_system("alps"), model, 64)
    assert none.write_s is None and none.read_s is None and none.bytes_total > 0


def test_a_filesystem_table_needs_a_bandwidth_and_a_source(tmp_path):
    text = (ROOT / "topologies" / "systems" / "frontier.toml").read_text()
    body = text[:text.index("[filesystem]")]
    bad = tmp_path / "bad.toml"
    bad.write_text(body + '[filesystem]\nsource = "assumed"\n')
    with pytest.raises(InputError, match="at least one of write_bandwidth"):
        load_system(str(bad))
    bad.write_text(body + "[filesystem]\nwrite_bandwidth = 1e12\n")
    with pytest.raises(InputError, match="source"):
        load_system(str(bad))
    good = tmp_path / "good.toml"
    good.write_text(body + '[filesystem]\nwrite_bandwidth_per_node = 2e9\nsource = "assumed: a test"\n')
    fs = load_system(str(good)).filesystem
    assert fs.rate("write", 10) == 2e10 and fs.rate("read", 10) == 0.0


def test_simulate_reports_the_checkpoint_time_or_says_it_has_no_figures():
    args = ["simulate", "--model", "gpt-1b", "--gpus", "16", "--batch", "16", "--grid", "2x2x2x2"]
    r = runner.invoke(app, args + ["--system", "frontier"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert re.search(r"checkpoint: [\d.]+ GiB .* write [\d.e+-]+ s, read [\d.e+-]+ s on Orion", text), text
    r = runner.invoke(app, args + ["--system", "alps", "--json"])
    assert r.exit_code == 0, r.output
    import json
    ck = json.loads(r.output)["checkpoint"]
    assert ck["write_s"] is None and ck["bytes_total"] > 0
    r = runner.invoke(app, args + ["--system", "alps"])
    assert "no file-system figures for alps" in " ".join(r.output.split())


def test_the_sweep_takes_the_write_time_from_the_file_system_when_it_gives_none(tmp_path, fresh_caches):
    text = """
systems = ["frontier", "alps"]
models = ["gpt-1b"]
gpus = [16]
batches = [32]
simulate_top = 1
[train]
tokens = 1e10
checkpoint_every_min = 60
restart_min = 10
"""
    path = tmp_path / "s.toml"
    path.write_text(text)
    run_sweep(load_sweep(path), tmp_path / "s.csv", serial=True)
    rows = {r["system"]: r for r in read_rows(tmp_path / "s.csv")[1]}
    spec = load_model("gpt-1b")
    grid_y = int(rows["frontier"]["grid"].split("x")[1])
    want = checkpoint_cost(load_system("frontier"), spec, 16, grid_y).write_s
    assert float(rows["frontier"]["checkpoint_write_s"]) == pytest.approx(want) and want > 0
    assert float(rows["alps"]["checkpoint_write_s"]) == 0.0
    assert math.isfinite(float(rows["frontier"]["goodput"]))
