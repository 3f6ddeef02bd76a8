"""The 4D grid: rank order, groups, parsing and validation."""

import pytest

from twin import Grid, TwinError, load_model


def test_rank_order_x_fastest():
    g = Grid(2, 3, 4, 5)
    assert g.size == 120
    assert g.coords(0) == (0, 0, 0, 0)
    assert g.coords(1) == (1, 0, 0, 0)
    assert g.coords(2) == (0, 1, 0, 0)
    assert g.coords(6) == (0, 0, 1, 0)
    assert g.coords(24) == (0, 0, 0, 1)
    for r in range(g.size):
        assert g.rank(*g.coords(r)) == r


@pytest.mark.parametrize("axis,stride", [("x", 1), ("y", 2), ("z", 6), ("data", 24)])
def test_groups_partition_ranks(axis, stride):
    g = Grid(2, 3, 4, 5)
    groups = g.groups(axis)
    assert len(groups) == g.size // g.axis_size(axis)
    assert sorted(r for grp in groups for r in grp) == list(range(g.size))
    for grp in groups:
        assert len(grp) == g.axis_size(axis)
        assert all(b - a == stride for a, b in zip(grp, grp[1:]))
        assert g.group(grp[-1], axis) == grp
        # members differ only in this axis's coordinate
        others = {tuple(c for i, c in enumerate(g.coords(r)) if i != "xyzd".index(axis[0])) for r in grp}
        assert len(others) == 1


def test_parse_and_str():
    g = Grid.parse("8x8x4x128")
    assert (g.x, g.y, g.z, g.data) == (8, 8, 4, 128) and str(g) == "8x8x4x128"
    for bad in ["8x8x4", "axbxcxd", "8x8x0x4", "8*8*4*4", ""]:
        with pytest.raises(TwinError):
            Grid.parse(bad)


@pytest.mark.parametrize("grid,kw,msg", [
    ("2x2x2x64", {"gpus": 256}, "512 GPUs but --gpus is 256"),
    ("3x1x1x1", {}, "not divisible by G_x=3"),
    ("1x6x1x1", {}, "hidden size 4096 of gpt-5b is not divisible by G_y=6"),
    ("1x64x1x1", {}, "heads"),
    ("1x1x3x1", {}, "global batch 2048 is not divisible by G_z\\*G_data=3"),
    ("1x1x2x2", {"batch": 6}, "not divisible by G_z\\*G_data=4"),
    ("1x1x2x2", {"micro_batches": 3}, "micro-batches"),
])
def test_validation_errors(grid, kw, msg):
    with pytest.raises(TwinError, match=msg):
        Grid.parse(grid).validate(load_model("gpt-5b"), **kw)


def test_valid_grid_passes():
    Grid.parse("8x8x4x128").validate(load_model("gpt-320b"), gpus=32768)
