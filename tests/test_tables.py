"""Every table the `twin` commands print reads in an 80-column terminal: no line is longer, no cell is
cut with an ellipsis, and the values a reader looks for (grids, system and model names) are printed
whole. (The backend prints lines, not tables: its step line is checked in test_backend_train.py.)"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys

import pytest
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typer.testing import CliRunner

import twin.cli.common
from twin.cli.main import app
from twin.present.tables import human_bytes, human_flops, table

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


@pytest.fixture()
def run80(monkeypatch):
    """Run a twin command as in a terminal 80 columns wide; returns its stdout after checking it."""
    monkeypatch.setattr(twin.cli.common.console, "width", 80)

    def run(*args: str) -> str:
        r = CliRunner().invoke(app, list(args))
        assert r.exit_code == 0, (args, r.output)
        out = r.stdout
        too_long = [line for line in out.splitlines() if len(line) > 80]
        assert not too_long, (args, too_long)
        assert "…" not in out and "..." not in out, (args, out)
        return out

    return run


def words(text: str) -> set[str]:
    return set(re.findall(r"[\w.+/-]+", text))


def test_systems_and_models(run80):
    from topologies.system import list_systems, load_system
    out = run80("systems")
    for name in list_systems():
        s = load_system(name)
        assert re.search(rf"^{re.escape(name)} ", out, re.M), name  # the name whole, at the start of its row
        assert s.default_model in words(out) and str(s.default_gpus) in words(out)
    out = run80("models")
    assert {"gpt-640b", "gpt-tiny", "619.3", "0.1"} <= words(out)


def test_search_prints_every_grid_whole(run80):
    args = ("search", "--system", "perlmutter", "--model", "gpt-1b", "--gpus", "512", "--batch", "512",
            "--top", "12", "--simulate-top", "1")
    out = run80(*args)
    grids = [g["grid"] for g in json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)]
    assert len(grids) >= 12 and all(g in words(out) for g in grids), (grids, out)
    assert "use grid" in out


def test_simulate_topology_program(run80):
    out = run80("simulate", "--system", "cpu", "--model", "gpt-tiny", "--grid", "2x2x2x1")
    assert "2x2x2x1" in words(out) and "MF/s" in out and "0.0 PF/s" not in out  # flop/s in a unit that shows them
    out = run80("topology", "--system", "frontier", "--gpus", "2048", "--grid", "2x4x16x16")
    assert "2x4x16x16" in words(out)
    out = run80("program", "--model", "gpt-tiny", "--grid", "2x2x2x1")
    assert "0.00" not in out and "KiB" in out  # a tiny model's bytes in a unit that shows them


def test_sensitivity_and_scaling(run80):
    out = run80("sensitivity", "--system", "cpu", "--model", "gpt-tiny", "--grid", "2x2x2x1")
    assert "intra_node_efficiency" in words(out) and "profile.hbm_bandwidth" in words(out)
    assert re.search(r"^collectives\. .*\n  intra_node_efficiency", out, re.M)  # a long name in two lines
    assert re.search(r"profile\.hbm_bandwidth +[\d.]+ \([\d.]+ / [\d.]+\) [GT]B/s ", out)  # values with units
    assert re.search(r"collectives\.step_latency +[\d.]+ \([\d.]+ / [\d.]+\) µs ", out)
    out = run80("scaling", "--system", "cpu", "--series", "strong")
    assert {"1x1x1x1", "gpt-tiny"} <= words(out) and "F/s" in out


def test_calibrate_and_validate(run80, tmp_path):
    from fake_run import fake_run

    measured = ROOT / "tests/fixtures/cpu-2026-12-03a/bench-2x1x1x1.json"
    out = run80("calibrate", str(measured), "--out", str(tmp_path / "p.toml"))
    assert "residual" in out
    run = fake_run(tmp_path / "run", "2x1x1x1")
    out = run80("validate", str(run), "--system", "cpu")
    assert "2x1x1x1" in words(out)


def test_the_layout_never_cuts_a_word():
    """A table far wider than the console: cells wrap at spaces, never inside a word."""
    t = table("name", "a long description of something", "value", keep=("name",))
    t.add_row("perlmutter-with-a-long-name", "word " * 40, "1x32x128x8")
    text = "\n".join(t.render(60))
    assert all(len(line) <= 60 for line in text.splitlines()) and "…" not in text
    assert "perlmutter-with-a-long-name" in text and "1x32x128x8" in text


def test_the_layout_is_rich_s_at_our_widths():
    """Our tables print as rich prints a table of the same columns at the widths we chose (light
    rules, headers at the bottom of their row, cells wrapped at spaces): random tables and widths."""
    rnd = random.Random(13)
    vocabulary = ["a", "gpt-320b", "2x32x64x8", "exposed comm", "collectives.intra_node_efficiency", "35.4 %", "-", ""]
    for _ in range(60):
        n = rnd.randint(1, 6)
        heads = [f"{rnd.choice(vocabulary)} {i}" if rnd.random() < 0.9 else "" for i in range(n)]
        keep = tuple(h for h in heads if rnd.random() < 0.4)
        right = tuple(h for h in heads if rnd.random() < 0.4)
        title = rnd.choice([None, "one iteration", " ".join(rnd.choices(vocabulary, k=12))])
        rows = [[" ".join(rnd.choices(vocabulary, k=rnd.choice([1, 1, 3, 12]))) for _ in heads] for _ in range(rnd.randint(0, 4))]
        width = rnd.choice([40, 80, 120])
        ours = table(*heads, title=title, keep=keep, right=right)
        for i, row in enumerate(rows):
            ours.add_row(*row)
            if i == 1:
                ours.add_section()
        widths, wrapped = ours.widths(width)
        if sum(widths) + 2 * (n - 1) > width:
            continue  # wider than the console even with every cell wrapped: rich would cut words, we do not
        theirs = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                       title_justify="left")
        for h, shown, w in zip(heads, wrapped, widths):
            theirs.add_column(Text(shown), width=w, no_wrap=h in keep, justify="right" if h in right else "left",
                              overflow="fold")
        for i, row in enumerate(rows):
            theirs.add_row(*map(Text, row), end_section=i == 1)
        console = Console(width=width, record=True, force_terminal=False)
        console.print(theirs)
        assert console.export_text() == "".join(line + "\n" for line in ours.render(width)), (heads, rows, width)


def test_printing_a_result_does_not_import_rich():
    """rich (about 0.05 s to import) is for progress bars: a command's tables and lines are ours."""
    code = ("import sys, twin.cli.main\n"
            "twin.cli.main.leave = lambda code: None  # stay, to look at the modules\n"
            "sys.argv = ['twin', 'simulate', '--system', 'cpu', '--model', 'gpt-tiny', '--grid', '2x2x2x1']\n"
            "twin.cli.main.app()\n"
            "print('rich imported' if any(m.split('.')[0] == 'rich' for m in sys.modules) else 'no rich')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    assert "iteration time" in out and out.splitlines()[-1] == "no rich", out


def test_a_process_leaves_with_its_output_and_exit_code():
    """`twin` ends without tearing the interpreter down (twin.cli.main.leave): all its output still comes out,
    with the command's exit code."""
    def twin(*args):
        return subprocess.run([sys.executable, "-m", "twin.cli", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
    r = twin("simulate", "--system", "cpu", "--model", "gpt-tiny", "--grid", "2x2x2x1", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["gpus"] == 8, r
    r = twin("simulate", "--system", "nowhere")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r


def test_units():
    assert human_bytes(96 * 1024) == "96.0 KiB" and human_bytes(1.7 * 2**30) == "1.70 GiB" and human_bytes(5) == "5 B"
    assert human_flops(1.7748e18) == "1.77 EF/s" and human_flops(2.08e10) == "20.8 GF/s" and human_flops(5.35e14) == "535 TF/s"


def test_search_says_why_it_prints_more_or_fewer_rows_and_slowdown_names_the_straggler(run80):
    few = run80("search", "--system", "cpu", "--model", "gpt-tiny", "--top", "30")
    assert "only 19 grids divide the model and fit in memory on 8 GPUs" in few and "use grid" in few
    # a GPU profile (fixed data, unlike the refitted cpu one) where a lower bound cannot rule out grid 2
    more = run80("search", "--system", "perlmutter:axonn-table", "--model", "gpt-5b", "--gpus", "64", "--top", "1",
                 "--simulate-top", "1")
    assert re.search(r"rows 2-\d+: beyond the 1 asked for", more), more
    slow = run80("simulate", "--system", "cpu", "--model", "gpt-tiny", "--grid", "2x2x2x1", "--full",
                 "--slowdown", "3:2")
    assert "stragglers: rank 3 (compute x2)" in slow, slow
