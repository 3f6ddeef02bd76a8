"""Which ranks of a full-mode run behave alike: the classes the engine simulates once each.

In the engine a rank's timeline depends only on its compute slowdown factor, on its groups (one per
communication axis) and, through them, on the other members' timelines; every group of an axis runs
a collective in the same time (the collective model gives one time per axis). So ranks can be
partitioned so that, inductively over simulated time, every rank of a class does the same thing at the
same instant: the coarsest partition in which ranks of one class have equal factors and, for each axis,
groups whose members fall into the same classes (colour refinement on the ranks-groups graph: start
from the factors, repeat "a rank's class is its class and its groups' class sets" until nothing splits).
With no stragglers that is one class (the symmetric mode's representative rank); one straggler on a
4D grid gives at most 16 (which coordinates a rank shares with it); ranks that all differ give one
class per rank, and the engine then runs rank by rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twin.program.grid import AXES, Grid


@dataclass
class RankClasses:
    """A partition of a grid's ranks. Classes are numbered by their smallest rank.

    ranks[c]: the ranks of class c, ascending. factor[c]: their compute slowdown factor.
    groups[axis]: one entry per class of groups of the axis (numbered by their smallest rank): the
    classes of its members, in the order they first appear in its group with the smallest rank.
    group_of[axis][c]: the group class holding class c's groups of that axis."""

    ranks: list[list[int]]
    factor: list[float]
    groups: dict[str, list[list[int]]]
    group_of: dict[str, list[int]]

    def __len__(self) -> int:
        return len(self.ranks)


def axis_groups(grid: Grid, axis: str) -> np.ndarray:
    """The groups of `axis` as rows of ranks (each in axis order), rows ordered by smallest rank."""
    cube = np.arange(grid.size).reshape(grid.data, grid.z, grid.y, grid.x)  # rank = x + X*(y + Y*(z + Z*d))
    k = 3 - AXES.index(axis)                                                   # the axis' dimension in `cube`
    rows = np.moveaxis(cube, k, -1).reshape(-1, grid.axis_size(axis))
    return rows[np.argsort(rows[:, 0], kind="stable")]


def row_ids(rows: np.ndarray) -> np.ndarray:
    """Number the distinct rows of a 2D array of non-negative ints: equal rows, equal ids (0, 1, ...)."""
    ids = np.zeros(len(rows), dtype=np.int64)
    for col in rows.T:  # fold the columns in one by one; ids stay below len(rows)
        ids = np.unique(ids * (int(col.max()) + 1) + col, return_inverse=True)[1].reshape(-1)
    return ids


def rank_classes(grid: Grid, slowdown: dict[int, float] | None = None,
                 axes: tuple[str, ...] = AXES) -> RankClasses:
    """The coarsest partition of the ranks into classes that behave alike (module docstring), for
    compute slowdown factors `slowdown` (rank -> factor, default 1) and collectives on `axes`."""
    n = grid.size
    factors = np.ones(n)
    for r, f in (slowdown or {}).items():
        factors[r] = f
    _, color = np.unique(factors, return_inverse=True)
    color = color.reshape(-1)
    rows = {a: axis_groups(grid, a) for a in axes if grid.axis_size(a) > 1}
    row_of = {}
    for a, g in rows.items():
        row_of[a] = np.empty(n, dtype=np.int64)
        row_of[a][g] = np.arange(len(g))[:, None]
    count = len(np.unique(color))
    while True:
        keys = [color]
        for a, g in rows.items():
            keys.append(row_ids(np.sort(color[g], axis=1))[row_of[a]])
        color = row_ids(np.stack(keys, axis=1))
        new = int(color.max()) + 1
        if new == count:
            break
        count = new
    # number classes by their smallest rank
    first = np.full(count, n, dtype=np.int64)
    np.minimum.at(first, color, np.arange(n))
    order = np.argsort(first, kind="stable")
    renum = np.empty(count, dtype=np.int64)
    renum[order] = np.arange(count)
    cls = renum[color]
    by_class = np.argsort(cls, kind="stable")
    bounds = np.searchsorted(cls[by_class], np.arange(count + 1))
    ranks = [by_class[bounds[c]:bounds[c + 1]].tolist() for c in range(count)]
    factor = [float(factors[r[0]]) for r in ranks]
    groups: dict[str, list[list[int]]] = {}
    group_of: dict[str, list[int]] = {}
    for a in axes:
        g = rows[a] if a in rows else np.arange(n)[:, None]
        gcls = cls[g]
        seen: dict[tuple, int] = {}
        members: list[list[int]] = []
        mine = [-1] * count
        for row in gcls.tolist():  # rows by smallest rank: a class's group class is that of its first group
            key = tuple(sorted(set(row)))
            k = seen.get(key)
            if k is None:
                k = seen[key] = len(members)
                members.append(list(dict.fromkeys(row)))
            for c in row:
                if mine[c] < 0:
                    mine[c] = k
        groups[a], group_of[a] = members, mine
    return RankClasses(ranks, factor, groups, group_of)


def one_class_per_rank(grid: Grid, slowdown: dict[int, float] | None = None,
                       axes: tuple[str, ...] = AXES) -> RankClasses:
    """Every rank its own class (the engine then runs rank by rank)."""
    slowdown = slowdown or {}
    groups = {a: grid.groups(a) for a in axes}
    group_of = {}
    for a, gs in groups.items():
        group_of[a] = [0] * grid.size
        for k, members in enumerate(gs):
            for r in members:
                group_of[a][r] = k
    return RankClasses([[r] for r in range(grid.size)], [slowdown.get(r, 1.0) for r in range(grid.size)],
                       groups, group_of)
