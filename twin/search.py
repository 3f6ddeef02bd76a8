"""Grid choice: rank every valid 4D grid (power-of-two ones for a power-of-two GPU count) with an
analytical model, simulate the best few.

Analytical model (as AxoNN's configuration search, shared/reference/collective-bandwidth.md): for each
linear layer of a block, the ring volume of each collective the program issues (forward all-reduce over
the layer's input axis, twice with recomputation; backward all-reduce over its output axis; two z
all-gathers and one z reduce-scatter of the weight shard; the data all-reduce of its fp32 gradient
shard) divided by the bandwidth a group of that axis gets for its size p and rank stride s. The
bandwidth comes from the system's collective model: the time of a large all-gather over a probe grid
whose groups have that size and stride. Compute is added from the kernel model (GEMMs and attention
of every block, the head), so grids that make GEMMs too thin lose too; communication is counted as
not overlapped. The sum ranks grids; the engine then simulates the best few.
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.errors import TwinError
from twin.grid import AXES, Grid
from twin.memory import memory_per_gpu
from twin.program import ACT_BYTES, GRAD_AR_BYTES

PROBE_BYTES = 256 * 2**20  # all-gather payload used to measure a group's bandwidth (bytes)


@dataclass
class Candidate:
    """A grid with its analytical estimate (seconds) and, once simulated, its simulated time."""

    grid: Grid
    analytical_s: float
    compute_s: float
    comm_s: dict[str, float]
    memory_bytes: int
    simulated_s: float | None = None
    result: object = None  # the SimulationResult, once simulated


def candidate_grids(gpus: int) -> list[Grid]:
    """Every grid whose product is `gpus`: the power-of-two grids when `gpus` is a power of two
    (AxoNN's search space), else every factorisation into four divisors (e.g. 6,144 = 3 x 2^11)."""
    if gpus < 1:
        raise TwinError(f"a grid needs at least one GPU, got {gpus}")
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    out = []
    for x in divisors:
        for y in divisors:
            if (gpus // x) % y:
                continue
            rest = gpus // (x * y)
            for z in divisors:
                if rest % z == 0:
                    out.append(Grid(x, y, z, rest // z))
    return out


def _probe_grid(p: int, stride: int) -> tuple[Grid, str]:
    """A small grid whose groups of the returned axis have size p and rank stride `stride`."""
    if stride == 1:
        return Grid(p, 1, 1, 1), "x"
    return Grid(stride, p, 1, 1), "y"


class Bandwidth:
    """Bandwidth (bytes/s of ring volume) a group of size p and stride s gets, from the collective model."""

    def __init__(self, study, collectives=None):
        self.study = study
        self.fixed = collectives  # a stand-in model used for every grid (tests)
        self._cache: dict[tuple[int, int], float] = {}

    def __call__(self, p: int, stride: int) -> float:
        key = (p, stride)
        if key not in self._cache:
            grid, axis = _probe_grid(p, stride)
            if self.fixed is not None:
                model = self.fixed
            else:
                from twin.simulate import collective_model
                model = collective_model(self.study, grid)
            t = model.time("all_gather", axis, PROBE_BYTES, concurrent=frozenset())
            self._cache[key] = (p - 1) / p * PROBE_BYTES / t
        return self._cache[key]


def analytical(study, grid: Grid, bandwidth: Bandwidth) -> Candidate:
    """The analytical estimate of one iteration on `grid` (seconds): compute plus ring volumes / bandwidth."""
    model, opt, km = study.model, study.options, study.kernels
    h = model.hidden
    m = study.batch // (grid.z * grid.data) * study.seq_len   # tokens per rank per iteration
    fwd_passes = 2 if opt.recompute else 1
    vol = {a: 0.0 for a in AXES}  # ring bytes per rank per iteration
    compute = 0.0

    def ring(axis: str, nbytes: float, all_reduce: bool) -> None:
        p = grid.axis_size(axis)
        if p > 1:
            vol[axis] += (2.0 if all_reduce else 1.0) * (p - 1) / p * nbytes

    for _, k, n, transposed in model.linear_shapes():
        in_axis, out_axis = ("y", "x") if transposed else ("x", "y")
        kl, nl = k // grid.axis_size(in_axis), n // grid.axis_size(out_axis)
        compute += fwd_passes * km.gemm_time(m, nl, kl, "NN") + km.gemm_time(m, kl, nl, "NT") \
            + km.gemm_time(kl, nl, m, "TN")
        ring(in_axis, fwd_passes * ACT_BYTES * m * nl, True)
        ring(out_axis, ACT_BYTES * m * kl, True)
        ring("z", (fwd_passes + 1) * ACT_BYTES * kl * nl, False)
        ring("data", GRAD_AR_BYTES * k * n / grid.tensor_size, True)
    seqs = m // study.seq_len
    attn_flops = 4.0 * seqs * study.seq_len ** 2 * h / grid.y
    p = study.profile
    compute += fwd_passes * attn_flops / (p.peak_flops * p.attention_fwd_efficiency) \
        + 2 * attn_flops / (p.peak_flops * p.attention_bwd_efficiency)
    compute *= model.layers
    vol = {a: v * model.layers for a, v in vol.items()}
    vocab = model.padded_vocab(grid.y)
    compute += 3 * km.gemm_time(m, vocab // grid.y, h // grid.x, "NT")
    comm = {a: (vol[a] / bandwidth(grid.axis_size(a), grid.stride(a)) if vol[a] else 0.0) for a in AXES}
    mem = memory_per_gpu(model, grid, opt, study.batch, study.seq_len).total
    return Candidate(grid, compute + sum(comm.values()), compute, comm, mem)


def rank_grids(study, collectives=None) -> list[Candidate]:
    """Every valid grid (power-of-two ones for a power-of-two GPU count) that fits in HBM, best
    analytical estimate first."""
    from twin.simulate import check_grid
    bandwidth = Bandwidth(study, collectives)
    out = []
    for grid in candidate_grids(study.gpus):
        try:
            check_grid(study, grid)
        except TwinError:
            continue
        out.append(analytical(study, grid, bandwidth))
    if not out:
        raise TwinError(f"no grid runs {study.model.name} on {study.gpus} GPUs of "
                        f"{study.system.name} within {study.system.gpu.hbm_bytes / 2**30:.0f} GiB per GPU "
                        "(the model does not fit: use more GPUs, micro-batches or a smaller batch)")
    out.sort(key=lambda c: (c.analytical_s, str(c.grid)))
    return out


def search(study, top: int = 10, simulate_top: int = 3, collectives=None) -> list[Candidate]:
    """The best `top` grids by the analytical model; the first `simulate_top` of them also simulated."""
    from twin.simulate import simulate_grid
    cands = rank_grids(study, collectives)[:max(top, simulate_top)]
    for c in cands[:simulate_top]:
        c.result = simulate_grid(study, c.grid, collectives=collectives)
        c.simulated_s = c.result.iteration_time_s
    return cands[:top]


def choose_grid(study, simulate_top: int = 3, collectives=None) -> tuple[Candidate, str]:
    """The grid `--grid auto` runs, the fastest simulated of the analytical top few (its Candidate, with
    its symmetric-mode result when simulated), and a line saying how it was chosen."""
    cands = search(study, top=max(1, simulate_top), simulate_top=simulate_top, collectives=collectives)
    sims = [c for c in cands if c.simulated_s is not None]
    if not sims:
        best = cands[0]
        return best, f"auto: best of the analytical ranking ({best.analytical_s:.3f} s estimated)"
    best = min(sims, key=lambda c: (c.simulated_s, str(c.grid)))
    return best, (f"auto: fastest simulated of the analytical top {len(sims)} "
                  f"({', '.join(f'{c.grid} {c.simulated_s:.3f} s' for c in sims)})")
