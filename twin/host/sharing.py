"""The host model: one iteration of a program whose ranks share a node's cores (CPU ranks).

A GPU's host only queues kernels ahead of its device, so a GPU study's profile has no host part
(`Profile.host is None`) and twin.predict.simulate runs the engine on the kernels' times alone.
Where the host is the device, three things change, and `simulate_shared` is the one place that
knows them:
- the host runs the program in order (twin.host.order.host_ordered) and its own time between ops
  (dispatch, collective issues) delays the compute op after it (twin.host.order.host_times);
- more ranks than cores time-slice the cores, so a compute op takes `stretch` times its on-CPU
  time, a fixed point of the grid's own timeline (twin.host.cores);
- the spans vary from rank to rank, and the iteration is the mean over spans drawn at their
  measured spread (twin.host.spread); a collective progresses at `comm_share` of its rate while its
  rank computes (the engine's comm_slowdown).
"""

from __future__ import annotations

from twin.costs.collectives import collective_timer
from twin.costs.profile_types import HostSharing
from twin.engine.engine import EngineResult, simulate_program
from twin.host.cores import busy_shares, core_stretch, fixed_point, stretch_floor
from twin.host.order import host_ordered, host_times
from twin.host.spread import drawn_runs, mean_result, mean_shares
from twin.program.grid import Grid
from twin.program.program import Program

STRETCH_ROUNDS = 20  # at most this many simulations to settle a grid's stretch (1-4 in practice)


def as_run(host: HostSharing, program: Program) -> Program:
    """The program as the host runs it: in program order where the host is the device."""
    return host_ordered(program) if host.ordered else program


def simulate_shared(study, grid: Grid, prog: Program, collectives, *, full: bool = False,
                    slowdown: dict[int, float] | None = None, record: bool = False, stop_ns: int = 0,
                    tails=None, tick=None) -> EngineResult:
    """One iteration of `prog` (already as the host runs it: `as_run`) on ranks that share their
    node's cores, as the engine's result (seconds). `collectives`: the collective model
    (.time(kind, axis, nbytes, concurrent) -> seconds); stop_ns and `tails` (a callable giving the
    engine's tail_ns, asked only where the run is not drawn) and `tick` as twin.engine.engine.simulate_program."""
    host, km = study.profile.host, study.kernels
    hosts = host_times(prog.ops, host.op_s, host.issue_s, host.exchange_s)
    timer = collective_timer(prog, collectives)
    stretch, settled_runs = settled_stretch(study, grid, prog, hosts, timer)
    compute_s = compute_times(prog, km, host.stretch, stretch, hosts)
    drawn = stretch is not None and bool(host.span_spread)  # the mean over spans drawn at their spread
    tail = tails() if stop_ns and tails is not None and not drawn else None
    engine_kw = dict(full=full, slowdown=slowdown, overlap_slowdown=study.profile.overlap_slowdown,
                     comm_slowdown=1.0 / host.comm_share)
    res = simulate_program(prog, compute_s, timer, record=record, stop_ns=stop_ns if tail is not None else 0,
                           tail_ns=tail, by_size=True, tick=tick, **engine_kw)
    if drawn:  # the stretch's last draws are these where they ran in the same mode (symmetric)
        runs = settled_runs if settled_runs and not full else \
            drawn_runs(prog, compute_s, hosts, timer, host.span_spread, simulate_program, **engine_kw)
        res = mean_result(res, runs)
    return res


def shared_core_stretch(study, grid: Grid, prog: Program, collectives) -> float | None:
    """How many times its on-CPU time a compute op of this grid takes while its ranks share the node's
    cores (twin.host.cores), or None where the profile does not model it (no node cores measured):
    every grid then takes the profile's pooled `stretch`, which its compute op times hold. The busy
    shares come from the twin's own timeline, which the stretch lengthens: the fixed point, from the
    pooled stretch by twin.host.cores.fixed_point (each evaluation one symmetric simulation, or where
    the profile has a `span_spread` the mean shares of twin.host.spread's draws). `prog` as the host
    runs it (`as_run`)."""
    host = study.profile.host
    return settled_stretch(study, grid, prog, host_times(prog.ops, host.op_s, host.issue_s, host.exchange_s),
                           collective_timer(prog, collectives))[0]


def least_compute_s(host: HostSharing | None, kernel_s: float) -> float:
    """The least time (seconds) a compute op whose kernel takes `kernel_s` at the profile's pooled
    stretch can take on any grid: at its on-CPU time where each grid has its own stretch (at least 1),
    plus the host time before it. `kernel_s` itself without a host part."""
    if host is None:
        return kernel_s
    least = 1.0 / host.stretch if host.node_cores and host.stretch > 0 else 1.0
    return kernel_s * least + host.op_s


def compute_times(prog: Program, km, pooled: float, stretch: float | None, hosts: list[float]) -> list[float]:
    """Each op's compute time (seconds; 0 for a collective): its kernel time, which holds the profile's
    `pooled` stretch, at this grid's own `stretch` (None: as it is), plus the host time before it."""
    scale = 1.0 if stretch is None else stretch / pooled
    return [0.0 if op.is_collective else km.kernel_time(op) * scale + h for op, h in zip(prog.ops, hosts)]


def settled_stretch(study, grid: Grid, prog: Program, hosts: list[float],
                    timer) -> tuple[float | None, list | None]:
    """shared_core_stretch, and the engine results of twin.host.spread's draws at it (symmetric mode;
    None where the profile has no `span_spread`): simulate_shared's mean over draws, already run.
    hosts: each op's host time before it (seconds, host_times); timer: collective_timer."""
    host = study.profile.host
    ranks = min(grid.size, study.system.gpus_per_node)
    if not (host.node_cores and host.stretch > 0) or ranks < 2:
        return None, None
    km = study.kernels
    floor = stretch_floor(ranks, host.node_cores, host.stretch)
    engine_kw = dict(overlap_slowdown=study.profile.overlap_slowdown, record=True,
                     comm_slowdown=1.0 / host.comm_share)
    last: dict[float, list] = {}  # the stretch last mapped -> its draws

    def mapped(stretch: float) -> float:  # the stretch that the shares of a timeline at `stretch` give
        compute = compute_times(prog, km, host.stretch, stretch, hosts)
        if host.span_spread:  # twin.host.spread: the mean shares over spans drawn at their spread
            runs = drawn_runs(prog, compute, hosts, timer, host.span_spread, simulate_program, **engine_kw)
        else:
            runs = [simulate_program(prog, compute, timer, by_size=True, **engine_kw)]
        shares = mean_shares([busy_shares(r.spans, lambda i: prog.ops[i].is_collective, hosts.__getitem__)
                              for r in runs])
        last.clear()
        last[stretch] = runs
        return core_stretch(ranks, host.node_cores, host.collective_core_load, *shares, floor)

    stretch = fixed_point(mapped, host.stretch, rounds=STRETCH_ROUNDS)
    return stretch, last.get(stretch) if host.span_spread else None
