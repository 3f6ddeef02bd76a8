"""Lower bounds on a grid's simulated iteration time (seconds), by which grid auto's bound search
(twin.predict.simulate) rules grids out without simulating them: `lower_bound`, the longest path through the
grid's program with each op at the least time the engine can give it (a collective its time alone on
the grid's own collective model; why that bounds the engine is its docstring); `routed_bound`, the
same with each collective of an axis not routed yet at twin.costs.solobound's bound; `quick_bound(s)`,
every collective at that bound (quick <= routed <= lower <= simulated, nothing routed for the first
two); and `tail_ns`, the least time from each op's start to the end of the iteration, for the
engine's branch and bound (twin.engine.engine.simulate_program's stop_ns)."""

from __future__ import annotations

from topologies import caches
from twin.engine.engine import NS
from twin.host.sharing import least_compute_s
from twin.program.grid import AXES, Grid
from twin.predict.study import Study
from twin.predict.study_cache import KEEP_GRIDS, SOLO_PHASES, machine_key, model_for, program_for, programs_kept, study_key


# (study_key, grid) -> lower_bound (s): the last 4,096
_BOUNDS: dict[tuple[bytes, str], float] = caches.register("twin.predict.bounds.lower", {})


def lower_bound(study: Study, grid: Grid, collectives=None) -> float:
    """A lower bound on the simulated iteration time of `grid` (seconds): the longest path through the
    grid's program when each op takes the least time the engine can give it: a compute op its time
    alone, slowed by the profile's overlap slowdown (>= 1) only while a collective is surely in flight
    (`_path_ns`: where a collective earlier in program order cannot have ended yet), a collective its time on the grid's own collective model with no other axis in flight
    (`time(kind, axis, bytes, concurrent=frozenset())`: every group of its axis at once, latency,
    algorithm choice and all, exactly as the simulation computes it, minus the other axes' traffic).

    Why it bounds the engine's symmetric run from below: the engine starts each op when its stream's
    previous op and its deps are done, and an op that runs at least its least time ends, by induction
    over program order, no earlier than on the longest path (`_path_ns`). That needs the
    collective model to never make a collective faster because other axes run. With one path per flow
    it does not (under max-min fairness, adding flows cannot raise the slowest rate of a set of flows:
    the link that froze the slowest one fills no later with more flows on it; an axis' routes do not
    depend on what else runs; a time is a minimum over algorithms of latency + bytes / slowest rate).
    A flow split into sub-flows on adaptive paths sums its sub-flows' rates, and there contention
    sometimes helps: up to 7% on some collectives of Alps and Perlmutter, 0.05% on a whole iteration.
    So the search rules a grid out only with a slack (twin.predict.auto.BOUND_SLACK), and
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


# (study_key, grid) -> quick_bound (s): the last 4,096
_QUICK: dict[tuple[bytes, str], float] = caches.register("twin.predict.bounds.quick", {})


def quick_bound(study: Study, grid: Grid, like: Grid | None = None) -> float:
    """A lower bound on `lower_bound(study, grid)` (so on the simulated time, seconds) that routes
    nothing: the same longest path, each collective at twin.costs.solobound's bound on its time alone
    (rates from the caps and the links every path of a flow crosses, latencies from those links).
    On Frontier it is the exact bound's wherever rings stay inside a dragonfly group.
    like: read the program of this grid of the same class (`program_class`) and GPU count instead of
    building grid's own (see _longest_path). Kept per study and grid for the process."""
    from twin.costs.solobound import SoloBound
    key = (study_key(study), str(grid))
    t = _QUICK.get(key)
    if t is None:
        model = SoloBound(model_for(study, grid), SOLO_PHASES, machine_key(study))
        t = _keep_bound(_QUICK, key, _longest_path(study, grid, model, like))
    return t


def program_class(grid: Grid) -> tuple[int, int, bool, bool]:
    """Grids of one class (equal G_x and G_y, G_z > 1 or not, G_data > 1 or not; on a given GPU count
    G_z x G_data is then equal too) have programs with the same ops, streams and deps, each op the
    same size except the data all-reduces of gradient shards (bytes = b // (G_x G_y G_z)) and the
    optimizer's ops (the parameters of a shard), which only shrink as G_z grows
    (tests/test_solobound.py checks it op by op)."""
    return grid.x, grid.y, grid.z > 1, grid.data > 1, grid.expert, grid.edata > 1  # the expert axes: twin/program/moe.py


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
    from twin.engine.engine import simulate_program
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
    already in this process (CollectiveModel.routed), else twin.costs.solobound's bound on it (at most
    that time): a lower bound that routes nothing."""

    def __init__(self, study: Study, grid: Grid, route: tuple[str, ...] = ()):
        from twin.costs.solobound import SoloBound
        self.model = model_for(study, grid)
        self.solo = SoloBound(self.model, SOLO_PHASES, machine_key(study))
        self.routed = {a: a in route or self.model.routed(a) for a in AXES if grid.axis_size(a) > 1}

    def time(self, kind: str, axis: str, nbytes: int, concurrent: frozenset = frozenset()) -> float:
        if axis in ("expert", "edata"):  # the MoE collectives: exact where laid out already, else 0 (solo bound)
            from twin.costs.alltoall import laid_out
            return (self.model if laid_out(self.model, kind, axis) else self.solo).time(kind, axis, nbytes)
        return (self.model if self.routed.get(axis) else self.solo).time(kind, axis, nbytes)


# (study_key, grid) -> routed_bound (s): the last 4,096
_ROUTED: dict[tuple[bytes, str], float] = caches.register("twin.predict.bounds.routed", {})


def routed_bound(study: Study, grid: Grid) -> float:
    """A lower bound on the simulated iteration time of `grid` (seconds) between quick_bound and
    lower_bound, which routes nothing: lower_bound's longest path with each collective of an axis
    not routed yet in this process at twin.costs.solobound's bound. Kept per study and grid for the
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
    (twin.engine.engine.simulate_program's stop_ns) stops a run whose clock plus this passes the time to
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


# (study_key, grid) -> (program, least ns of each op, its collectives, optimizer ops) (_compute_ns): KEEP_GRIDS
_COMPUTE: dict[tuple[bytes, str], tuple] = caches.register("twin.predict.bounds.compute", {})


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
    # where ranks share their cores, an op's least time is the host model's (twin.host.sharing)
    ns = [0 if op.is_collective else int(slow * least_compute_s(p.host, km.kernel_time(op)) * NS + 0.5)
          for op in prog.ops]
    colls = [(op.index, op.kind, op.axis, op.bytes, op.axis in ("data", "edata") and op.weight not in ("norms", "routers"))
             for op in prog.ops if op.is_collective]
    optimizer = [op.index for op in prog.ops if op.phase == "opt" and not op.is_collective]
    _COMPUTE[key] = (prog, ns, colls, optimizer)
    if len(_COMPUTE) > KEEP_GRIDS:
        _COMPUTE.pop(next(iter(_COMPUTE)))
    return ns, colls, optimizer


# id(program) -> (program, its streams and deps) (_shape): the last KEEP_GRIDS programs
_SHAPES: dict[int, tuple] = caches.register("twin.predict.bounds.shapes", {})


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

