"""Grid ranking: every valid 4D grid (power-of-two ones for a power-of-two GPU count) by an analytical
model; twin.predict.simulate (`search`, `choose_grid`) then simulates the best few.

Analytical model (as AxoNN's configuration search, docs/reference/collective-bandwidth.md): for each
linear layer of a block, the ring volume of each collective the program issues (forward all-reduce over
the layer's input axis, twice with recomputation; backward all-reduce over its output axis; two z
all-gathers and one z reduce-scatter of the weight shard; the data all-reduce of its fp32 gradient
shard) divided by the bandwidth a group of that axis gets for its size p and rank stride s, plus the number
of collectives times the group's latency (layer-norm statistics are all-reduced over x too). The
bandwidth and latency come from the system's collective model: a large all-gather and a tiny
all-reduce over a probe grid whose groups have that size and stride and sit on nodes as they would
in a large grid. Compute is added from the kernel model (GEMMs and attention of every block, the
head), so grids that make GEMMs too thin lose too. Communication the program overlaps is counted
as exposed only beyond what it can hide behind: the z all-gathers (OAG) and reduce-scatters (ORS)
behind the block's compute, the backward all-reduces (OAR) behind the weight-gradient GEMMs; the
forward all-reduces and the data all-reduces at the end of the step are exposed. (Counting all of it
as exposed ranked grids whose y all-reduces cross nodes first, because the z traffic they avoid is
hidden in the engine anyway: on 8,192 Frontier GCDs, gpt-80b, the top 3 simulated at 8.2-8.3 s
while grids ranked tenth and below simulated at 6.7 s; docs/fidelity.md.) There is no contention
between axes here (the engine has it). The estimate ranks grids; the engine then simulates the best
few, and as many more as could still beat the fastest simulated (twin.predict.simulate). Grid auto orders
grids by the estimate on routing-free probes (`estimate_grids`), which needs no whole-machine probe
routed; `twin search` ranks its table with the exact probes (`rank_grids`).

Everything runs in this process: the collective model's routes and rates are memoised by content
(topologies.memo), so probes share them with each other and with the simulations (the probe of
groups of 8 at stride 4,096 is exactly the data axis of 2x32x64x8), and a process pool would only
compute them again in every worker. The probes of a system and placement are kept for the
process (`bandwidth_for`), so a second search, `simulate --grid auto`, a scaling or a sensitivity
sweep over the same machine reuse them.

Lower bounds on a grid's simulated time, which rule grids out without simulating them, are
twin.predict.bounds'; the programs and collective models a study keeps per grid, twin.predict.study_cache's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from topologies import caches
from topologies.common import TwinError
from twin.program.grid import AXES, Grid
from twin.predict.memory import memory_per_gpu
from twin.program.program import ACT_BYTES, GRAD_AR_BYTES, STAT_BYTES, linear_dims
from twin.predict.study import Study, check_grid, collective_model
from twin.predict.study_cache import SOLO_PHASES, machine_key
from twin.predict.moe_search import axis_key, block_linears, expert_variants, moe_terms


PROBE_BYTES = 256 * 2**20  # all-gather payload used to measure a group's bandwidth (bytes)
BRANCH_BATCH = 4           # grids whose exact estimate is computed per round of the branch and bound (8: one more whole-machine probe on Frontier)


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
    exact: bool = True     # False: analytical_s is only the optimistic bound of the branch and bound
    bound_s: float | None = None  # a lower bound on its simulated time, where the search checked one
    exposed_s: dict[str, float] | None = None  # per axis, the part of comm_s the estimate adds to compute
    # (compute_s + sum(exposed_s) = analytical_s; the rest of comm_s is hidden behind compute)


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


def grids_that_run(model, ranks: int, batch: int | None = None) -> list[Grid]:
    """The candidate_grids of `ranks` ranks that run `model` (a ModelSpec; at `batch` sequences where
    given), by the grid's own check (Grid.validate)."""
    out = []
    for g in candidate_grids(ranks):
        try:
            g.validate(model, gpus=ranks, batch=batch)
        except TwinError:
            continue
        out.append(g)
    return out


def _probe_grid(p: int, stride: int, gpus_per_node: int) -> tuple[Grid, str]:
    """A small grid whose groups of the returned axis have size p and rank stride `stride`, repeated
    so that its groups sit on nodes in every way the groups of a large grid do (a group of 3 on
    4-GPU nodes sometimes straddles two nodes)."""
    k = gpus_per_node // math.gcd(p * stride, gpus_per_node)
    if stride == 1:
        return Grid(p, k, 1, 1), "x"
    return Grid(stride, p, k, 1), "y"


class Bandwidth:
    """What a group of size p and rank stride s gets, from the collective model: ring bandwidth (bytes/s
    of ring volume, a large all-gather), latency (seconds of a collective of a few bytes) and all-reduce
    bandwidth (bytes/s of ring volume of a large all-reduce, which the model may run hierarchically)."""

    def __init__(self, study: Study, collectives=None, bound: bool = False):
        self.study = study
        self.fixed = collectives  # a stand-in model used for every grid (tests)
        self.bound = bound        # probe twin.costs.solobound's bounds instead: at least the bandwidths, at most the latency
        self._cache: dict[tuple[int, int], tuple[float, float, float]] = {}
        self._machine: bytes | None = None

    def _probe(self, p: int, stride: int) -> tuple[float, float, float]:
        key = (p, stride)
        if key not in self._cache:
            grid, axis = _probe_grid(p, stride, self.study.system.gpus_per_node)
            if self.fixed is not None:
                model = self.fixed
            else:
                model = collective_model(self.study, grid)
                if self.bound:
                    from twin.costs.solobound import SoloBound
                    if self._machine is None:  # the same for every study this is kept for (bandwidth_for)
                        self._machine = machine_key(self.study)
                    model = SoloBound(model, SOLO_PHASES, self._machine)
            t = model.time("all_gather", axis, PROBE_BYTES, concurrent=frozenset())
            lat = model.time("all_reduce", axis, 8 * p, concurrent=frozenset())
            t_ar = model.time("all_reduce", axis, PROBE_BYTES, concurrent=frozenset())
            self._cache[key] = ((p - 1) / p * PROBE_BYTES / t, lat, 2 * (p - 1) / p * PROBE_BYTES / t_ar)
        return self._cache[key]

    def __call__(self, p: int, stride: int) -> float:
        return self._probe(p, stride)[0]

    def latency(self, p: int, stride: int) -> float:
        return self._probe(p, stride)[1]

    def all_reduce(self, p: int, stride: int) -> float:
        return self._probe(p, stride)[2]


def analytical(study: Study, grid: Grid, bandwidth: Bandwidth) -> Candidate:
    """The analytical estimate of one iteration on `grid` (seconds): compute, plus the exposed part of
    the communication (per axis: ring volume over the group's bandwidth and the number of collectives
    times the group's latency; overlapped collectives count only beyond what they hide behind).
    `comm_s` holds every axis' whole communication time, overlapped or not."""
    model, opt, km = study.model, study.options, study.kernels
    h = model.hidden
    m = study.batch // (grid.z * grid.data) * study.seq_len   # tokens per rank per iteration
    fwd_passes = 2 if opt.recompute else 1
    # per (axis, how it overlaps): ring bytes per rank per block and collectives per block. "exposed":
    # on the critical path; "oar": hidden behind the weight-gradient GEMMs; "z": behind the block's compute
    vol: dict[tuple[str, str, bool], float] = {}   # (axis, how, all-reduce?) -> bytes
    count: dict[tuple[str, str, bool], int] = {}
    compute = wgrad = 0.0

    def ring(axis: str, nbytes: float, all_reduce: bool, times: float = 1, how: str = "exposed") -> None:
        p = grid.axis_size(axis)
        if p > 1:
            key = (axis, how, all_reduce)
            vol[key] = vol.get(key, 0.0) + times * (2.0 if all_reduce else 1.0) * (p - 1) / p * nbytes
            count[key] = count.get(key, 0) + times

    # (an MoE block's expert linears: rows R_x, `copies` local experts, gradients over edata; moe_search.py)
    for _, k, n, transposed, rows, copies, gaxis, wt in block_linears(study, grid, m):
        kl, nl, in_axis, out_axis = linear_dims(grid, k, n, transposed)
        w = wt * km.gemm_time(kl, nl, rows, "TN")
        wgrad += w
        compute += wt * (fwd_passes * km.gemm_time(rows, nl, kl, "NN") + km.gemm_time(rows, kl, nl, "NT")) + w
        ring(in_axis, ACT_BYTES * rows * nl, True, wt * fwd_passes)     # forward (and recomputed) output
        ring(out_axis, ACT_BYTES * rows * kl, True, wt, how="oar" if opt.oar else "exposed")  # backward input gradient
        ring("z", ACT_BYTES * copies * kl * nl, False, 2 * wt, how="z" if opt.oag else "exposed")  # two gathers
        ring("z", ACT_BYTES * copies * kl * nl, False, wt, how="z" if opt.ors else "exposed")  # one reduce-scatter
        ring(gaxis, GRAD_AR_BYTES * copies * k * n / grid.tensor_size, True, wt)
    compute += moe_terms(study, grid, m, fwd_passes, ring)  # the router and the all-to-alls
    ring("x", STAT_BYTES * 2 * m, True, 2 * (fwd_passes + 1))   # layer-norm statistics
    seqs = m // study.seq_len
    attn_flops = 4.0 * seqs * study.seq_len ** 2 * h / grid.y
    p = study.profile
    compute += fwd_passes * attn_flops / (p.peak_flops * p.attention_fwd_efficiency) \
        + 2 * attn_flops / (p.peak_flops * p.attention_bwd_efficiency)
    block = compute
    compute *= model.layers
    vocab = model.padded_vocab(grid.y)
    compute += 3 * km.gemm_time(m, vocab // grid.y, h // grid.x, "NT")
    per_block = {how: 0.0 for how in ("exposed", "oar", "z")}
    by_how = {how: {a: 0.0 for a in AXES} for how in per_block}  # per block, seconds per axis
    comm = {a: 0.0 for a in AXES}
    for (a, how, all_reduce), v in vol.items():
        size, stride = grid.axis_size(a), grid.stride(a)
        bw = bandwidth.all_reduce(size, stride) if all_reduce else bandwidth(size, stride)
        t = v / bw + count[a, how, all_reduce] * bandwidth.latency(size, stride)
        per_block[how] += t
        by_how[how][axis_key(a)] += t
        comm[axis_key(a)] += model.layers * t
    # what each hiding place cannot hide, shared among its axes in proportion to their time
    left = {"exposed": 1.0, "oar": max(0.0, per_block["oar"] - wgrad), "z": max(0.0, per_block["z"] - block)}
    share = {how: 1.0 if how == "exposed" else (left[how] / per_block[how] if per_block[how] else 0.0) for how in left}
    exposed_axes = {a: model.layers * sum(share[how] * by_how[how][a] for how in by_how) for a in AXES}
    exposed = per_block["exposed"] + left["oar"] + left["z"]
    mem = memory_per_gpu(model, grid, opt, study.batch, study.seq_len, study.profile.activation_bytes).total
    return Candidate(grid, compute + model.layers * exposed, compute, comm, mem, exposed_s=exposed_axes)


# (machine_key, optimistic) -> the probes of that machine (bandwidth_for): the last 16
_BANDWIDTHS: dict[tuple[bytes, bool], Bandwidth] = caches.register("twin.predict.search.bandwidths", {})


def bandwidth_for(study: Study, optimistic: bool = False) -> Bandwidth:
    """The process's probes of the study's machine (`machine_key`: what they measure depends on nothing
    else), exact or optimistic (twin.costs.solobound's bounds on the same probes: nothing routed)."""
    key = (machine_key(study), optimistic)
    bw = _BANDWIDTHS.get(key)
    if bw is None:
        if len(_BANDWIDTHS) >= 16:
            _BANDWIDTHS.pop(next(iter(_BANDWIDTHS)))
        bw = _BANDWIDTHS[key] = Bandwidth(study, bound=optimistic)
    bw.study = study
    return bw


def _probe_all(bandwidth: Bandwidth, pairs) -> None:
    """Fill `bandwidth` for every (size, stride) in `pairs`."""
    for p, s in sorted({pair for pair in pairs if pair not in bandwidth._cache}):
        bandwidth._probe(p, s)


def _pairs(grids) -> set[tuple[int, int]]:
    return {(g.axis_size(a), g.stride(a)) for g in grids for a in AXES + ("expert", "edata") if g.axis_size(a) > 1}


def valid_grids(study: Study) -> list[Grid]:
    """The grids that run the study (candidate_grids that check_grid accepts). Raises TwinError, saying
    why, when none does."""
    valid, reasons = [], []
    for grid in expert_variants(study.model, candidate_grids(study.gpus)):
        try:
            check_grid(study, grid)
        except TwinError as e:
            reasons.append(str(e))
            continue
        valid.append(grid)
    if not valid:
        if any("does not fit" in r for r in reasons):
            raise TwinError(f"no grid runs {study.model.name} on {study.gpus} GPUs of "
                            f"{study.system.name} within {study.system.gpu.hbm_bytes / 2**30:.0f} GiB per GPU "
                            "(the model does not fit: use more GPUs, micro-batches or a smaller batch)")
        raise TwinError(f"no grid of {study.gpus} GPUs can run {study.model.name}: {reasons[-1]}")
    return valid


def estimate_grids(study: Study, grids: list[Grid] | None = None) -> list[Candidate]:
    """Every valid grid (or each of `grids`) with its optimistic analytical estimate, best first: the
    analytical model on probes that route nothing (twin.costs.solobound: at least each probe's bandwidths,
    at most its latency; the estimate only grows with times, so it is at most the exact one). Each
    Candidate has `exact` False. This is the order grid auto looks at grids in (twin.predict.simulate)."""
    grids = valid_grids(study) if grids is None else grids
    optimistic = bandwidth_for(study, optimistic=True)
    _probe_all(optimistic, _pairs(grids))
    out = [analytical(study, g, optimistic) for g in grids]
    for c in out:
        c.exact = False
    out.sort(key=lambda c: (c.analytical_s, str(c.grid)))
    return out


def rank_grids(study: Study, collectives=None, keep: int | None = None) -> list[Candidate]:
    """The valid grids (power-of-two ones for a power-of-two GPU count) that fit in HBM, best analytical
    estimate first: all of them, or (with `keep`) at least the best `keep`, found by branch and bound,
    followed by every other valid grid with its optimistic bound (`exact` False), best bound first.

    The real collective model is probed once per (group size, stride). With `keep`, every grid first
    gets an optimistic estimate (estimate_grids: below the exact one); exact probes are then made
    only for grids whose optimistic estimate beats the `keep`-th best exact one so far, which finds
    the exact best `keep` of all grids."""
    valid = valid_grids(study)
    exact_bw = Bandwidth(study, collectives) if collectives is not None else bandwidth_for(study)
    if collectives is not None or keep is None:
        if collectives is None:
            _probe_all(exact_bw, _pairs(valid))
        out = [analytical(study, grid, exact_bw) for grid in valid]
        out.sort(key=lambda c: (c.analytical_s, str(c.grid)))
        return out
    bounds = estimate_grids(study, valid)
    out, i = [], 0
    while i < len(bounds):
        best = sorted(c.analytical_s for c in out)
        kth = best[keep - 1] if len(best) >= keep else math.inf
        batch = []
        while i < len(bounds) and bounds[i].analytical_s <= kth and len(batch) < BRANCH_BATCH:
            batch.append(bounds[i].grid)
            i += 1
        if not batch:
            break
        _probe_all(exact_bw, _pairs(batch))
        out += [analytical(study, grid, exact_bw) for grid in batch]
    out.sort(key=lambda c: (c.analytical_s, str(c.grid)))
    return out + bounds[i:]


def exact_estimate(study: Study, grid: Grid) -> Candidate:
    """The exact analytical estimate of one grid (its probes routed, kept for the process)."""
    bw = bandwidth_for(study)
    _probe_all(bw, _pairs([grid]))
    return analytical(study, grid, bw)
