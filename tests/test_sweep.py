"""`twin sweep`: a sweep file's points (the product of its axes, overrides by dotted path), their rows in a
CSV, resume after a stop, errors recorded per point, goodput under failures, the same rows on a Dask
LocalCluster of 2 workers as serially, and the page in headless Chromium."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from twin.cli.main import app
from twin.sweep.goodput import under_failures
from twin.sweep.page import pareto
from twin.sweep.results import read_rows
from twin.sweep.run import run_sweep
from twin.sweep.spec import load_sweep

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()

# 12 points: 2 systems x 2 NIC rates x 3 GPU counts (the last too many for either: an error per system)
TWELVE = """
name = "twelve"
systems = ["frontier", "alps"]
models = ["gpt-1b"]
gpus = [16, 32, 1000000]
batches = [32]
simulate_top = 1
[overrides]
"node.nic_bandwidth" = [25e9, 50e9]
[train]
tokens = 1e10
checkpoint_every_min = 60
checkpoint_write_min = 1
restart_min = 10
"""


def _sweep(tmp_path: Path, text: str = TWELVE, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in read_rows(path)[1]]


def test_a_sweep_is_the_product_of_its_axes(tmp_path):
    s = load_sweep(_sweep(tmp_path))
    points = s.points()
    assert len(points) == s.size() == 12
    assert len({p.key for p in points}) == 12
    assert points[0].system == "frontier" and points[-1].system == "alps"
    assert dict(points[0].overrides) == {"node.nic_bandwidth": 25e9}
    assert s.axis_columns() == ["system", "node.nic_bandwidth", "model", "gpus", "batch", "seq_len", "grid_asked"]
    assert s.varied() == ["system", "node.nic_bandwidth", "gpus"]


def test_the_serial_run_records_rows_errors_and_time_to_train(tmp_path, fresh_caches):
    path = _sweep(tmp_path)
    run = run_sweep(load_sweep(path), tmp_path / "s.csv", serial=True)
    assert (run.total, run.computed, run.failed, run.interrupted) == (12, 12, 4, False)
    rows = _rows(tmp_path / "s.csv")
    assert len(rows) == 12
    bad = [r for r in rows if r["status"] == "error"]
    assert {r["gpus"] for r in bad} == {"1000000"}
    assert all("out of range" in r["error"] and "\n" not in r["error"] for r in bad)
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        days = 1e10 / float(r["tokens_per_s"]) / 86400
        assert float(r["train_days"]) == pytest.approx(days)
        assert float(r["gpu_hours"]) == pytest.approx(days * 24 * int(r["gpus"]))
        assert 0 < float(r["goodput"]) < 1 and float(r["wall_days"]) > float(r["train_days"])
        assert float(r["node_mtbf_h"]) == 6335
    # twice the NIC rate never makes a point slower
    by = {(r["system"], r["gpus"], float(r["node.nic_bandwidth"])): float(r["iteration_s"]) for r in ok}
    for (system, gpus, nic), t in by.items():
        if nic == 25e9:
            assert by[(system, gpus, 50e9)] <= t * (1 + 1e-9)


def test_a_dask_local_cluster_of_two_workers_gives_the_serial_rows(tmp_path):
    pytest.importorskip("distributed")
    path = _sweep(tmp_path)
    serial = run_sweep(load_sweep(path), tmp_path / "serial.csv", serial=True)
    dask = run_sweep(load_sweep(path), tmp_path / "dask.csv", workers=2)
    assert dask.engine.startswith("Dask, 2 local worker") and dask.computed == serial.computed == 12
    assert _rows(tmp_path / "dask.csv") == _rows(tmp_path / "serial.csv")


def test_a_stopped_sweep_resumes_without_recomputing_finished_points(tmp_path):
    path = _sweep(tmp_path)
    out = tmp_path / "s.csv"
    seen = []

    def stop_after_five(row):
        seen.append(row["key"])
        if len(seen) == 5:
            raise KeyboardInterrupt

    run = run_sweep(load_sweep(path), out, serial=True, on_row=stop_after_five)
    assert run.interrupted and run.computed == 5
    assert [r["key"] for r in _rows(out)] == seen
    with open(out, "a") as f:  # a run killed in the middle of a line leaves half of it
        f.write("deadbeef,frontier,2.5e10")
    again = []
    run = run_sweep(load_sweep(path), out, serial=True, on_row=lambda row: again.append(row["key"]))
    assert (run.skipped, run.computed, run.interrupted) == (5, 7, False)
    assert not set(again) & set(seen)
    keys = [p.key for p in load_sweep(path).points()]
    assert [r["key"] for r in _rows(out)] == keys  # the finished file is in the sweep's order


def test_a_killed_sweep_process_resumes(tmp_path):
    """`twin sweep` killed (SIGKILL) once some rows are in: the rerun computes only the others."""
    path = _sweep(tmp_path)
    out = tmp_path / "s.csv"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "twin.cli", "sweep", str(path), "--out", str(out), "--serial", "--quiet"]
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        if out.is_file() and len(out.read_text().splitlines()) >= 3:  # the header and two rows
            break
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    kept = {r["key"] for r in _rows(out)}
    assert len(kept) >= 2
    again = []
    run = run_sweep(load_sweep(path), out, serial=True, on_row=lambda row: again.append(row["key"]))
    assert run.skipped == len(kept) and run.computed == 12 - len(kept) and not set(again) & kept


def test_overrides_reach_the_system_and_the_profile(tmp_path):
    from twin.sweep.point import _study
    text = TWELVE.replace('"node.nic_bandwidth" = [25e9, 50e9]',
                          '"collectives.inter_node_channel_efficiency" = [0.5]\n"profile.gemm_flops" = [1e14]\n'
                          '"network.link_bandwidth" = [3e10]')
    p = load_sweep(_sweep(tmp_path, text)).points()[0]
    study = _study(p)
    assert study.system.collectives.inter_node_channel_efficiency == 0.5
    assert study.system.dragonfly.link_bandwidth == 3e10
    assert study.profile.gemm_flops == 1e14 and study.kernels.profile.gemm_flops == 1e14


@pytest.mark.parametrize("change, says", [
    (("gpus = [16, 32, 1000000]", "gpus = [16, -1]"), "gpus[1] must be an integer"),
    (("models = [\"gpt-1b\"]", "models = \"gpt-1b\""), "models must be a list"),
    (("[overrides]", "colour = [1]\n[overrides]"), "colour is not a known key"),
    (('"node.nic_bandwidth"', '"node.nic_speed"'), "'node.nic_speed' is not a parameter a sweep can set"),
    (("[25e9, 50e9]", "[25e9, -1]"), "node.nic_bandwidth must be"),
    (("[25e9, 50e9]", "25e9"), "overrides.node.nic_bandwidth must be a list"),
    (("restart_min = 10", ""), "go together"),
    (("gpus = [16, 32, 1000000]", "gpus = [16, 16]"), "gpus lists a value twice"),
    (("[25e9, 50e9]", "[25e9, 25e9]"), "overrides.node.nic_bandwidth lists a value twice"),
    (("tokens = 1e10", "tokens = 0"), "train.tokens must be"),
    (("tokens = 1e10", "tokens = 1e10\ntokens = 2"), "malformed sweep file"),
])
def test_a_bad_sweep_file_is_one_line_and_exit_2(tmp_path, monkeypatch, change, says):
    monkeypatch.chdir(tmp_path)
    path = _sweep(tmp_path, TWELVE.replace(*change))
    r = runner.invoke(app, ["sweep", str(path), "--serial", "--quiet"])
    assert r.exit_code == 2, r.output
    assert says in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "s.csv").exists()


def test_a_results_file_of_another_sweep_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the results go to the current folder by default
    (tmp_path / "s.csv").write_text("key,system,status\n")
    r = runner.invoke(app, ["sweep", str(_sweep(tmp_path)), "--serial"])
    assert r.exit_code == 2 and "other columns" in r.output
    assert (tmp_path / "s.csv").read_text() == "key,system,status\n"


def test_goodput_follows_daly():
    g = under_failures(86400.0, nodes=100, node_mtbf_h=1000.0, every_s=3600.0, write_s=60.0, restart_s=600.0)
    m = 1000 * 3600 / 100
    assert g.job_mtbf_h == pytest.approx(10.0)
    assert g.goodput == pytest.approx(3600 / (m * math.exp(600 / m) * math.expm1(3660 / m)))
    assert g.wall_s == pytest.approx(86400 / g.goodput) and g.failures == pytest.approx(g.wall_s / m)
    assert under_failures(1.0, 1, 1e9, 60.0, 0.0, 0.0).goodput == pytest.approx(1.0, abs=1e-6)
    # too frequent failures: nothing finishes
    assert under_failures(1.0, 10_000, 1.0, 3600.0, 0.0, 3600.0).goodput == 0.0


def test_the_pareto_front():
    pts = [(1, 5), (2, 3), (3, 4), (4, 1), (2, 2)]
    assert pareto(pts) == [0, 4, 3]


def test_the_command_prints_the_best_and_writes_the_page(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from browser import SHOTS, assert_drew, close_browser, render_page

    path = _sweep(tmp_path)
    page = tmp_path / "sweep.html"
    r = runner.invoke(app, ["sweep", str(path), "--serial", "--html", str(page), "--top", "3"])
    assert r.exit_code == 0, r.output
    assert "12 points: 8 predicted, 4 failed" in r.output and "out of range" in r.output
    assert (tmp_path / "s.csv").is_file() and "Plotly.newPlot" in page.read_text()
    r = runner.invoke(app, ["sweep", str(path), "--serial", "--quiet"])
    assert "none computed now, 12 already in" in " ".join(r.output.split())
    try:
        result = render_page(page, SHOTS / "sweep.png")
        assert_drew(result, {"plot-pareto", "plot-heatmap"})
    finally:
        close_browser()


def test_the_progress_bar_counts_done_and_failed_points(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    import twin.present.progress
    shown = io.StringIO()
    monkeypatch.setattr(twin.present.progress, "quiet_default", lambda json_out, quiet: json_out or quiet)
    monkeypatch.setattr(twin.present.progress, "SHOW_AFTER_S", 0)
    monkeypatch.setattr(twin.present.progress, "Console",
                        lambda **kw: Console(file=shown, force_terminal=True, width=120))
    r = runner.invoke(app, ["sweep", str(_sweep(tmp_path)), "--serial", "--out", str(tmp_path / "s.csv")])
    assert r.exit_code == 0, r.output
    text = shown.getvalue()
    assert "8 done, 4 failed" in text and "left ~" in text, text


def test_without_dask_the_sweep_runs_in_this_process_and_says_so(tmp_path, monkeypatch):
    import twin.sweep.run
    monkeypatch.setattr(twin.sweep.run, "have_dask", lambda: False)
    said = []
    run = run_sweep(load_sweep(_sweep(tmp_path, TWELVE.replace("gpus = [16, 32, 1000000]", "gpus = [16]"))),
                    tmp_path / "s.csv", say=said.append)
    assert run.engine == "this process" and run.computed == 4
    assert any("Dask is not installed" in line and ".[sweep]" in line for line in said), said


def test_a_running_scheduler_takes_the_points(tmp_path):
    """--scheduler ADDRESS: here a scheduler with one in-process worker, started by the test."""
    pytest.importorskip("distributed")
    from distributed import LocalCluster
    path = _sweep(tmp_path, TWELVE.replace("gpus = [16, 32, 1000000]", "gpus = [16]"))
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        r = runner.invoke(app, ["sweep", str(path), "--scheduler", cluster.scheduler_address, "--quiet",
                                "--out", str(tmp_path / "s.csv")])
        address = cluster.scheduler_address
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "4 points: 4 predicted, 0 failed" in text and f"the Dask scheduler at {address}" in text


def test_slurm_needs_sbatch(tmp_path, monkeypatch):
    pytest.importorskip("dask_jobqueue")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on it
    r = runner.invoke(app, ["sweep", str(_sweep(tmp_path)), "--slurm", "--quiet", "--out", str(tmp_path / "s.csv")])
    assert r.exit_code == 2 and "no sbatch here" in r.output, r.output
