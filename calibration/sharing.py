"""How ranks share a CPU node's cores, fitted from the recorded training steps: the steps replayed
through the twin's engine, the collective core load behind each grid's stretch (twin.host.cores), and the
share of its rate a collective keeps while its rank computes (comm_share)."""

from __future__ import annotations

import functools
import math
import statistics

from calibration.lines import collective_line
from calibration.measurements import COLLECTIVES
from calibration.profile_text import entry_text
from topologies import caches

COMM_SHARE_STEP = 0.05  # the grid of comm_share values tried
LOAD_STEP = 0.01  # the grid of collective_core_load values tried
LOAD_MAX = 3.0


@functools.lru_cache(maxsize=None)  # registered below
def recorded_program(model: str, grid: str, options=None):
    """The program a measurement file's recorded steps ran (its model and grid; `options`: the switches,
    twin.program.program.Options, None for the defaults bench records with), host-ordered as the CPU executor
    issues it; built once per (model, grid, options): the fit replays each file many times. Shared:
    callers read it and do not change it."""
    from twin.program.grid import Grid
    from twin.program.model import load_model
    from twin.host.order import host_ordered
    from twin.program.program import Options, build_program
    return host_ordered(build_program(load_model(model), Grid.parse(grid), options or Options()))



caches.register("calibration.sharing.recorded_programs", recorded_program)

def replay_inputs(run: dict, host_s: float, issue_s: float = 0.0, woken: bool = False, options=None):
    """(program, {op name: measured median span, s}, host seconds per op, compute seconds per op) of a
    measurement file's recorded steps, as replay puts them through the engine; None without steps."""
    from twin.host.order import host_times
    if not run.get("steps") or not run.get("model"):
        return None
    prog = recorded_program(run["model"], run["grid"], options)
    secs = {row["name"]: row["seconds"] for row in run["steps"]}
    if woken:
        secs.update({row["name"]: row["seconds"] + max(0.0, row.get("wake_s", 0.0) - host_s)
                     for row in run["steps"] if row["kind"] in COLLECTIVES})
    hosts = host_times(prog.ops, host_s, issue_s)
    compute = [0.0 if op.is_collective else secs.get(op.name, 0.0) + h for op, h in zip(prog.ops, hosts)]
    return prog, secs, hosts, compute


def replay(run: dict, host_s: float, issue_s: float = 0.0, woken: bool = False, options=None):
    """(program, engine result with spans) of a measurement file's recorded steps replayed by the
    twin's engine with every op at its measured median span (compute ops plus the host time between
    them: host_s, and issue_s per collective issued before the op, as twin.host.order.host_times
    charges them), host-ordered as the CPU executor issues them; None without steps. woken: each
    collective also holds the wake-up of the op that waited for it beyond host_s (bench's wake_s),
    as the twin's in-training lines do. options: the program's switches (twin.program.program.Options; None:
    the defaults, which bench records its steps with)."""
    from twin.engine.engine import simulate_program
    inputs = replay_inputs(run, host_s, issue_s, woken, options)
    if inputs is None:
        return None
    prog, secs, _, compute = inputs
    return prog, simulate_program(prog, compute, lambda i, _: secs.get(prog.ops[i].name, 0.0), record=True)


ISSUE_MAX = 0.05  # s: the largest host time per collective issue searched


def replay_gaps(run: dict, host_s: float, issue_s: float) -> float:
    """Seconds per step between consecutive compute ops of the file's recorded steps replayed (replay,
    woken) with `issue_s` of host time per collective issued: the host time, the issues and the
    waits for collectives, as the twin counts them."""
    prog, res = replay(run, host_s, issue_s, woken=True)
    comp = sorted((s, d) for _, i, s, d in res.spans if not prog.ops[i].is_collective)
    kernels = sum(row["seconds"] for row in run["steps"] if row["stream"] == "compute" and row["kind"] not in COLLECTIVES)
    return comp[-1][0] + comp[-1][1] - comp[0][0] - kernels


def measured_gaps(run: dict) -> float | None:
    """Seconds per step between consecutive compute ops of the file's recorded steps (bench's mean gap,
    `mean_s` of its host row, times the gaps of a step); None without them."""
    host = next((row for row in run.get("ops", []) if row["op"] == "host" and "mean_s" in row), None)
    comp = [row for row in run.get("steps", []) if row["stream"] == "compute" and row["kind"] not in COLLECTIVES]
    if host is None or len(comp) < 2:
        return None
    return host["mean_s"] * (len(comp) - 1)


def issue_cost(runs: list[dict], host_s: float) -> tuple[float, str] | None:
    """(seconds, how): the host time per collective issue (HostSharing.issue_s) that makes the recorded
    steps of `runs` (one rank count's measurement files), replayed through the twin's engine with
    their measured spans (replay_gaps: host_s per compute op, each collective's span and wake-up),
    spend the time between their compute ops that bench measured (measured_gaps), summed over the
    files with collectives: what the replay misses is what issuing a collective costs the issuing
    host (on a CPU, the buffers it fills and gloo's thread taking the rank's core as it wakes to the
    transfer: on the 2-core development VM a gap of 1x1x2x1 in which a z collective was issued took
    0.70 ms against 0.18 ms for a gap with none). Used where the files did not record the issue
    time itself (`issue_s`: issue_measured). 0 where the replay already spends as much (a
    burst of collectives issued together); None without files that recorded gaps and collectives."""
    use = [r for r in runs if measured_gaps(r) is not None
           and any(row["kind"] in COLLECTIVES for row in r.get("steps", []))]
    if not use:
        return None
    target = sum(measured_gaps(r) for r in use)

    def replayed(c: float) -> float:
        return sum(replay_gaps(r, host_s, c) for r in use)

    lo, hi = 0.0, ISSUE_MAX
    at0 = replayed(0.0)
    if at0 >= target:
        lo = hi = 0.0
    for _ in range(30 if hi > 0 else 0):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if replayed(mid) < target else (lo, mid)
    c = (lo + hi) / 2
    n = sum(1 for r in use for row in r["steps"] if row["kind"] in COLLECTIVES)
    return c, (f"fitted: the host time per collective issued that makes the replay of the recorded training "
               f"steps (their measured spans and wake-ups, {host_s * 1e6:.0f} us per compute op) spend the "
               f"{target * 1e3:.1f} ms between compute ops per step that bench measured (mean gap x gaps), "
               f"summed over {len(use)} file(s) with {n} collectives per step; {at0 * 1e3:.1f} ms without it")


def _issue_times(runs: list[dict], pick) -> list[float]:
    """The recorded `issue_s` (seconds) of the collectives `pick(program)` gives, over the files'
    recorded steps (the program each file's steps ran)."""
    times: list[float] = []
    for r in runs:
        issue = {row["name"]: row["issue_s"] for row in r.get("steps", []) if "issue_s" in row}
        if not issue or not r.get("model"):
            continue
        times += [issue[c.name] for c in pick(recorded_program(r["model"], r["grid"])) if c.name in issue]
    return times


def issue_measured(runs: list[dict]) -> tuple[float, str] | None:
    """(seconds, how): the host time per collective issued (HostSharing.issue_s) as bench measured it:
    the mean `issue_s` (the host's wall time from preparing a collective's buffers to the return of
    its asynchronous call) over the collectives of the files' recorded steps that the compute op
    after them does not wait for (twin.host.order.charged_issues, the ones host_times charges). None
    where no file recorded it."""
    from twin.host.order import charged_issues
    times = _issue_times(runs, lambda prog: [c for cs in charged_issues(prog.ops).values() for c in cs])
    if not times:
        return None
    return statistics.fmean(times), (f"measured: mean host time of issuing a collective (its buffers and the "
                                     f"asynchronous call) over the {len(times)} collectives of recorded training "
                                     f"steps that the compute op after them does not wait for")


def exchange_measured(runs: list[dict]) -> tuple[float, str] | None:
    """(seconds, how): the host time of an MoE dispatch that exchanges its row counts first
    (HostSharing.exchange_s; twin.host.order.count_exchange) as bench measured it: the mean `issue_s`
    of those dispatches in the files' recorded steps (the exchange, a synchronous all-to-all of ints,
    and the rows' asynchronous issue). None where no file recorded one (a dense model, or files
    written before bench took the all-to-alls for collectives)."""
    from twin.host.order import count_exchange
    times = _issue_times(runs, lambda prog: [op for op in prog.ops if op.is_collective and count_exchange(op)])
    if not times:
        return None
    return statistics.fmean(times), (f"measured: mean host time of issuing an MoE dispatch that exchanges its row "
                                     f"counts first (a synchronous all-to-all of ints, then the rows' asynchronous "
                                     f"call) over the {len(times)} such dispatches of recorded training steps")


def replayed_overlap(run: dict, host_s: float) -> dict[str, float]:
    """Per collective of a measurement file's recorded steps, the seconds its rank's compute stream ran
    an op during its span, in the replay of the steps (replay). {} without steps."""
    replayed = replay(run, host_s)
    if replayed is None:
        return {}
    prog, res = replayed
    busy = sorted((s, s + d) for _, i, s, d in res.spans if not prog.ops[i].is_collective)
    out = {}
    for _, i, s, d in res.spans:
        if prog.ops[i].is_collective:
            out[prog.ops[i].name] = sum(max(0.0, min(s + d, b) - max(s, a)) for a, b in busy)
    return out


def sharing_point(run: dict, host_s: float, issue_s: float = 0.0, spread: dict[str, float] | None = None):
    """(grid, ranks, cores, stretch, busy shares) of one file's recorded steps for core_load: the
    stretch of its compute ops (summed span over summed on-CPU time) and twin.host.cores.busy_shares of
    their replay (host_s per compute op and issue_s per collective issued, as the twin charges them,
    left out of the compute share; with `spread`, the profile's span_spread for its rank count, the
    mean shares of the replays with spans drawn as twin.host.spread draws them, as the twin times a step);
    None where a compute op lacks its on-CPU time or the machine its core count."""
    from twin.host.cores import busy_shares
    from twin.engine.engine import simulate_program
    from twin.host.spread import drawn_runs, mean_shares
    comp = [row for row in run.get("steps", []) if row["stream"] == "compute" and row["kind"] not in COLLECTIVES]
    cores = run["machine"].get("cores")
    if not comp or not cores or not all("cpu_s" in row for row in comp):
        return None
    cpu = sum(row["cpu_s"] for row in comp)
    inputs = replay_inputs(run, host_s, issue_s)
    if cpu <= 0 or inputs is None:
        return None
    prog, secs, hosts, compute = inputs
    span = lambda i, _: secs.get(prog.ops[i].name, 0.0)  # noqa: E731
    if spread:
        runs = drawn_runs(prog, compute, hosts, span, spread, simulate_program, record=True)
    else:
        runs = [simulate_program(prog, compute, span, record=True)]
    shares = mean_shares([busy_shares(r.spans, lambda i: prog.ops[i].is_collective, hosts.__getitem__) for r in runs])
    return run["grid"], run["ranks_per_node"], int(cores), sum(row["seconds"] for row in comp) / cpu, shares


def core_load(points: list[tuple[str, int, int, float, tuple]], src: str) -> list[str]:
    """The top-level lines node_cores and collective_core_load (twin.host.cores): the load (share of a
    core a collective in flight keeps busy) whose model stretch best matches the recorded steps'
    measured stretch (summed span over summed on-CPU time of the compute ops), least squares on
    the log of the ratio, over the files with 2 or more ranks; the busy shares from the steps'
    replay through the twin's engine. points: (grid, ranks, cores, stretch, shares). [] without
    points, or where the files disagree on the node's cores."""
    from twin.host.cores import core_stretch
    cores = {c for _, _, c, _, _ in points}
    if not points or len(cores) != 1:
        return []
    best = (math.inf, 0.0)
    for k in range(int(round(LOAD_MAX / LOAD_STEP)) + 1):
        load = k * LOAD_STEP
        err = sum(math.log(core_stretch(r, c, load, *sh) / s) ** 2 for _, r, c, s, sh in points)
        if err < best[0] - 1e-12:
            best = (err, load)
    load = best[1]
    res = sorted((g, core_stretch(r, c, load, *sh) / s - 1.0) for g, r, c, s, sh in points)
    worst = max(res, key=lambda t: abs(t[1]))
    return ["node_cores = " + entry_text(cores.pop(), f"measured: os.cpu_count() of the bench machine, {src}"),
            "collective_core_load = " + entry_text(load, (
                f"fitted: the share of a core a collective in flight keeps busy (twin.host.cores) that reproduces the "
                f"stretch (summed span over summed on-CPU time of the compute ops) of the recorded training steps "
                f"of {len(points)} grids of 2 or more ranks, from their busy shares replayed through the engine; "
                f"least squares on log(model/measured), median |residual| "
                f"{statistics.median(abs(e) for _, e in res):.0%}, worst {worst[1]:+.0%} ({worst[0]}), {src}"))]


def measured_share(group: list[dict]) -> tuple[float, int] | None:
    """(share, rows): the share of its rate an all-reduce keeps while a GEMM runs on its rank, from
    bench's overlap rows that timed the all-reduce alone (C) and beside the GEMM (S, issue to
    completion, the GEMM taking G): progressing at `share` during the GEMM and at full rate after it,
    share = C / S where it finished under the GEMM, else (C - (S - G)) / G; the median over the rows,
    kept in [0.05, 1]. None where no row timed the all-reduce (files before bench did)."""
    shares = []
    for r in group:
        for row in r.get("overlap", []):
            c, s, g = row.get("comm_alone_s"), row.get("comm_overlapped_s"), row["overlapped_s"]
            if c and s:
                shares.append(c / s if s <= g else (c - (s - g)) / g)
    if not shares:
        return None
    return min(1.0, max(0.05, statistics.median(shares))), len(shares)


def comm_share(rows: list[tuple[dict, dict]], covered: dict[int, dict[str, float]], host_s: float,
                act_bytes: int, share: float | None = None) -> tuple[float, dict[int, float]]:
    """(share, {id(row): seconds}) : the share of its rate a collective keeps while its rank's compute
    runs (CPU: gloo's threads and the compute share the cores), and each recorded collective's span
    less what it lost to the compute beside it, (1 - share) x its compute-covered seconds. The share
    is the one whose per-(kind, axis, group) lines (as collective_line fits them) leave the least
    squared residual relative to the squared times (a scale-free criterion: taking time away shrinks
    the residuals too). 1 when no recorded collective had compute beside it. `share`: a measured one
    (bench's overlap rows), used as it is."""
    from twin.program.grid import Grid
    from twin.costs.profile_types import payload_bytes
    pts: dict[tuple, list[tuple[int, float, float, float]]] = {}
    for r, row in rows:
        if row["kind"] not in COLLECTIVES:
            continue
        grid = Grid.parse(r["grid"])
        real = payload_bytes(row["axis"], row["bytes"], act_bytes)
        woke = max(0.0, row.get("wake_s", 0.0) - host_s)
        o = min(covered.get(id(r), {}).get(row["name"], 0.0), row["seconds"])
        pts.setdefault((row["kind"], row["axis"], grid.axis_size(row["axis"]), grid.stride(row["axis"])),
                       []).append((id(row), real, row["seconds"], o, woke))
    best = (math.inf, 1.0 if share is None else share)
    if share is None and any(o > 0 for v in pts.values() for *_, o, _ in v):
        for k in range(int(round(1 / COMM_SHARE_STEP))):
            share = 1.0 - k * COMM_SHARE_STEP
            sse = norm = 0.0
            for v in pts.values():
                x = [real for _, real, *_ in v]
                t = [s - (1 - share) * o + w for _, _, s, o, w in v]
                a, b, _ = collective_line(x, t)
                sse += sum((a + b * xx - tt) ** 2 for xx, tt in zip(x, t))
                norm += sum(tt * tt for tt in t)
            if norm > 0 and sse / norm < best[0] - 1e-12:
                best = (sse / norm, share)
    share = best[1]
    return share, {i: s - (1 - share) * o for v in pts.values() for i, _, s, o, _ in v}
