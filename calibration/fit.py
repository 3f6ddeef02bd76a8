"""Fitting `backend bench` measurements into a kernel profile (twin/profiles/NAME.toml).

What is fitted, per count of ranks sharing a node (one measurement file per count, or several):
- GEMMs: each measured shape and layout becomes a `[[gemm_table]]` point (flop/s per rank, with the
  rank count; the median time where several files timed it: bench passes of one loop); the kernel
  model uses the nearest point within a factor 2 in m, n and k.
- `[[node_share]]`: per-op overhead `launch_s` = eager forward+backward cost per op of a tiny autograd
  op; per-rank memory bandwidth from the elementwise-add sizes (seconds = dispatch + bytes / bandwidth,
  least squares on relative error); `overlap_slowdown` = median GEMM slowdown while an all-reduce runs
  (at least 1); `host_op_s` = the executor's host time per compute op (mean gap between consecutive
  compute ops with no collective in flight, in a few training steps of the model on the grid; the
  median in files written before bench measured the mean), where bench measured it.
- `[[collective_table]]`: per kind, group size and stride, seconds = latency + bytes / bandwidth over
  the measured payloads (least squares on relative error, both terms kept >= 0).
- From the recorded training steps (`steps` rows; what ops cost inside training, where ranks share
  the cores with each other and with gloo's threads), per rank count, their wall times first divided
  by how much longer the file's recorded steps took than its unrecorded ones, where bench timed both
  (calibration.measurements.unobserved: the twin predicts training that nothing records):
  - `[[op_cost]]`: per compute kind the GEMM and attention models do not cover (elementwise,
    embedding, loss, optimizer), and per role within it (a norm over x-split features apart:
    twin.costs.kernels.cost_role), seconds = latency + bytes / bandwidth over the
    ops of the recorded steps (least squares on relative error; bandwidth alone when all ops have one size);
  - where bench recorded on-CPU times, every compute op's time below is its on-CPU time x the
    rank count's stretch (fluid_spans), else its span;
  - `[[gemm_table]]` points with `training = true`: each GEMM shape's median span inside training
    (ops no collective overlapped); the kernel model prefers them over the microbenchmarks' points;
  - node_share `attention_fwd_efficiency`, `attention_bwd_efficiency`: causal attention inside
    training, median over the recorded ops (replace the microbenchmark's);
  - node_share `compute_contention`: GEMM time inside training over the time the
    microbenchmark-fitted profile gives them, summed over the ops no collective overlapped;
    `overlap_slowdown`: where bench recorded on-CPU times, a GEMM a collective overlapped (most of
    its span) over one of the same shape none did in the same bench file (training.same_shape_slowdown); else the same ratio
    as compute_contention over the ops a collective overlapped, relative to compute_contention
    (either replaces the microbenchmark's, which a short all-reduce beside one GEMM barely moves);
  - `[[collective_training]]`: per kind, axis, group size and stride, seconds = latency + bytes /
    bandwidth over the recorded collectives' spans (issue, or the end of the previous one of the
    axis, to completion; plus, where bench measured it, `wake_s` less host_op_s: the time the compute op
    that waited for it took to resume after its completion, beyond the host time the twin charges that
    op): the `[[collective_table]]` line measured alone (its bandwidth: the microbenchmark's sizes span
    three decades, the steps' a factor 4) with its latency raised by the mean excess per op inside
    training, so that the line keeps their summed time (`excess_line`; a free least-squares line
    where nothing was measured alone, `collective_line`). Inside
    training a collective costs more than alone: gloo's threads compete with the ranks' compute for
    the cores, and the span holds the wait for the group's last member (ranks drift apart when more
    ranks than cores time-slice). Each axis has its own line because each plays its own part in the
    schedule (x all-reduces block the next op, z all-gathers are prefetched, the data all-reduces
    leave in one burst whose spans start when the one before ends): pooled by group size alone, the
    data burst's near-0 spans pulled the x all-reduces' line to 82 us flat (2x1x1x1 predicted -50 %).
    The twin prefers these lines (the axis' own, then another tensor axis');
  - node_share `collective_slowdown`: the median over the recorded collectives of their span over
    their `[[collective_table]]` time alone; `axis_slowdown`: per axis, their summed span (with the
    wake-up above) over their summed time alone. They scale the lines measured alone for the kinds
    and group sizes no recorded step ran: the axis' own factor where its collectives were recorded
    (an axis' part in the schedule sets it: 1.6-1.9 for the x all-reduces that block the next op,
    4-5 for the z all-gathers that overlap compute, about 0.8 for the data burst), else the median.
  - node_share `host_issue_s`: the host time per collective issued (twin.host.order.host_times charges
    it to the compute op after the issue, where that op does not wait for the collective): where bench
    recorded it (`issue_s`), the mean over the collectives no compute op waits for right after them
    (calibration.sharing.issue_measured); in files without it, where the ranks do not
    outnumber the bench machine's cores, the one that makes the recorded steps, replayed through the
    twin's engine at their measured spans, spend the time between compute ops that bench measured
    (calibration.sharing.issue_cost);
  - node_share `host_exchange_s` (MoE): the host time of a dispatch that exchanges its row counts first
    (twin.host.order.count_exchange: the forward's and the recompute's; a synchronous all-to-all of
    ints inside its issue), the mean `issue_s` of those in the recorded steps
    (calibration.sharing.exchange_measured); host_times charges it to the compute op after the
    dispatch, which waits for its rows. Absent (a dense model; files before bench took all-to-alls
    for collectives): such a dispatch costs what any other issue does;
  - node_share `span_spread` (CPU, 2 or more ranks): per class of op (compute; a collective's kind and
    axis; every collective), the coefficient of variation of its span over the ranks and steps, the
    median over the files of each file's median over its ops of the class (bench's `spread`;
    calibration.training.span_spread); the twin draws the spans at it (twin.host.spread),
    and the collective core load is fitted on the recorded steps' replays drawn the same way;
  - node_share `comm_share`: the share of its rate a collective keeps while its rank computes (gloo's
    threads and the ranks' compute share the cores; the twin slows a collective by it while a member's
    compute stream runs an op). Measured where bench timed an all-reduce alone and beside a GEMM
    (`overlap` rows with comm_alone_s, comm_overlapped_s; fluid: progress at the share during the
    GEMM, at full rate after it); else fitted from the recorded steps: each collective's seconds with
    its rank's compute beside it come from replaying the steps' median spans through the twin's
    engine (host-ordered, as the CPU executor issues them), and the share is the one whose per-axis
    lines fit best. The in-training lines and the slowdowns above are then fitted on each span less
    (1 - share) x those seconds, which the twin adds back wherever compute runs beside the collective.
Scalars the measurements do not reach (peak, tiles, attention efficiency, layout penalties) are
copied from a base profile with their sources. Every fitted number's source names its measurement file.

Where it lives: this module reads the files and writes the profile; calibration.lines fits the lines,
calibration.rates the microbenchmarks' per-rank figures, calibration.training the recorded steps,
calibration.sharing how ranks share the cores, calibration.profile_text the TOML entries.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from calibration.lines import Residual, fit_line, residual
from calibration.measurements import describe, load_measurement, unobserved
from calibration.profile_text import entry_text, quoted
from calibration.rates import attention_lines, compute_scale, host_line, measured_rates, scale_value, square_rates
from calibration.training import in_training
from topologies.datafile import read_spec
from topologies.common import TwinError
from twin.costs.profile import PROFILES_DIR

# what the CPU executor does (the twin issues collectives in program order where a profile says so)
HOST_ORDERED_SOURCE = ("executor: on a CPU the host is the device, and backend/runtime/executor.py runs each op of "
                       "the program on it in program order: a collective is issued only once the compute op "
                       "before it has run, and a compute op starts only after the host waited for the "
                       "collectives issued before it that it needs (twin.host.order.host_ordered)")
BASE_CPU = Path(__file__).resolve().parent / "base" / "cpu.toml"  # assumed CPU figures bench does not reach
BASE_SCALARS = ("peak_flops", "gemm_flops", "compute_units", "tile_m", "tile_n", "k_half", "hbm_bandwidth",
                "launch_s", "attention_fwd_efficiency", "attention_bwd_efficiency", "overlap_slowdown",
                "layout_large_flops")


@dataclass
class Fit:
    """A fitted profile (TOML text) and the residuals of its fits."""

    toml: str
    residuals: list[Residual] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)


def fit_profile(paths: list[str | Path], name: str, base: str | None = None, gpus: list[str] | None = None) -> Fit:
    """Fit the measurement files at `paths` into a profile called `name` (see the module docstring)."""
    if not paths:
        raise TwinError("twin calibrate needs at least one measurement file (from `backend bench`)")
    runs = [unobserved(load_measurement(p)) for p in paths]  # recorded steps as unrecorded ones run
    base_path, base_data = read_spec(base or str(BASE_CPU), PROFILES_DIR, "kernel profile")
    devices = {r["machine"]["device"].split(":")[0] for r in runs}
    if len(devices) > 1:
        raise TwinError(f"measurement files come from different devices ({', '.join(sorted(devices))}): "
                        "fit one profile per device")
    act_bytes = {r["dtype_bytes"] for r in runs}
    if len(act_bytes) > 1:
        raise TwinError("measurement files were taken in different precisions (dtype_bytes "
                        f"{sorted(act_bytes)}): fit one profile per precision")
    by_ranks: dict[int, list[dict]] = {}
    for r in runs:
        by_ranks.setdefault(r["ranks_per_node"], []).append(r)
    fit = Fit("", ranks=sorted(by_ranks))
    out = [f"# Kernel profile {name!r}, fitted by `twin calibrate` from {len(runs)} measurement file(s) of",
           f"# `backend bench` ({', '.join(sorted({r['machine']['host'] for r in runs}))}); scalars the",
           f"# measurements do not reach come from the base profile {base_path.name} with their sources.",
           f'name = "{quoted(name)}"',
           f"gpus = [{', '.join(chr(34) + quoted(g) + chr(34) for g in (gpus if gpus is not None else base_data.get('gpus', [])))}]",
           f"activation_bytes = {act_bytes.pop()}", ""]
    shares, gemms, colls = [], [], []
    share_at: dict[int, int] = {}  # rank count -> its [[node_share]] block in `shares`
    # the profile's own figures (peak, GEMM rate) are per rank with the most ranks sharing the node,
    # as the system file counts them; fewer ranks get more of the node: compute_scale, measured on the
    # square GEMMs that every rank count timed
    most = max(by_ranks)
    square = {r: square_rates(g) for r, g in by_ranks.items()}
    for ranks, group in sorted(by_ranks.items()):
        src = "; ".join(describe(r) for r in group)
        # per-op overhead and memory bandwidth
        adds = [row for r in group for row in r["ops"] if row["op"] == "add"]
        grads = [row for r in group for row in r["ops"] if row["op"] == "autograd"]
        hosts = [row for r in group for row in r["ops"] if row["op"] == "host"]
        launch = statistics.median(row["seconds"] for row in grads) if grads else None
        bw = None
        if len(adds) >= 2:
            a, b, res = fit_line([row["bytes"] for row in adds], [row["seconds"] for row in adds])
            fit.residuals.append(residual(f"{ranks} rank(s): elementwise add, dispatch + bytes/bandwidth", res))
            bw = 1.0 / b if b > 0 else None
            launch = launch if launch is not None else a
        over = [row["overlapped_s"] / row["alone_s"] for r in group for row in r["overlap"]]
        slow = max(1.0, statistics.median(over)) if over else 1.0
        if launch is not None and bw is not None:
            share_at[ranks] = len(shares)
            shares.append("\n".join([
                "[[node_share]]", f"ranks = {ranks}",
                "launch_s = " + entry_text(launch, f"measured: eager forward+backward per op of a tiny autograd op, {src}"),
                "hbm_bandwidth = " + entry_text(bw, f"fitted: elementwise add over {len(adds)} sizes, {src}"),
                "overlap_slowdown = " + entry_text(slow, (f"measured: median GEMM slowdown under an all-reduce "
                                                      f"({len(over)} axes, at least 1), {src}") if over
                                               else "no overlap measured with this many ranks: 1"),
                "compute_scale = " + compute_scale(square, ranks, most, src)]
                # the executor's host runs the compute ops on CPU only: the twin then charges host time
                # per op and issues collectives in program order (twin.host.order.host_ordered); a GPU's
                # host launches ahead of its kernels, so its gaps are no cost of the ops
                + ([host_line(hosts, src)] if hosts and devices == {"cpu"} else [])
                + attention_lines(group, ranks, base_data["peak_flops"]["value"], scale_value(square, ranks, most), src)
                + [""]))
        timed: dict[tuple, list[tuple[dict, float]]] = {}  # a shape timed by several files (bench passes)
        for r in group:
            for row in r["gemm"]:
                timed.setdefault((row["m"], row["n"], row["k"], row["layout"]), []).append((r, row["seconds"]))
        for (m, n, k, layout), pts in timed.items():
            secs = statistics.median(t for _, t in pts)
            how = (f"measured: {secs * 1e6:.1f} us, {describe(pts[0][0])}" if len(pts) == 1 else
                   f"measured: median of {len(pts)} files, {', '.join(f'{t * 1e6:.1f}' for _, t in pts)} us, "
                   + "; ".join(describe(r) for r, _ in pts))
            gemms.append("\n".join([
                "[[gemm_table]]", f"m = {m}", f"n = {n}", f"k = {k}", f'layout = "{layout}"', f"ranks = {ranks}",
                "flops = " + entry_text(2.0 * m * n * k / secs, how), ""]))
        keyed: dict[tuple, list[tuple[dict, dict]]] = {}
        for r in group:
            for row in r["collectives"]:
                keyed.setdefault((row["kind"], row["group_size"], row.get("stride", 0)), []).append((r, row))
        for (kind, p, stride), rows in sorted(keyed.items()):
            a, b, res = fit_line([row["bytes"] for _, row in rows], [row["seconds"] for _, row in rows])
            fit.residuals.append(residual(f"{ranks} rank(s): {kind} over {p} (stride {stride})", res))
            files = "; ".join(sorted({describe(r) for r, _ in rows}))
            sizes = sorted(row["bytes"] for _, row in rows)
            how = f"fitted over {len(rows)} sizes {sizes[0]}-{sizes[-1]} B, worst residual {max(map(abs, res)):.0%}, {files}"
            colls.append("\n".join([
                "[[collective_table]]", f'kind = "{kind}"', f"group_size = {p}", f"stride = {stride}",
                f"ranks = {ranks}",
                "latency_s = " + entry_text(max(a, 1e-9), how),
                "bandwidth = " + entry_text(1.0 / b if b > 0 else 1e15, how + ("" if b > 0 else "; no size effect seen")),
                ""]))
    # scalars: the base profile's, with what the most-ranks measurement says instead where it reaches
    least = most
    rates = measured_rates(by_ranks, square, most)
    first = next((s for s in shares if f"ranks = {least}\n" in s), None)
    for key in BASE_SCALARS:
        entry = base_data.get(key)
        if not isinstance(entry, dict):
            raise TwinError(f"base profile {base_path}: {key} must be {{ value = ..., source = \"...\" }}")
        value, source = entry["value"], f"base profile {base_path.name}: {entry.get('source', '')}"
        if first is not None and key in ("launch_s", "hbm_bandwidth", "overlap_slowdown"):
            line = next(ln for ln in first.splitlines() if ln.startswith(key + " ="))
            out.append(line)
            continue
        if key in rates:
            value, source = rates[key](value, source)
        out.append(f"{key} = {entry_text(value, quoted(source))}")
    for key in ("layout_penalty", "layout_penalty_small"):
        e = base_data[key]
        out.append(f'{key} = {{ NN = {e["NN"]}, NT = {e["NT"]}, TN = {e["TN"]}, source = "{quoted("base profile " + base_path.name + ": " + e.get("source", ""))}" }}')
    if first is not None:  # measured on CPU only: absent (0) elsewhere
        out += [ln for ln in first.splitlines() if ln.startswith("host_op_s =")]
    if devices == {"cpu"}:
        files = "; ".join(describe(r) for r in runs)
        out.append(f'host_ordered = {{ value = true, source = "{quoted(HOST_ORDERED_SOURCE)}; measured on device cpu: {quoted(files)}" }}')
    out.append("")
    costs = in_training(by_ranks, "\n".join(out + shares + gemms + colls), shares, share_at, fit.residuals,
                        gemms, out)
    fit.toml = "\n".join(out + shares + gemms + colls + costs + fitted_from(runs))
    return fit


def fitted_from(runs: list[dict]) -> list[str]:
    """The `[fitted_from]` table: what the measurements covered (the ranks per node, each benched grid,
    the collective payloads, the models, the machines and dates), which `twin simulate`, `search` and
    `validate` read to say when a study lies outside it (twin.costs.profile_types.Profile.coverage)."""
    def strings(values) -> str:
        return "[" + ", ".join(f'"{quoted(v)}"' for v in values) + "]"

    machines = sorted({f"{r['machine'].get('cpu') or r['machine'].get('gpu') or r['machine']['device']}"
                       f" ({r['machine'].get('cores') or '?'} cores)" for r in runs})
    sizes = sorted({row["bytes"] for r in runs for row in r["collectives"]})
    dates = sorted(r["machine"]["date"] for r in runs)
    benched = sorted({(r["ranks_per_node"], r["grid"], bool(r.get("steps"))) for r in runs})
    out = ["[fitted_from]",
           'source = "what the measurement files this profile was fitted from covered (twin calibrate)"',
           f"files = {len(runs)}",
           f"machines = {strings(machines)}",
           f"hosts = {strings(sorted({r['machine']['host'] for r in runs}))}",
           f'device = "{quoted(runs[0]["machine"]["device"].split(":")[0])}"',
           f"models = {strings(sorted({r.get('model') or '' for r in runs} - {''}))}",
           f"dates = {strings([dates[0][:10], dates[-1][:10]])}",
           f"ranks = [{', '.join(str(n) for n in sorted({r['ranks_per_node'] for r in runs}))}]"]
    if sizes:
        out.append(f"collective_bytes = [{sizes[0]}, {sizes[-1]}]")
    out += ["benched = ["] + [f'  {{ grid = "{quoted(grid)}", ranks = {ranks}, training_steps = {str(steps).lower()} }},'
                              for ranks, grid, steps in benched] + ["]", ""]
    return out


def calibrate(paths: list[str | Path], out: str | Path, base: str | None = None) -> Fit:
    """Fit and write the profile to `out` (its name: the file's stem); checks that the twin loads it."""
    from topologies.common import write_atomic
    from twin.costs.profile import load_profile
    out = Path(out)
    if out.suffix != ".toml":
        raise TwinError(f"--out {out} must be a .toml file (twin/profiles/NAME.toml)")
    fit = fit_profile(paths, out.stem, base)
    out.parent.mkdir(parents=True, exist_ok=True)
    from topologies.common import naming, remove_quietly
    tmp = out.with_name(out.name + ".check.toml")
    try:
        with naming(tmp):
            tmp.write_text(fit.toml)
        load_profile(str(tmp))
    finally:
        remove_quietly(tmp)
    write_atomic(out, fit.toml)
    return fit


def worst(fit: Fit) -> float:
    """The largest residual of all the fits (a ratio)."""
    return max((r.worst for r in fit.residuals), default=0.0) if fit.residuals else math.nan
