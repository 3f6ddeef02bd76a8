"""AxoNN's own communication model, with its own measured tables, against the published runs: an
evidence check that needs nothing of the twin.

    python benchmarks/axonn_comm_model.py [--top 3] [--batch 2048]

AxoNN's configuration search (axonn-ai/Megatron-AxoNN, branch gordon-bell-perlmutter,
examples/comm_model.py; transcribed in docs/reference/collective-bandwidth.md) turns a grid into
a communication time per iteration: per transformer block, the ring volume of the x, y, z and data
collectives divided by the measured bandwidth of a group of that size p and rank stride s. Here it is
applied literally, over every power-of-two grid that fits in memory (x*y*z at least the smallest the
model table gives, models.md) and splits the batch by whole sequences (z*data <= batch), for each
published run. Printed per run: the published iteration time (from the published flop/s with the
reference flop formula), the compute at the sourced large-GEMM rate (systems.md: 125 TF/s per MI250X
GCD, 280 TF/s per A100; a lower bound: attention and the rest are slower), and the communication the
model predicts for its best grids, by axis.

How to read it: a lower bound on the iteration of every grid, minimised over the grids. The
collectives of one axis run one after the other on that axis' stream, so an iteration lasts at least
as long as its busiest axis; and the forward all-reduces cannot overlap compute (the next GEMM needs
their result), so it lasts at least compute + forward all-reduces. The bound is the larger of the two,
i.e. everything else overlapped perfectly, with compute at the large-GEMM rate (attention and
elementwise ops as fast as GEMMs): optimistic. Where even it exceeds the published iteration, no grid
can have run that fast on a network with the table's bandwidths (with that batch), so the table
cannot describe the network of that run.
docs/fidelity.md uses this for Frontier. (The grids are AxoNN's ranking: by the sum of the axes.)

The model's formulas are used as written there, 2 bytes per element, with one correction: for the
transposed MLP-down layer (4H -> H) the forward all-reduce carries the H-wide output and the backward
one the 4H-wide input gradient (a literal swap of x and y in the reference's formulas would count the
forward at 4H, overstating the forward all-reduces that the lower bound below rests on).
"""

from __future__ import annotations

import argparse
import itertools
import math

# bandwidth in GB/s by rank stride (rows) and group size p (columns 2, 4, 8, >8);
# collective-bandwidth.md (AxoNN's examples/comm_model.py). The last row holds for larger strides.
TABLES = {
    "perlmutter": {1: (76, 225, 80, 80), 2: (76, 40, 40, 40), 4: (20, 20, 20, 20)},
    "frontier": {1: (129, 52, 135, 40), 2: (50, 72, 20, 20), 4: (36, 10, 10, 10), 8: (5, 5, 5, 5)},
}
# advertised bf16 peak and large-GEMM rate per GPU, flop/s (systems.md)
PEAK = {"perlmutter": 312e12, "frontier": 191.5e12}
GEMM = {"perlmutter": 280e12, "frontier": 125e12}
# (layers, hidden, smallest x*y*z that fits in memory), models.md
MODELS = {"gpt-5b": (24, 4096, 4), "gpt-20b": (32, 7168, 16), "gpt-40b": (38, 9216, 32),
          "gpt-80b": (42, 12288, 64), "gpt-160b": (84, 12288, 128)}
# (system, model, GPUs, published share of peak, source); published.md
RUNS = [
    ("perlmutter", "gpt-40b", 4096, 620.1e15 / (4096 * 312e12), "620.1 PF/s"),
    ("perlmutter", "gpt-80b", 1024, 0.57, "182 PF/s, 57% of peak"),
    ("frontier", "gpt-5b", 512, 0.363 / 0.883, "implied: 36.3% at 8,192 / 88.3% efficiency"),
    ("frontier", "gpt-80b", 8192, 0.363, "~36.3% of peak"),
    ("frontier", "gpt-160b", 16384, 0.363 / 0.883 * 0.7902, "implied: 79.02% efficiency"),
]
VOCAB, SEQ = 50304, 2048


def bandwidth(system: str, p: int, stride: int) -> float:
    """Measured ring bandwidth (bytes/s) of a group of p ranks at rank stride `stride`."""
    table = TABLES[system]
    row = table[max(s for s in table if s <= stride)]
    return row[{2: 0, 4: 1, 8: 2}.get(p, 3)] * 1e9


# the four linear layers of a block: (input width, output width) in units of H, transposed or not
LAYERS = ((1, 3, False), (1, 1, True), (1, 4, False), (4, 1, True))


def _all_reduces(system: str, model: str, gx: int, gy: int, gz: int, gd: int, batch: int):
    """(axis, forward?, seconds per iteration) of every tensor-parallel all-reduce of the model."""
    layers, h, _ = MODELS[model]
    tokens = batch * SEQ / (gz * gd)  # B': tokens per z-and-data shard
    for k_in, k_out, transposed in LAYERS:
        # a layer's input dim is split over its input axis, its output dim over the other one;
        # transposed layers swap the two axes (AxoNN's easy transposition)
        (a, sa, na), (b, sb, nb) = ((gx, 1, "x"), (gy, gx, "y"))[:: -1 if transposed else 1]
        if a > 1:   # forward: partial outputs summed over the input axis, twice (recomputation)
            yield na, True, layers * 2 * 2 * (a - 1) / a * tokens * k_out * h / b * 2 / bandwidth(system, a, sa)
        if b > 1:   # backward: partial input gradients summed over the output axis
            yield nb, False, layers * 2 * (b - 1) / b * tokens * k_in * h / a * 2 / bandwidth(system, b, sb)


def comm_time(system: str, model: str, gx: int, gy: int, gz: int, gd: int, batch: int) -> dict[str, float]:
    """Seconds per iteration by axis, AxoNN's model (collective-bandwidth.md)."""
    layers, h, _ = MODELS[model]
    t = dict(x=0.0, y=0.0, z=0.0, data=0.0)
    for axis, _, sec in _all_reduces(system, model, gx, gy, gz, gd, batch):
        t[axis] += sec
    for k_in, k_out, _ in LAYERS:
        if gz > 1:  # two all-gathers and a reduce-scatter of the weight shard
            t["z"] += layers * 3 * (gz - 1) / gz * k_in * k_out * h * h / (gx * gy) * 2 / bandwidth(system, gz, gx * gy)
        if gd > 1:  # data all-reduce of the gradient shard
            t["data"] += layers * 4 * (gd - 1) / gd * k_in * k_out * h * h / (gx * gy * gz) * 2 / bandwidth(
                system, gd, gx * gy * gz)
    return t


def forward_time(system: str, model: str, gx: int, gy: int, gz: int, gd: int, batch: int) -> float:
    """Seconds per iteration of the forward all-reduces (with recomputation's), which no overlap can
    hide: the next GEMM needs their result (AxoNN overlaps only the backward ones, OAR)."""
    return sum(sec for _, fwd, sec in _all_reduces(system, model, gx, gy, gz, gd, batch) if fwd)


def flops(model: str, batch: int) -> float:
    """Reference flop count of one iteration with recomputation (models.md, Narayanan et al.)."""
    layers, h, _ = MODELS[model]
    return 96 * batch * SEQ * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * layers * h))


def best_grids(system: str, model: str, gpus: int, batch: int) -> list[tuple[float, str, dict]]:
    """Every valid power-of-two grid with its predicted communication, best first."""
    e, out = int(math.log2(gpus)), []
    for a, b, c in itertools.product(range(e + 1), repeat=3):
        gx, gy, gz = 2**a, 2**b, 2**c
        if a + b + c > e or gx * gy * gz < MODELS[model][2] or gpus // (gx * gy) > batch:
            continue
        gd = gpus // (gx * gy * gz)
        t = comm_time(system, model, gx, gy, gz, gd, batch)
        out.append((sum(t.values()), f"{gx}x{gy}x{gz}x{gd}", t))
    return sorted(out)


def lower_bound(system: str, model: str, gpus: int, batch: int) -> tuple[float, str]:
    """(seconds, grid): the smallest over every valid grid of max(busiest axis, compute at the
    large-GEMM rate + forward all-reduces); see the module docstring."""
    compute = flops(model, batch) / (gpus * GEMM[system])
    return min((max(max(t.values()), compute + forward_time(system, model, *map(int, g.split("x")), batch)), g)
               for _, g, t in best_grids(system, model, gpus, batch))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=3, help="best grids printed per run")
    ap.add_argument("--batch", type=int, default=2048, help="global batch, sequences (not published; models.md's)")
    a = ap.parse_args()
    for system, model, gpus, share, source in RUNS:
        f = flops(model, a.batch)
        published = f / (gpus * PEAK[system] * share)
        compute = f / (gpus * GEMM[system])
        grids = best_grids(system, model, gpus, a.batch)
        bound, bound_grid = lower_bound(system, model, gpus, a.batch)
        verdict = ("above the published iteration: the table cannot describe this run"
                   if bound > published else "consistent")
        print(f"{system} {model} on {gpus:,}: published iteration {published:.2f} s ({source}); "
              f"compute at the GEMM rate {compute:.2f} s; lower bound {bound:.2f} s (best at "
              f"{bound_grid}) -> {verdict}")
        for total, grid, t in grids[: a.top]:
            print(f"    {grid:>12}  comm {total:6.2f} s = " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()))


if __name__ == "__main__":
    main()
