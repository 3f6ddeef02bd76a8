"""Full mode simulates each class of ranks that behave alike once (twin.engine.symmetry): the classes are
right, and the merged run gives every rank what the rank-by-rank run gives it."""

import random

import pytest

from test_engine import COMM_HEAVY, run
from twin.program.grid import AXES, Grid
from twin.engine.symmetry import axis_groups, rank_classes


def check_partition(grid: Grid, slowdown: dict[int, float]):
    """Every rank of a class has its factor and, per axis, a group whose member classes are its group class's."""
    rc = rank_classes(grid, slowdown)
    cls = {r: c for c, ranks in enumerate(rc.ranks) for r in ranks}
    assert sorted(cls) == list(range(grid.size))
    assert [min(r) for r in rc.ranks] == sorted(min(r) for r in rc.ranks)  # numbered by smallest rank
    for c, ranks in enumerate(rc.ranks):
        for r in ranks:
            assert slowdown.get(r, 1.0) == rc.factor[c]
            for a in AXES:
                members = {cls[m] for m in grid.group(r, a)}
                assert members == set(rc.groups[a][rc.group_of[a][c]])
    return rc


def test_no_straggler_is_one_class_and_one_straggler_at_most_sixteen():
    g = Grid(3, 2, 4, 5)
    assert len(check_partition(g, {})) == 1
    rc = check_partition(g, {17: 1.5})
    # a rank's class: which coordinates it shares with the straggler
    assert len(rc) == 16 and sorted(len(r) for r in rc.ranks) == sorted(
        (1 if sx else 2) * (1 if sy else 1) * (1 if sz else 3) * (1 if sd else 4)
        for sx in (0, 1) for sy in (0, 1) for sz in (0, 1) for sd in (0, 1))
    assert len(check_partition(g, {17: 1.0})) == 1  # a factor of 1 is no straggler


def test_classes_of_random_stragglers():
    rng = random.Random(7)
    for grid in (Grid(2, 2, 2, 2), Grid(1, 4, 2, 3), Grid(4, 1, 3, 2), Grid(2, 3, 1, 4)):
        for _ in range(5):
            slow = {rng.randrange(grid.size): rng.choice((1.2, 1.5)) for _ in range(rng.randint(1, 4))}
            check_partition(grid, slow)


def test_axis_groups_are_the_grids_groups():
    g = Grid(2, 3, 2, 2)
    for a in AXES:
        assert axis_groups(g, a).tolist() == g.groups(a)


def same_result(a, b, exact=False):
    if exact:
        return (a.iteration_s, a.compute_s, a.exposed_s, a.idle_s) == (b.iteration_s, b.compute_s, b.exposed_s, b.idle_s)
    return (a.iteration_s == pytest.approx(b.iteration_s, rel=1e-6) and a.compute_s == pytest.approx(b.compute_s, rel=1e-6)
            and all(a.exposed_s[k] == pytest.approx(b.exposed_s[k], rel=1e-6, abs=1e-9) for k in AXES))


def test_full_mode_without_stragglers_is_the_symmetric_run():
    for grid in ("2x2x2x2", "2x2x4x1"):
        s, f = run(grid=grid, **COMM_HEAVY), run(grid=grid, full=True, **COMM_HEAVY)
        assert same_result(s, f, exact=True) and f.classes == 1 and f.ranks == 16
        assert f.simulated_ops == 16 * s.simulated_ops


@pytest.mark.parametrize("grid,slowdown,share", [("2x2x2x4", {5: 1.5}, 1.0), ("2x2x4x1", {0: 1.2, 7: 1.3}, 1.0),
                                                 ("1x4x2x2", {1: 1.1, 2: 1.1}, 1.0), ("2x2x2x4", {5: 1.5}, 0.5)])
def test_merged_classes_give_every_rank_its_rank_by_rank_result(grid, slowdown, share, monkeypatch):
    import twin.engine.engine as engine
    plain = engine.simulate_program  # share: a collective's rate while a member computes
    monkeypatch.setattr("test_engine.simulate_program", lambda *a, **k: plain(*a, comm_slowdown=1 / share, **k))
    merged = run(grid=grid, full=True, slowdown=slowdown, record=True)
    monkeypatch.setattr("test_engine.simulate_program",
                        lambda *a, **k: plain(*a, merge_alike=False, comm_slowdown=1 / share, **k))
    by_rank = run(grid=grid, full=True, slowdown=slowdown, record=True)
    assert merged.classes < by_rank.classes == Grid.parse(grid).size
    assert same_result(merged, by_rank) and merged.simulated_ops == by_rank.simulated_ops
    spans = lambda r: sorted((rank, i) for rank, i, _, _ in r.spans)
    assert spans(merged) == spans(by_rank)
    # the same to the rounding of re-rates (a few ns): ties at one nanosecond run in another order
    times = {(rank, i): (s, d) for rank, i, s, d in by_rank.spans}
    for rank, i, s, d in merged.spans:
        assert (s, d) == pytest.approx(times[rank, i], abs=1e-8)
