"""The expert axis of a grid (twin/program/grid.py): E_p, written as the suffix `e<N>` (`1x1x1x8e4`).

E_p is a subgroup of the data axis, as in DeepSpeed-MoE and Megatron-LM: the expert group of a rank is
the ranks with its x, y, z and pipeline stage and a data coordinate d with the same d // E_p (E_p
consecutive data coordinates); each holds experts / E_p of every MoE block's experts (rank with
d % E_p = j holds experts [j E/E_p, (j+1) E/E_p)). The experts' gradients are all-reduced over the
"edata" group: the ranks with its x, y, z, stage and the same d % E_p (G_data / E_p ranks). Dense
parameters keep the ordinary data-axis all-reduce.
"""

from __future__ import annotations

from topologies.common import TwinError


def parse_expert(cls, text: str, m):
    """The Grid of a match of Grid.parse's pattern that has the `e<N>` suffix."""
    g = [int(v) for v in m.groups()[:5] if v is not None]
    e = int(m.group(6))
    if e < 1:
        raise TwinError(f"grid {text!r}: the expert suffix e<N> needs N >= 1 (E_p, the ranks that split the experts)")
    if len(g) == 5:
        return cls(g[0], g[1], g[2], g[4], pipe=g[3], expert=e)
    return cls(*g, expert=e)


def expert_group(grid, rank: int, axis: str) -> list[int]:
    """The ranks of `rank`'s expert group (axis "expert") or expert-data group ("edata"), in order of d."""
    x, y, z, d = grid.coords(rank)
    p = grid.stage(rank)
    e = grid.expert
    if axis == "expert":
        ds = range(d // e * e, d // e * e + e)
    else:
        ds = range(d % e, grid.data, e)
    return [grid.rank(x, y, z, dd, pipe=p) for dd in ds]


def expert_groups(grid, axis: str) -> list[list[int]]:
    """Every expert ("expert") or expert-data ("edata") group; together they partition the ranks."""
    out, seen = [], set()
    for r in range(grid.size):
        if r not in seen:
            g = expert_group(grid, r, axis)
            seen.update(g)
            out.append(g)
    return out


def validate_experts(grid, model) -> None:
    """Raise TwinError (one line) when `grid`'s E_p cannot split `model`'s experts."""
    e = grid.expert
    if e > 1 and not model.is_moe:
        raise TwinError(f"grid {grid} splits experts over E_p={e} but {model.name} has no experts "
                        "(drop the e<N> suffix, or use a mixture-of-experts model)")
    if grid.data % e:
        raise TwinError(f"grid {grid}: E_p={e} does not divide G_data={grid.data} (the expert axis is a "
                        "subgroup of the data axis): choose an E_p that divides G_data")
    if model.experts % e:
        raise TwinError(f"grid {grid}: the {model.experts} experts of {model.name} are not divisible by E_p={e}: "
                        f"choose an E_p that divides {model.experts}")
