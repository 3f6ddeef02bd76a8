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


def test_bench_steps_count_a_gap_beside_an_all_to_all_as_no_host_time():
    """backend.bench.steps reads the host's time per op from the gaps between compute ops with no
    collective of the rank in flight: an MoE all-to-all in flight makes a gap busy like an all-reduce
    (before, all_to_all was no collective there, and the gaps waiting for the dispatches and combines
    of mixtral-tiny counted as host time: host_op_s 0.77 ms with 8 ranks against 0.05-0.19 ms of free
    gaps in its runs)."""
    from backend.bench.steps import COLLECTIVE_KINDS, rank_collectives
    from twin.program.trace import Span, host_gaps
    comp = [Span(0, n, "elementwise", "compute", s, d) for n, s, d in
            (("permute", 0.0, 0.1), ("up", 3.0, 0.2), ("unpermute", 6.0, 0.1), ("ln", 6.2, 0.1))]
    a2a = [Span(0, "dispatch", "all_to_all", "data", 1.0, 2.0), Span(0, "combine", "all_to_all", "data", 3.3, 2.6)]
    gaps = host_gaps(comp, rank_collectives(comp + a2a))
    assert [set(g.in_flight) for g in gaps] == [{"all_to_all"}, {"all_to_all"}, set()]
    assert [g.waited for g in gaps[:2]] == a2a
    assert "all_to_all" in COLLECTIVE_KINDS and rank_collectives(comp) == []
