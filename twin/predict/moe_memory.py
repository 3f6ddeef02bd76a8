"""What an MoE block adds to a rank's memory (twin/predict/memory.py counts the rest).

Parameters, gradients and optimizer state: the rank's E/E_p experts of each MoE block (3D-split as the
dense MLP) and its routers come in through twin.program.ops.local_params. Activations: a block's stash
and working set at its MLP's backward, where an MoE block holds, on top of a dense block's counted for
the rank's m tokens, the rows its experts took instead (R_x: m top_k balanced, times the imbalance
stretch, or E x capacity), that is the expert MLP's stash on R_x rows instead of m, the dispatch's receive
buffer and the experts' output (R_x rows of h/G_x each), the send and combined buffers (R rows of
h/G_x each) and the router's probabilities, gates and indices (fp32, m x (E + 2 top_k)). Gathered
weights: the expert linears' z-gathered shards are the rank's E/E_p experts' (twin.program.moe).
"""

from __future__ import annotations

import math

from twin.program.moe_spec import local_experts, routed_rows, stretch


def moe_rows(model, grid, options, m: int) -> tuple[int, int]:
    """(R, R_x): rows a rank sends per MoE block, and rows its experts take (with the imbalance)."""
    r = routed_rows(model, m)
    return r, math.ceil(r * stretch(model, local_experts(model, grid), options.moe_imbalance) - 1e-9)


def moe_activation_extra(model, grid, options, m: int, act: int) -> tuple[int, int]:
    """(stash, working) bytes an MoE block holds beyond a dense block's, for m tokens of the rank
    (0, 0 for a dense model)."""
    if not model.is_moe:
        return 0, 0
    h, gx, gy, f = model.hidden, grid.x, grid.y, model.ffn
    r, rx = moe_rows(model, grid, options, m)
    mlp = (3 if model.is_llama else 2) * f // gy   # stash per row: gate|up and SwiGLU's output, or GELU in and out
    work = (2 if model.is_llama else 1) * f // gy  # working set per row at the MLP's backward
    stash = act * ((rx - m) * mlp + 2 * rx * h // gx + 2 * r * h // gx) + 4 * m * (model.experts + 2 * model.top_k)
    return max(0, stash), max(0, act * (rx - m) * work)


def block_weights(model, grid) -> list[int]:
    """Elements of a block's four linear shards (k n / (G_x G_y)) at their largest: an MoE block's
    expert linears hold the rank's E/E_p experts."""
    w = [k * n // (grid.x * grid.y) for _, k, n, _ in model.linear_shapes()]
    if model.is_moe:
        e = local_experts(model, grid)
        w[2], w[3] = e * w[2], e * w[3]
    return w
