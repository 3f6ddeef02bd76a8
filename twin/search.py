"""Grid ranking: every valid 4D grid (power-of-two ones for a power-of-two GPU count) by an analytical
model; twin.simulate (`search`, `choose_grid`) then simulates the best few.

Analytical model (as AxoNN's configuration search, shared/reference/collective-bandwidth.md): for each
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
few, and as many more as could still beat the fastest simulated (twin.simulate). Grid auto orders
grids by the estimate on routing-free probes (`estimate_grids`), which needs no whole-machine probe
routed; `twin search` ranks its table with the exact probes (`rank_grids`).

Everything runs in this process: the collective model's routes and rates are memoised by content
(topologies.memo), so probes share them with each other and with the simulations (the probe of
groups of 8 at stride 4,096 is exactly the data axis of 2x32x64x8), and a process pool would only
compute them again in every worker. The probes of a system and placement are kept for the
process (`bandwidth_for`), so a second search, `simulate --grid auto`, a scaling or a sensitivity
sweep over the same machine reuse them.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Callable

from topologies.memo import digest
from twin.common import TwinError
from twin.engine import NS
from twin.grid import AXES, Grid
from twin.memory import memory_per_gpu
from twin.program import ACT_BYTES, GRAD_AR_BYTES, STAT_BYTES, linear_dims
from twin.study import Study, check_grid, collective_model


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
        self.bound = bound        # probe twin.solobound's bounds instead: at least the bandwidths, at most the latency
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
                    from twin.solobound import SoloBound
                    if self._machine is None:  # the same for every study this is kept for (bandwidth_for)
                        self._machine = machine_key(self.study)
                    model = SoloBound(model, _SOLO_PHASES, self._machine)
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

    def ring(axis: str, nbytes: float, all_reduce: bool, times: int = 1, how: str = "exposed") -> None:
        p = grid.axis_size(axis)
        if p > 1:
            key = (axis, how, all_reduce)
            vol[key] = vol.get(key, 0.0) + times * (2.0 if all_reduce else 1.0) * (p - 1) / p * nbytes
            count[key] = count.get(key, 0) + times

    for _, k, n, transposed in model.linear_shapes():
        kl, nl, in_axis, out_axis = linear_dims(grid, k, n, transposed)
        w = km.gemm_time(kl, nl, m, "TN")
        wgrad += w
        compute += fwd_passes * km.gemm_time(m, nl, kl, "NN") + km.gemm_time(m, kl, nl, "NT") + w
        ring(in_axis, ACT_BYTES * m * nl, True, fwd_passes)     # forward (and recomputed) output
        ring(out_axis, ACT_BYTES * m * kl, True, how="oar" if opt.oar else "exposed")  # backward input gradient
        ring("z", ACT_BYTES * kl * nl, False, 2, how="z" if opt.oag else "exposed")  # two gathers
        ring("z", ACT_BYTES * kl * nl, False, 1, how="z" if opt.ors else "exposed")  # one reduce-scatter
        ring("data", GRAD_AR_BYTES * k * n / grid.tensor_size, True)
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
    comm = {a: 0.0 for a in AXES}
    for (a, how, all_reduce), v in vol.items():
        size, stride = grid.axis_size(a), grid.stride(a)
        bw = bandwidth.all_reduce(size, stride) if all_reduce else bandwidth(size, stride)
        t = v / bw + count[a, how, all_reduce] * bandwidth.latency(size, stride)
        per_block[how] += t
        comm[a] += model.layers * t
    exposed = per_block["exposed"] + max(0.0, per_block["oar"] - wgrad) + max(0.0, per_block["z"] - block)
    mem = memory_per_gpu(model, grid, opt, study.batch, study.seq_len, study.profile.activation_bytes).total
    return Candidate(grid, compute + model.layers * exposed, compute, comm, mem)


def study_key(study: Study) -> bytes:
    """Digest of everything a study's results depend on (system, model, GPUs, batch, switches,
    placement, kernel profile and tuning): equal studies share ranked grids and simulations."""
    return digest(pickle.dumps((study.system, study.model, study.gpus, study.batch, study.seq_len,
                                study.options, study.placement, study.profile, study.kernels.tuning)))


def machine_key(study: Study) -> bytes:
    """Digest of what the collective model of a study depends on: system, placement and the kernel
    profile (which may carry measured collective tables)."""
    return digest(pickle.dumps((study.system, study.placement, study.profile)))


_BANDWIDTHS: dict[tuple[bytes, bool], Bandwidth] = {}


def bandwidth_for(study: Study, optimistic: bool = False) -> Bandwidth:
    """The process's probes of the study's machine (`machine_key`: what they measure depends on nothing
    else), exact or optimistic (twin.solobound's bounds on the same probes: nothing routed)."""
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
    return {(g.axis_size(a), g.stride(a)) for g in grids for a in AXES if g.axis_size(a) > 1}


def valid_grids(study: Study) -> list[Grid]:
    """The grids that run the study (candidate_grids that check_grid accepts). Raises TwinError, saying
    why, when none does."""
    valid, reasons = [], []
    for grid in candidate_grids(study.gpus):
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
    analytical model on probes that route nothing (twin.solobound: at least each probe's bandwidths,
    at most its latency; the estimate only grows with times, so it is at most the exact one). Each
    Candidate has `exact` False. This is the order grid auto looks at grids in (twin.simulate)."""
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


KEEP_GRIDS = 24  # programs and collective models kept: a search bounds up to 16 grids, then simulates some
_PROGRAMS: dict[tuple[bytes, str], object] = {}
_MODELS: dict[tuple[bytes, str], object] = {}


def _kept(cache: dict, key, make: Callable[[], object]):
    """cache[key], made by `make()` if missing; the KEEP_GRIDS most recently used entries are kept."""
    value = cache.pop(key, None)
    if value is None:
        value = make()
    cache[key] = value
    if len(cache) > KEEP_GRIDS:
        cache.pop(next(iter(cache)))
    return value


def _program_digest(study: Study) -> bytes:
    return digest(pickle.dumps((study.model, study.options, study.batch, study.seq_len)))


def program_for(study: Study, grid: Grid):
    """The study's program on `grid` (twin.program.build_program), the last few kept for the process:
    the search builds it for a grid's lower bound and then again to simulate it. A grid whose program
    has the same ops as a kept one's (twin.program.same_ops_but_shards) gets that one resized
    (twin.program.regrid: about 40 times cheaper than building it). Treat it as read-only."""
    d = _program_digest(study)

    def make():
        from twin.program import build_program, regrid, same_ops_but_shards
        for (k, name), prog in reversed(_PROGRAMS.items()):
            if k == d and same_ops_but_shards(prog.grid, grid):
                return regrid(prog, grid)
        return build_program(study.model, grid, study.options, study.batch, study.seq_len)

    return _kept(_PROGRAMS, (d, str(grid)), make)


def programs_kept(study: Study) -> list[Grid]:
    """The grids of the study's GPU count whose programs are kept (program_for), oldest first."""
    d = _program_digest(study)
    grids = [Grid.parse(name) for key, name in _PROGRAMS if key == d]
    return [g for g in grids if g.size == study.gpus]


def model_for(study: Study, grid: Grid):
    """The study's collective model on `grid` (twin.study.collective_model), the last few kept for the
    process: a grid's lower bound asks it for contention-free times, the simulation of the grid then
    asks the same model (its flow sets and rates already computed)."""
    return _kept(_MODELS, (machine_key(study), str(grid)), lambda: collective_model(study, grid))


_BOUNDS: dict[tuple[bytes, str], float] = {}


def lower_bound(study: Study, grid: Grid, collectives=None) -> float:
    """A lower bound on the simulated iteration time of `grid` (seconds): the longest path through the
    grid's program when each op takes the least time the engine can give it: a compute op its time
    alone, slowed by the profile's overlap slowdown (>= 1) only while a collective is surely in flight
    (`_path_ns`: where a collective earlier in program order cannot have ended yet), a collective its time on the grid's own collective model with no other axis in flight
    (`time(kind, axis, bytes, concurrent=frozenset())`: every group of its axis at once, latency,
    algorithm choice and all, exactly as the simulation computes it, minus the other axes' traffic).

    Why it bounds the engine's symmetric run from below: the engine starts each op when its stream's
    previous op and its deps are done, and an op that runs at least its least time ends, by induction
    over program order, no earlier than on the longest path (`critical_path_s`). That needs the
    collective model to never make a collective faster because other axes run. With one path per flow
    it does not (under max-min fairness, adding flows cannot raise the slowest rate of a set of flows:
    the link that froze the slowest one fills no later with more flows on it; an axis' routes do not
    depend on what else runs; a time is a minimum over algorithms of latency + bytes / slowest rate).
    A flow split into sub-flows on adaptive paths sums its sub-flows' rates, and there contention
    sometimes helps: up to 7% on some collectives of Alps and Perlmutter, 0.05% on a whole iteration.
    So the search rules a grid out only with a slack (twin.simulate.BOUND_SLACK), and
    `benchmarks/search_exhaustive.py` measures simulated / bound over every grid of several studies.
    (The first block of an axis alone, the ranking's probe, would be cheaper but is no bound: on Alps,
    x groups of 8 across two 4-GPU nodes ran up to 9% slower alone than within the whole grid, whose
    adaptive routing spreads their sub-flows differently.)
    Kept per study and grid for the process."""
    key = (study_key(study), str(grid))
    if collectives is None and key in _BOUNDS:
        return _BOUNDS[key]
    t = _longest_path(study, grid, collectives if collectives is not None else model_for(study, grid))
    if collectives is None:
        _keep_bound(_BOUNDS, key, t)
    return t


_QUICK: dict[tuple[bytes, str], float] = {}
_SOLO_PHASES: dict = {}  # twin.solobound figures of ring sets, by machine, GPU count, size and stride


def quick_bound(study: Study, grid: Grid, like: Grid | None = None) -> float:
    """A lower bound on `lower_bound(study, grid)` (so on the simulated time, seconds) that routes
    nothing: the same longest path, each collective at twin.solobound's bound on its time alone
    (rates from the caps and the links every path of a flow crosses, latencies from those links).
    On Frontier it is the exact bound's wherever rings stay inside a dragonfly group.
    like: read the program of this grid of the same class (`program_class`) and GPU count instead of
    building grid's own (see _longest_path). Kept per study and grid for the process."""
    from twin.solobound import SoloBound
    key = (study_key(study), str(grid))
    t = _QUICK.get(key)
    if t is None:
        model = SoloBound(model_for(study, grid), _SOLO_PHASES, machine_key(study))
        t = _keep_bound(_QUICK, key, _longest_path(study, grid, model, like))
    return t


def program_class(grid: Grid) -> tuple[int, int, bool, bool]:
    """Grids of one class (equal G_x and G_y, G_z > 1 or not, G_data > 1 or not; on a given GPU count
    G_z x G_data is then equal too) have programs with the same ops, streams and deps, each op the
    same size except the data all-reduces of gradient shards (bytes = b // (G_x G_y G_z)) and the
    optimizer's ops (the parameters of a shard), which only shrink as G_z grows
    (tests/test_solobound.py checks it op by op)."""
    return grid.x, grid.y, grid.z > 1, grid.data > 1


def quick_bounds(study: Study, grids: list[Grid]) -> list[float]:
    """quick_bound of each grid, reading one program per class: one already built if there is one (a
    simulated grid's), else that of the class's first grid in `grids` (grid auto passes them best
    estimate first: the likeliest to be bounded and simulated, which builds its program anyway)."""
    like: dict[tuple, Grid] = {}
    for g in programs_kept(study) + grids:
        like.setdefault(program_class(g), g)
    return [quick_bound(study, g, like[program_class(g)]) for g in grids]


def _keep_bound(cache: dict, key, t: float) -> float:
    if len(cache) >= 4096:
        cache.pop(next(iter(cache)))
    cache[key] = t
    return t


def _longest_path(study: Study, grid: Grid, model, like: Grid | None = None) -> float:
    """The longest path through the grid's program (seconds), each collective at
    model.time(..., concurrent=frozenset()), each compute op at its time alone and its overlap
    slowdown where a collective is surely in flight (lower_bound, _path_ns).
    like: a grid of the same program class and GPU count, whose program is read instead: the same ops,
    streams and deps, each op the same size except the data all-reduces of gradient shards, which
    get bytes x P_like // P (at most grid's b // P when like's are b // P_like, P: G_x G_y G_z), and
    the optimizer's ops (the parameters of a shard), which shrink as G_z grows: taken as they are
    where like's G_z is at least grid's, as 0 where it is smaller."""
    prog, ns = _least_ns(study, grid, model, like)
    shape = _shape(prog)
    if shape is not None:
        return _path_ns(shape, ns, study.profile.overlap_slowdown) / NS
    # not in program order (an edited program): the engine handles any order
    from twin.engine import simulate_program
    durations = [t / NS for t in ns]
    return simulate_program(prog, durations, lambda i, _: durations[i], overlap_slowdown=1.0).iteration_s


def _least_ns(study: Study, grid: Grid, model, like: Grid | None = None) -> tuple[object, list[int]]:
    """(the program read, each op's least time in whole ns) for `_longest_path` (see there)."""
    like = grid if like is None else like
    if program_class(like) != program_class(grid) or like.size != grid.size:
        raise ValueError(f"grid {like} cannot stand for grid {grid} in a bound")
    prog = program_for(study, like)
    compute_ns, collectives, optimizer = _compute_ns(study, like, prog)
    none = frozenset()
    scale = like.tensor_size, grid.tensor_size
    ns = list(compute_ns)
    if like.z < grid.z:
        for i in optimizer:
            ns[i] = 0
    times: dict[tuple, int] = {}
    for i, kind, axis, nbytes, shard in collectives:
        key = kind, axis, nbytes * scale[0] // scale[1] if shard else nbytes
        t = times.get(key)
        if t is None:
            t = times[key] = int(model.time(*key, concurrent=none) * NS + 0.5)
        ns[i] = t
    return prog, ns


class _RoutedOrSolo:
    """`time(kind, axis, nbytes)`: the collective model's own time alone where the axis is routed
    already in this process (CollectiveModel.routed), else twin.solobound's bound on it (at most
    that time): a lower bound that routes nothing."""

    def __init__(self, study: Study, grid: Grid, route: tuple[str, ...] = ()):
        from twin.solobound import SoloBound
        self.model = model_for(study, grid)
        self.solo = SoloBound(self.model, _SOLO_PHASES, machine_key(study))
        self.routed = {a: a in route or self.model.routed(a) for a in AXES if grid.axis_size(a) > 1}

    def time(self, kind: str, axis: str, nbytes: int, concurrent: frozenset = frozenset()) -> float:
        return (self.model if self.routed.get(axis) else self.solo).time(kind, axis, nbytes)


_ROUTED: dict[tuple[bytes, str], float] = {}


def routed_bound(study: Study, grid: Grid) -> float:
    """A lower bound on the simulated iteration time of `grid` (seconds) between quick_bound and
    lower_bound, which routes nothing: lower_bound's longest path with each collective of an axis
    not routed yet in this process at twin.solobound's bound. Kept per study and grid for the
    process (lower_bound's instead where that is kept)."""
    key = (study_key(study), str(grid))
    t = _BOUNDS.get(key) or _ROUTED.get(key)
    if t is None:
        t = _keep_bound(_ROUTED, key, _longest_path(study, grid, _RoutedOrSolo(study, grid)))
    return t


def tail_ns(study: Study, grid: Grid) -> list[int] | None:
    """For each op of the grid's program, a lower bound (ns) on the time from its start to the end
    of the simulated iteration: the longest path from it on, each op at its least time as in
    routed_bound (so the same assumption as lower_bound: contention never speeds a collective up,
    checked with the search's slack). The engine's branch and bound
    (twin.engine.simulate_program's stop_ns) stops a run whose clock plus this passes the time to
    beat. None for a program not in program order. The tensor axes are routed for it (a run routes
    them in its first block anyway), the data axis only if it is already (a run reaches it only with
    the gradient all-reduces at the end of the step)."""
    prog, ns = _least_ns(study, grid, _RoutedOrSolo(study, grid, route=("x", "y", "z")))
    shape = _shape(prog)
    if shape is None:
        return None
    stream, deps, n, _ = shape
    tail, after = [0] * len(ns), [0] * len(ns)  # after[i]: the longest tail of an op that waits for op i
    nxt = [0] * n                                # per stream: the tail of its next op
    for i in range(len(ns) - 1, -1, -1):
        s = stream[i]
        t = (nxt[s] if nxt[s] > after[i] else after[i]) + ns[i]
        tail[i] = nxt[s] = t
        for d in deps[i]:
            if t > after[d]:
                after[d] = t
    return tail


_COMPUTE: dict[tuple[bytes, str], tuple] = {}


def _compute_ns(study: Study, grid: Grid, prog) -> tuple[list[int], list[tuple], list[int]]:
    """For `_longest_path` on the grid's program: each op's least time in whole ns as the engine rounds
    it (a compute op its time alone, collectives 0); each collective as (index, kind, axis, bytes,
    whether it is a data all-reduce of a gradient shard); the indices of the optimizer's compute ops.
    Kept for the programs kept (program_for)."""
    key = (study_key(study), str(grid))
    hit = _COMPUTE.get(key)
    if hit is not None and hit[0] is prog:
        return hit[1:]
    km, p = study.kernels, study.profile
    slow = min(1.0, p.overlap_slowdown)  # a factor below 1 would speed overlapped compute up
    # CPU, where each grid runs at its own stretch of the ops' on-CPU time (twin.cores, at least 1):
    # its least time is the on-CPU time, not the pooled stretch the op times hold (GPU: 1, op_time's)
    least = 1.0 / p.stretch if p.node_cores and p.stretch > 0 else 1.0
    ns = [0 if op.is_collective else int(slow * (km.kernel_time(op) * least + p.host_op_s) * NS + 0.5)
          for op in prog.ops]
    colls = [(op.index, op.kind, op.axis, op.bytes, op.axis == "data" and op.weight != "norms")
             for op in prog.ops if op.is_collective]
    optimizer = [op.index for op in prog.ops if op.phase == "opt" and not op.is_collective]
    _COMPUTE[key] = (prog, ns, colls, optimizer)
    if len(_COMPUTE) > KEEP_GRIDS:
        _COMPUTE.pop(next(iter(_COMPUTE)))
    return ns, colls, optimizer


_SHAPES: dict[int, tuple] = {}


def _shape(prog) -> tuple[list[int], list[tuple[int, ...]], int, int] | None:
    """(stream number of each op, its deps, number of streams, the compute stream's number or -1) of a
    program whose ops are in program order (each dep an earlier op), else None. Kept for the last
    few programs."""
    hit = _SHAPES.get(id(prog))
    if hit is not None and hit[0] is prog:
        return hit[1]
    streams: dict[str, int] = {}
    numbers = [streams.setdefault(op.stream, len(streams)) for op in prog.ops]
    ok = all(op.index == i and all(d < i for d in op.deps) for i, op in enumerate(prog.ops))
    shape = (numbers, [tuple(op.deps) for op in prog.ops], len(streams), streams.get("compute", -1)) if ok else None
    _SHAPES[id(prog)] = (prog, shape)  # holds prog, so its id is not reused while kept
    if len(_SHAPES) > KEEP_GRIDS:
        _SHAPES.pop(next(iter(_SHAPES)))
    return shape


def _path_ns(shape, ns: list[int], overlap: float = 1.0) -> int:
    """End of the last op (ns) when op i takes at least ns[i]: each op starts when its stream's previous
    op and its deps are done (`shape`: see _shape). overlap > 1: a compute op is also slowed by that
    factor while a collective is surely in flight (the engine's overlap slowdown), which makes it
    end at least at

        start + w + min(b, w x overlap) x (1 - 1 / overlap),  b = max(0, H - start),

    where w is its least time and H the latest lower bound on the end of a collective earlier in
    program order. Why a collective c earlier than compute op i is in flight from i's start until c
    ends, if c ends later: in the engine's symmetric run, at any time t before c ends, take the
    earliest op in program order among the collectives up to c not done at t. Its compute deps come
    before c in program order, so before i on the one compute stream: done, as i has started; its
    other deps and its stream's earlier ops come earlier in program order: done. So it is ready at t,
    and a ready collective starts at once: it is in flight at t, and the rank is busy. The end above
    grows with start, H and w, so lower bounds on them give a lower bound on the end, and the
    induction over program order holds as without overlap. (1 ns per slowed op is given away
    against the engine's rounding.)"""
    stream, deps, n, compute = shape
    end = [0] * len(ns)
    last = [0] * n
    horizon = 0  # the latest lower bound on the end of a collective so far (ns)
    keep = 1.0 - 1.0 / overlap if overlap > 1.0 else 0.0
    for i, s in enumerate(stream):
        t = last[s]
        for d in deps[i]:
            if end[d] > t:
                t = end[d]
        w = ns[i]
        if s != compute:
            t += w
            if t > horizon:
                horizon = t
        else:
            if keep and horizon > t and w > 0:
                b = horizon - t
                slowed = w * overlap
                extra = int((b if b < slowed else slowed) * keep) - 1
                if extra > 0:
                    w += extra
            t += w
        end[i] = last[s] = t
    return max(last, default=0)


def critical_path_s(prog, durations: list[float]) -> float | None:
    """End of the last op (seconds) when op i takes durations[i] whatever else runs: each op starts
    when its stream's previous op and its deps are done, as in the engine's symmetric mode (times in
    whole nanoseconds, each duration rounded as the engine rounds it). None if a dep is not an
    earlier op (then program order is not an order the ops can run in)."""
    shape = _shape(prog)
    if shape is None:
        return None
    return _path_ns(shape, [int(d * NS + 0.5) for d in durations]) / NS
