"""What the grid search (twin/predict/search.py) adds for a mixture-of-experts model: the E_p of each
candidate grid, and the analytical model's terms of an MoE block.

Candidates: every grid of the dense search, each with every E_p that divides both G_data and the
experts (1 included), so that the search weighs the all-to-alls that E_p > 1 adds against the expert
gradients' all-reduce over all of G_data and the z all-gathers of all E experts that E_p = 1 pays.

Analytical terms of an MoE block (as the dense linears', search.py's module docstring): the expert
linears with R_x rows (m top_k balanced, times the imbalance stretch) instead of m, E/E_p experts'
shards gathered over z, their fp32 gradient shards all-reduced over the edata group (G_data / E_p);
the router GEMMs; and the four all-to-alls per pass pair (dispatch and combine, forward, recomputed
forward and backward) of R_x rows of h/G_x, counted exposed, at the bandwidth of an all-gather ring
over the expert group's size and stride (the same ring volume, (E_p - 1)/E_p of the buffer per rank).
"""

from __future__ import annotations

import math

from twin.program.grid import Grid
from twin.program.moe_spec import local_experts, routed_rows, stretch

ACT_BYTES = 2


def expert_variants(model, grids: list[Grid]) -> list[Grid]:
    """`grids`, each with every E_p that divides its G_data and the model's experts (a dense model:
    `grids` as they are)."""
    if not model.is_moe:
        return grids
    out = []
    for g in grids:
        for e in range(1, math.gcd(g.data, model.experts) + 1):
            if g.data % e == 0 and model.experts % e == 0:
                out.append(Grid(g.x, g.y, g.z, g.data, pipe=g.pipe, expert=e))
    return out


def block_linears(study, grid: Grid, m: int) -> list[tuple]:
    """The linears of a block for the analytical model: (name, k, n, transposed, rows, copies, gradient
    axis, weight), `weight` the share of the blocks that have it (an MoE block's expert linears take the
    place of the MLP's in moe_layers / layers of them)."""
    model = study.model
    lin = model.linear_shapes()
    if not model.is_moe:
        return [(ln, k, n, t, m, 1, "data", 1.0) for ln, k, n, t in lin]
    frac = model.moe_layers / model.layers
    rx = expert_rows(study, grid, m)
    e = local_experts(model, grid)
    out = [(ln, k, n, t, m, 1, "data", 1.0) for ln, k, n, t in lin[:2]]
    out += [(ln, k, n, t, m, 1, "data", 1.0 - frac) for ln, k, n, t in lin[2:] if frac < 1]
    out += [("expert_" + ln[4:], k, n, t, rx, e, "edata", frac) for ln, k, n, t in lin[2:]]
    return out


def expert_rows(study, grid: Grid, m: int) -> int:
    """R_x: the rows the busiest expert rank's experts take for m tokens."""
    model = study.model
    r = routed_rows(model, m)
    return math.ceil(r * stretch(model, local_experts(model, grid), study.options.moe_imbalance) - 1e-9)


def moe_terms(study, grid: Grid, m: int, fwd_passes: int, ring) -> float:
    """Adds the all-to-alls of an MoE block to `ring` (search.analytical's) and returns the router's
    compute time per block (seconds, weighted by the share of MoE blocks)."""
    model, km = study.model, study.kernels
    if not model.is_moe:
        return 0.0
    frac = model.moe_layers / model.layers
    h, E = model.hidden, model.experts
    rx = expert_rows(study, grid, m)
    ring("expert", ACT_BYTES * rx * h / grid.x, False, times=(2 * fwd_passes + 2) * frac)
    router = fwd_passes * km.gemm_time(m, E, h // grid.x, "NN") + km.gemm_time(m, h // grid.x, E, "NT") \
        + km.gemm_time(h // grid.x, E, m, "TN")
    return frac * router


def axis_key(axis: str) -> str:
    """The breakdown's axis of a collective axis (the expert axes run on the data stream)."""
    return "data" if axis in ("expert", "edata") else axis
