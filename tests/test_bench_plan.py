"""`backend bench --for-twin`: the plan of grids to bench for a study covers every rank count and every
(axis, group size, inside or across nodes) its grids use, says its estimate up front, and refuses bad
input in one line. Planning only: nothing is benched here (the loop's test benches: test_calibration)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from backend.bench.shapes import grids_of  # noqa: E402
from backend.bench.plan import bench_plan, first_grid, needs  # noqa: E402
from twin.program.grid import Grid  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_the_plan_covers_every_rank_count_and_axis_of_the_study():
    study = [g for r in (1, 2, 4, 8) for g in grids_of("gpt-small", r)]
    plan = bench_plan("gpt-small", study)
    assert [s.grid for s in plan if s.first] == ["1x1x1x1", "2x1x1x1", "2x2x1x1", "2x2x2x1"]  # one per rank count
    for r in (1, 2, 4, 8):
        want = set().union(*(needs(g, r) for g in study if g.size == r))
        got = set().union(*(needs(Grid.parse(s.grid), r) for s in plan if s.ranks == r))
        assert want <= got, (r, want - got)
    assert len({s.grid for s in plan}) == len(plan)


def test_the_plan_of_a_few_grids_benches_what_they_use_only():
    plan = bench_plan("gpt-small", [Grid.parse(g) for g in ("1x1x1x2", "1x1x4x1")])
    assert [(s.grid, s.first) for s in plan] == [("2x1x1x1", True), ("1x1x1x2", False), ("2x2x1x1", True),
                                                 ("1x1x4x1", False)]


def test_across_nodes_is_its_own_need():
    """With 8 ranks per node, a data axis of 2 over 16 ranks crosses nodes: a grid whose data groups stay
    inside a node does not cover it."""
    assert needs(Grid.parse("8x1x1x2"), 8) == {("x", 8, False), ("data", 2, True)}
    assert needs(Grid.parse("2x1x1x2"), 8) == {("x", 2, False), ("data", 2, False)}
    plan = bench_plan("gpt-small", [Grid.parse("8x1x1x2")], per_node=8)
    assert set().union(*(s.covers for s in plan)) >= {("x", 8, False), ("data", 2, True)}
    assert first_grid(grids_of("gpt-small", 8)) == Grid.parse("2x2x2x1")


def _bench(*args):
    from typer.testing import CliRunner
    from backend.cli.main import app
    return CliRunner().invoke(app, ["bench", *args], env={"COLUMNS": "400"})


def test_plan_only_says_the_plan_and_its_estimate():
    r = _bench("--for-twin", "--model", "gpt-tiny", "--ranks", "2", "--plan-only", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    assert [b["grid"] for b in plan["benched"]][0] == "2x1x1x1" and plan["estimate_s"] > 0
    assert plan["estimate_s"] == pytest.approx(sum(b["estimate_s"] for b in plan["benched"]))


@pytest.mark.parametrize("args,message", [
    (["--for-twin", "--model", "gpt-tiny", "--grid", "2x1x1x1", "--out", "x"], "leave out --grid"),
    (["--for-twin", "--model", "gpt-tiny", "--ranks", "two", "--out", "x"], "--ranks takes rank counts"),
    (["--for-twin", "--model", "gpt-tiny", "--ranks", "2"], "give the folder with --out"),
    (["--ranks", "2", "--out", "x"], "go with --for-twin"),
])
def test_bad_input_is_one_line(args, message):
    r = _bench(*args)
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_an_moe_study_benches_its_expert_groups():
    # the all-to-alls of an expert group and the expert-data all-reduces are measured inside training
    # only on a grid with E_p > 1: the plan benches the study's MoE grids for them
    study = [Grid.parse(g) for g in ("1x1x1x2e2", "1x1x1x4e2", "1x1x1x8e4")]
    plan = bench_plan("mixtral-tiny", study)
    covered = {c for s in plan for c in s.covers}
    assert {("expert", 2, False), ("expert", 4, False), ("edata", 2, False)} <= covered
    assert {"1x1x1x2e2", "1x1x1x4e2", "1x1x1x8e4"} <= {s.grid for s in plan}
