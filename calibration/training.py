"""The fits of the recorded training steps (calibration.fit's docstring): what ops cost inside training,
per rank count: op-cost lines of the compute kinds without a model of their own, in-training GEMM
points, attention efficiency, compute contention, overlap slowdown, the collectives' in-training lines
and slowdowns, comm_share and the collective core load."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from calibration.lines import Residual, alone_point, collective_line, cost_line, excess_line, residual
from calibration.measurements import COLLECTIVES, COVERED, MODELED, describe
from calibration.profile_text import entry_text, number_text, quoted
from calibration.sharing import (COMM_SHARE_STEP, comm_share, core_load, exchange_measured, issue_cost, issue_measured,
                                 measured_share, replayed_overlap, sharing_point)
from twin.costs.profile import load_profile


def in_training(by_ranks: dict[int, list[dict]], toml: str, shares: list[str], share_at: dict[int, int],
                residuals: list[Residual], gemms: list[str], head: list[str]) -> list[str]:
    """The fits of the recorded training steps (calibration.fit's docstring): returns the `[[collective_training]]`
    and `[[op_cost]]` blocks, appends the in-training `[[gemm_table]]` points to `gemms` and adds
    compute_contention, overlap_slowdown and collective_slowdown to the `[[node_share]]` blocks of
    `shares` (in place)."""
    if not any(r.get("steps") for g in by_ranks.values() for r in g):
        return []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "partial.toml"
        path.write_text(toml)
        micro = load_profile(str(path))  # the profile as the microbenchmarks alone fit it
    from twin.program.grid import Grid
    from twin.costs.kernels import KernelModel
    from twin.costs.profile_types import payload_bytes
    costs: list[str] = []
    trained: list[str] = []
    pooled = pooled_cpu_lines(by_ranks)
    sharing: list[tuple[str, int, int, float, tuple]] = []  # per file: what core_load fits
    for ranks, group in sorted(by_ranks.items()):
        runs = [r for r in group if r.get("steps")]
        if not runs:
            continue
        src = "; ".join(describe(r) for r in runs)
        prof = micro.for_ranks(ranks)
        host_s = prof.host.op_s if prof.host else 0.0  # the host time per compute op (s)
        km = KernelModel(prof, tuning=False)
        rows = [(r, row) for r in runs for row in r["steps"]]
        span, how_timed, stretch = fluid_spans(rows, ranks)
        src_t = f"{src}; {how_timed}"
        # the host time per collective issued: measured where bench recorded it (issue_s); in older
        # files fitted to bench's gaps, where the ranks do not outnumber the cores
        cores = {r["machine"].get("cores") for r in runs}
        fits_cores = len(cores) == 1 and None not in cores and ranks <= int(cores.pop())
        issued = None
        if micro.host is not None and micro.host.ordered:
            issued = issue_measured(runs) or (issue_cost(runs, host_s) if fits_cores else None)
        spread = span_spread(runs) if stretch is not None and ranks > 1 else {}
        if stretch is not None and ranks > 1:
            sharing += [p for p in (sharing_point(r, host_s, issued[0] if issued else 0.0, spread)
                                    for r in runs) if p is not None]
        # op kinds without a model of their own: measured lines, per kind and per role
        keyed: dict[tuple[str, str], list[dict]] = {}
        roles = {id(r): cost_roles(r) for r in runs}
        for r, row in rows:
            if row["stream"] == "compute" and row["kind"] not in MODELED:
                keyed.setdefault((row["kind"], ""), []).append(row)
                if row.get("role"):
                    keyed.setdefault((row["kind"], roles[id(r)].get(row["name"], row["role"])), []).append(row)
        for (kind, role), sel in sorted(keyed.items()):
            alone = [row for row in sel if row.get("covered", 0) < COVERED] or sel
            what = f"{kind}{'/' + role if role else ''}"
            shared = pooled.get((kind, role)) if stretch is not None and ranks > 1 else None
            if shared is not None and len({row["bytes"] for row in alone}) < 2 and all("cpu_s" in row for row in alone):
                # one size cannot tell latency from bandwidth: the on-CPU line over every rank count's
                # sizes, at this rank count's level, x its stretch
                (a0, b0, n_pts, lo, hi), level = shared, cpu_level(shared, alone)
                a, b = a0 * level * stretch, b0 * level * stretch
                res = [(a + b * row["bytes"]) / span(row) - 1.0 for row in alone]
                how = (f"fitted: on-CPU time of {n_pts} {what} op(s) of recorded training steps with 2 or more ranks "
                       f"(bytes {lo}-{hi}, latency + bytes/bandwidth), x {level:.3f} (the {len(alone)} ops with "
                       f"{ranks} ranks over that line) x stretch {stretch:.3f}, worst residual "
                       f"{max(map(abs, res)):.0%}, {src_t}")
            else:
                a, b, res = cost_line([row["bytes"] for row in alone], [span(row) for row in alone])
                how = (f"fitted: {len(alone)} {what} op(s) of recorded training steps, bytes "
                       f"{min(r['bytes'] for r in alone)}-{max(r['bytes'] for r in alone)}, worst residual "
                       f"{max(map(abs, res)):.0%}, {src_t}")
            residuals.append(residual(f"{ranks} rank(s): {what} ops in training, latency + bytes/bandwidth", res))
            costs.append("\n".join([
                "[[op_cost]]", f'kind = "{quoted(kind)}"', f'role = "{quoted(role)}"', f"ranks = {ranks}",
                "latency_s = " + entry_text(max(a, 1e-9), how),
                "bandwidth = " + entry_text(1.0 / b if b > 0 else 1e15, how + ("" if b > 0 else "; no size effect seen")),
                ""]))
        if ranks not in share_at:
            continue
        # GEMMs inside training, per shape (no collective overlapping): the kernel model prefers these
        shapes: dict[tuple, list[float]] = {}
        for _, row in rows:
            if row["kind"] == "gemm" and row.get("covered", 0) < COVERED:
                shapes.setdefault((row["m"], row["n"], row["k"], row["layout"] or "NN"), []).append(span(row))
        for (m, n, k, lay), secs in sorted(shapes.items()):
            t = statistics.median(secs)
            gemms.append("\n".join([
                "[[gemm_table]]", f"m = {m}", f"n = {n}", f"k = {k}", f'layout = "{lay}"', f"ranks = {ranks}",
                "training = true", "flops = " + entry_text(2.0 * m * n * k / t, (
                    f"measured: median span {t * 1e6:.1f} us of {len(secs)} such GEMM(s) no collective overlapped "
                    f"in recorded training steps, {src_t}")), ""]))
        lines = []
        if stretch is not None:
            lines.append("stretch = " + entry_text(stretch, (
                f"measured: summed span over summed on-CPU time of the compute ops of recorded training "
                f"steps (the in-training op times below are on-CPU time x this), {src}")))
        if spread:
            lines.append("span_spread = { " + ", ".join(f"{k} = {number_text(v)}" for k, v in spread.items())
                         + f', source = "measured: the coefficient of variation of an op\'s span over the ranks and steps '
                         f"of recorded training steps (bench's spread), per class of op (compute; a collective's kind "
                         f'and axis; every collective), the median over the files of each file\'s median, {quoted(src)}" }}')
        # attention: its efficiency inside training (of the rank's peak) replaces the microbenchmark's
        for phase, bwd in (("fwd", False), ("bwd", True)):
            att = [row for _, row in rows if row["kind"] == "attention" and row["name"].endswith(".bwd") == bwd
                   and row.get("covered", 0) < COVERED and row["flops"] > 0]
            if att:
                eff = statistics.median(row["flops"] / (prof.peak_flops * span(row)) for row in att)
                lines.append(f"attention_{phase}_efficiency = " + entry_text(eff, (
                    f"measured: causal attention {'backward' if bwd else 'forward'} inside recorded training steps, "
                    f"median over {len(att)} ops no collective overlapped, of the peak scaled by compute_scale, {src_t}")))
        # GEMMs: inside training against the microbenchmarks
        modeled = [(row, micro_time(km, row)) for _, row in rows if row["kind"] == "gemm"]
        alone = [(row, t) for row, t in modeled if row.get("covered", 0) < COVERED]
        over = [(row, t) for row, t in modeled if row.get("covered", 0) >= COVERED]
        contention = sum(span(r) for r, _ in alone) / sum(t for _, t in alone) if alone else 1.0
        if alone:
            lines.append("compute_contention = " + entry_text(contention, (
                f"measured: GEMM time of {len(alone)} ops no collective overlapped in recorded "
                f"training steps, over their microbenchmark-fitted time, {src_t}")))
        paired = same_shape_slowdown([(r, row) for r, row in rows if row["kind"] == "gemm"], span) \
            if stretch is not None else None  # like with like
        if paired is not None:
            slow, n_pairs = paired
            lines.append("overlap_slowdown = " + entry_text(slow, (
                f"measured: GEMMs a collective overlapped in recorded training steps over GEMMs of the same shape "
                f"none overlapped in the same file, median over {n_pairs} (file, shape) pairs of the ratio of their "
                f"median times (at least 1), "
                f"{src_t}")))
        elif len(over) >= 3:
            slow = max(1.0, sum(span(r) for r, _ in over) / sum(t for _, t in over) / contention)
            lines.append("overlap_slowdown = " + entry_text(slow, (
                f"measured: GEMM time of {len(over)} ops a collective overlapped in recorded training "
                f"steps, over their microbenchmark-fitted time x compute_contention (at least 1), {src_t}")))
        table = prof.collectives()
        ratios = []
        per_axis: dict[str, list[float]] = {}  # axis -> [inside training, alone] seconds summed
        lines_of: dict[tuple, list[tuple[dict, float, float]]] = {}  # (kind, axis, p, stride) -> (file, real bytes, s)
        covered = {id(r): replayed_overlap(r, host_s) for r in runs}  # collective -> s its rank computed
        measured = measured_share(group)
        share, spans = comm_share(rows, covered, host_s, micro.activation_bytes,
                                   None if measured is None else measured[0])
        for r, row in rows:
            if row["kind"] not in COLLECTIVES:
                continue
            grid = Grid.parse(r["grid"])
            p, stride = grid.axis_size(row["axis"]), grid.stride(row["axis"])
            real = payload_bytes(row["axis"], row["bytes"], micro.activation_bytes)
            # the compute op that waited for it resumes `wake_s` after its completion, of which the twin
            # charges that op's host time already (host_s)
            # (less, with comm_share < 1, the part of its span it lost to its rank's compute: the twin
            # slows it there)
            woke = max(0.0, row.get("wake_s", 0.0) - host_s)
            own = spans[id(row)]
            lines_of.setdefault((row["kind"], row["axis"], p, stride), []).append((r, real, own + woke))
            iso = table.time(row["kind"], row["axis"], p, row["bytes"], stride) if table is not None else None
            if iso:
                ratios.append(own / iso)
                both = per_axis.setdefault(row["axis"], [0.0, 0.0])
                both[0] += own + woke
                both[1] += iso
        for (kind, axis, p, stride), pts in sorted(lines_of.items()):
            alone = alone_point(table, kind, p, stride)
            if alone is not None:
                a, b, res = excess_line([x for _, x, _ in pts], [t for _, _, t in pts], alone)
                fitted = (f"fitted: the line measured alone ({kind} over {p}, stride {alone.stride}: its bandwidth) "
                          f"plus the mean excess per op inside training, {(a - alone.latency_s) * 1e3:+.3f} ms (their sum kept)")
            else:
                a, b, res = collective_line([x for _, x, _ in pts], [t for _, _, t in pts])
                fitted = "fitted (least squares on seconds: their sum kept)"
            residuals.append(residual(f"{ranks} rank(s): {kind} over {axis} {p} (stride {stride}) in training", res))
            files = "; ".join(sorted({describe(r) for r, _, _ in pts}))
            woken = any("wake_s" in row for r, row in rows if row["kind"] == kind and row["axis"] == axis)
            how = (f"{fitted}: {len(pts)} {kind}s over {axis} of recorded "
                   f"training steps, {min(x for _, x, _ in pts):.0f}-{max(x for _, x, _ in pts):.0f} B, summed "
                   f"span{' and wake-up of the op that waited' if woken else ''} {sum(t for _, _, t in pts) * 1e3:.1f} ms, "
                   f"median residual {statistics.median(map(abs, res)):.0%}, {files}")
            trained.append("\n".join([
                "[[collective_training]]", f'kind = "{kind}"', f'axis = "{axis}"', f"group_size = {p}",
                f"stride = {stride}", f"ranks = {ranks}", "latency_s = " + entry_text(max(a, 1e-9), how),
                "bandwidth = " + entry_text(1.0 / b if b > 0 else 1e15, how + ("" if b > 0 else "; no size effect seen")),
                ""]))
        if per_axis:
            lines.append("axis_slowdown = { " + ", ".join(f"{a} = {number_text(max(t / iso, 1e-6))}" for a, (t, iso) in sorted(per_axis.items()))
                         + f', source = "measured: per axis, the summed span (and wake-up of the op that waited, where '
                         f'measured) of the collectives of recorded training steps over their summed fitted time alone, '
                         f'{quoted(src)}" }}')
        if measured is not None:
            lines.append("comm_share = " + entry_text(share, (
                f"measured: the share of its rate an all-reduce keeps beside a GEMM on its rank (alone vs beside, "
                f"issue to completion; fluid), median over {measured[1]} axes, {src}")))
        elif lines_of:
            lines.append("comm_share = " + entry_text(share, (
                f"fitted: the share of its rate a collective keeps while its rank computes; the spans of the recorded "
                f"training steps' collectives less (1 - share) x the time their rank's compute ran beside them "
                f"(replayed from the steps' median spans) fit the per-axis lines best at this share (relative "
                f"least squares, steps of {COMM_SHARE_STEP}), {src}")))
        if issued is not None:
            lines.append("host_issue_s = " + entry_text(max(issued[0], 1e-9), f"{issued[1]}, {src}"))
        exchanged = exchange_measured(runs) if micro.host is not None and micro.host.ordered else None
        if exchanged is not None:
            lines.append("host_exchange_s = " + entry_text(max(exchanged[0], 1e-9), f"{exchanged[1]}, {src}"))
        if ratios:
            lines.append("collective_slowdown = " + entry_text(max(statistics.median(ratios), 1e-6), (
                f"measured: median over {len(ratios)} collectives of recorded training steps of their span over "
                f"their fitted time alone, {src}")))
        block = shares[share_at[ranks]].splitlines()
        keys = {ln.split(" =")[0] for ln in lines}
        block = [ln for ln in block if ln.split(" =")[0] not in keys]
        shares[share_at[ranks]] = "\n".join(block + lines + [""])
    if sharing:
        head[-1:-1] = core_load(sharing, "; ".join(sorted({describe(r) for g in by_ranks.values() for r in g
                                                              if r.get("steps") and r["ranks_per_node"] > 1})))
    return trained + costs


def span_spread(runs: list[dict]) -> dict[str, float]:
    """Per class of op, how much its span varies over the ranks and steps of the files' recorded steps
    (bench's `spread`, a coefficient of variation; twin.host.spread draws spans at it): "compute", each
    collective's kind and axis ("all_gather_z", twin.host.spread.spread_key) and "collective" (all of
    them); the median over the files of each file's median over its ops of the class. {} where no
    op recorded a spread (files from before bench recorded it)."""
    from twin.host.spread import spread_key
    per: dict[str, list[float]] = {}
    for r in runs:
        mine: dict[str, list[float]] = {}
        for row in r["steps"]:
            if "spread" not in row:
                continue
            keys = ((spread_key(row["kind"], row["axis"]), "collective") if row["kind"] in COLLECTIVES
                    else ("compute",))
            for k in keys:
                mine.setdefault(k, []).append(row["spread"])
        for k, v in mine.items():
            per.setdefault(k, []).append(statistics.median(v))
    return {k: statistics.median(v) for k, v in sorted(per.items())}


def fluid_spans(rows: list[tuple[dict, dict]], ranks: int):
    """(span(row) -> seconds, how, stretch or None): what a compute op of the recorded steps costs, as the twin counts
    it. Where bench recorded on-CPU times (`cpu_s`): the op's on-CPU time x the stretch of all the
    recorded steps with this many ranks (their compute ops' summed span over summed on-CPU time: the
    rate at which a rank's compute progresses while `ranks` ranks share the cores, as a fluid).
    With more ranks than cores, a rank descheduled inside an op leaves that op's span long and the
    next one short, and each grid's steps time-slice their own way (8 ranks on 2 cores: a stretch of
    1.9-3.1 from grid to grid); one op's span from one grid's steps would then set its shape's rate for
    every grid. On the 2-core development VM the per-op median |error| over gpt-small's 35 grids was
    17 % this way against 27 % from the spans (docs/calibration.md). Files without cpu_s: the spans."""
    comp = [row for _, row in rows if row["stream"] == "compute" and row["kind"] not in COLLECTIVES]
    timed = [row for row in comp if "cpu_s" in row]
    cpu = sum(row["cpu_s"] for row in timed)
    if not comp or len(timed) < len(comp) or cpu <= 0:
        return (lambda row: row["seconds"]), "spans (no on-CPU times recorded)", None
    stretch = max(1.0, sum(row["seconds"] for row in timed) / cpu)
    return ((lambda row: row["cpu_s"] * stretch if "cpu_s" in row else row["seconds"]),
            f"on-CPU time x stretch {stretch:.3f} (summed span over summed on-CPU time of the {len(timed)} "
            f"compute ops recorded with {ranks} rank(s))", stretch)


def pooled_cpu_lines(by_ranks: dict[int, list[dict]]) -> dict[tuple[str, str], tuple]:
    """Per (kind, role) of the compute ops without a model of their own, the line of their on-CPU
    time (`cpu_s`) over the recorded steps of every file with 2 or more ranks: (latency s, seconds
    per byte, ops, smallest and largest bytes); least squares on relative error over the ops no
    collective overlapped. What an op costs on the CPU that runs it is the kernel's work, whatever
    the rank count; the rank count sets how long it waits for a core (the stretch) and, a little,
    the caches and memory it shares (each count's level, `cpu_level`). Pooled, the line sees each
    op at every count's size: a norm over whole features is recorded at one size per rank count
    (gpt-small: 262 kB with 8 ranks), where a line of 8 ranks alone is bandwidth alone and
    gave 1x8x1x1's 2 MB norms 1.3 ms of on-CPU time against 0.64 measured. One rank is left out:
    alone, it runs 2 threads (OMP_NUM_THREADS unset) and its main thread's on-CPU time is not its
    work. {} where the files did not record on-CPU times."""
    pts: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for ranks, group in by_ranks.items():
        if ranks < 2:
            continue
        for r in group:
            roles = cost_roles(r)
            for row in r.get("steps", []):
                if row["stream"] != "compute" or row["kind"] in MODELED or row["kind"] in COLLECTIVES:
                    continue
                if "cpu_s" not in row or row.get("covered", 0) >= COVERED or row["cpu_s"] <= 0:
                    continue
                pts.setdefault((row["kind"], ""), []).append((row["bytes"], row["cpu_s"]))
                if row.get("role"):
                    pts.setdefault((row["kind"], roles.get(row["name"], row["role"])), []).append(
                        (row["bytes"], row["cpu_s"]))
    out = {}
    for key, v in pts.items():
        a, b, _ = cost_line([x for x, _ in v], [t for _, t in v])
        out[key] = (a, b, len(v), min(x for x, _ in v), max(x for x, _ in v))
    return out


def cpu_level(line: tuple, rows: list[dict]) -> float:
    """One rank count's on-CPU time of its ops over the pooled line's (summed; 1 without time)."""
    a, b = line[0], line[1]
    model = sum(a + b * row["bytes"] for row in rows)
    return sum(row["cpu_s"] for row in rows) / model if model > 0 else 1.0


def cost_roles(run: dict) -> dict[str, str]:
    """Per op name of a measurement file's program, the role its measured cost line is keyed by
    (twin.costs.kernels.cost_role: a norm over x-split features has its own); {} without a model."""
    from twin.program.grid import Grid
    from twin.costs.kernels import cost_role
    from twin.program.model import load_model
    from twin.program.program import Options, build_program
    if not run.get("steps") or not run.get("model"):
        return {}
    prog = build_program(load_model(run["model"]), Grid.parse(run["grid"]), Options())
    return {op.name: cost_role(op) for op in prog.ops if op.role}


def same_shape_slowdown(gemms: list[tuple[dict, dict]], span) -> tuple[float, int] | None:
    """(slowdown, pairs): how much longer a GEMM of the recorded steps (`gemms`: (bench file, row)
    pairs) takes while a collective of its rank runs beside it than one of the same shape (m, n, k,
    layout) in the same file that ran alone, `span(row)` each: the median over the (file, shape)
    pairs recorded both ways of the ratio of their medians, at least 1; None where no shape was.
    Like against like: the overlapped GEMMs of a step are not the alone ones (oar hides the
    all-reduce of the input gradient behind the weight-gradient GEMM), and the ratio of each group's
    time to the microbenchmarks' model mixed that model's error per shape into the slowdown.
    Taken where bench recorded on-CPU times (span: on-CPU time x the pooled stretch, so the ratio is
    the kernel's own slowdown; the cores the collectives take are in the stretch, twin.host.cores).
    Within one file, not across files: bench files of one rank count are recorded minutes apart, at
    the machine's speed of their moment (on the 2-core development VM a grid's GEMMs took 0.82-1.20x
    the on-CPU time, summed, in its second bench file than in its first), and a shape overlapped in
    one grid's file and alone in another's took that drift for a slowdown (8 ranks: 1.18 paired
    across files, 1.02 within them); the runs' traces agree that the kernel barely slows (a GEMM's
    on-CPU time with its rank's collective in flight over the same op's alone: a median of 0.98-0.99
    over the grids of 4 and 8 ranks)."""
    by: dict[tuple, tuple[list[float], list[float]]] = {}
    for run, row in gemms:
        key = (id(run), row["m"], row["n"], row["k"], row["layout"] or "NN")
        by.setdefault(key, ([], []))[0 if row.get("covered", 0) >= COVERED else 1].append(span(row))
    ratios = [statistics.median(o) / statistics.median(a) for o, a in by.values() if o and a]
    if not ratios:
        return None
    return max(1.0, statistics.median(ratios)), len(ratios)


def micro_time(km, row: dict) -> float:
    """Seconds the microbenchmark-fitted kernel model gives a recorded GEMM."""
    return km.gemm_time(row["m"], row["n"], row["k"], row["layout"] or "NN")
