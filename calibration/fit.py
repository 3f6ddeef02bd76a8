"""Fitting `backend bench` measurements into a kernel profile (calibration/profiles/NAME.toml).

What is fitted, per count of ranks sharing a node (one measurement file per count, or several):
- GEMMs: each measured shape and layout becomes a `[[gemm_table]]` point (flop/s per rank, with the
  rank count); the kernel model uses the nearest point within a factor 2 in m, n and k.
- `[[node_share]]`: per-op overhead `launch_s` = eager forward+backward cost per op of a tiny autograd
  op; per-rank memory bandwidth from the elementwise-add sizes (seconds = dispatch + bytes / bandwidth,
  least squares on relative error); `overlap_slowdown` = median GEMM slowdown while an all-reduce runs
  (at least 1); `host_op_s` = the executor's host time per compute op (mean gap between consecutive
  compute ops with no collective in flight, in a few training steps of the model on the grid; the
  median in files written before bench measured the mean), where bench measured it.
- `[[collective_table]]`: per kind, group size and stride, seconds = latency + bytes / bandwidth over
  the measured payloads (least squares on relative error, both terms kept >= 0).
- From the recorded training steps (`steps` rows; what ops cost inside training, where ranks share
  the cores with each other and with gloo's threads), per rank count:
  - `[[op_cost]]`: per compute kind the GEMM and attention models do not cover (elementwise,
    embedding, loss, optimizer), and per role within it (a norm over x-split features apart:
    twin.kernels.cost_role), seconds = latency + bytes / bandwidth over the
    ops of the recorded steps (least squares on relative error; bandwidth alone when all ops have one size);
  - where bench recorded on-CPU times, every compute op's time below is its on-CPU time x the
    rank count's stretch (_fluid_spans), else its span;
  - `[[gemm_table]]` points with `training = true`: each GEMM shape's median span inside training
    (ops no collective overlapped); the kernel model prefers them over the microbenchmarks' points;
  - node_share `attention_fwd_efficiency`, `attention_bwd_efficiency`: causal attention inside
    training, median over the recorded ops (replace the microbenchmark's);
  - node_share `compute_contention`: GEMM time inside training over the time the
    microbenchmark-fitted profile gives them, summed over the ops no collective overlapped;
    `overlap_slowdown` = the same ratio over the ops a collective overlapped (most of their span),
    relative to compute_contention (replaces the microbenchmark's, which a short all-reduce beside
    one GEMM barely moves);
  - `[[collective_training]]`: per kind, axis, group size and stride, seconds = latency + bytes /
    bandwidth over the recorded collectives' spans (issue, or the end of the previous one of the
    axis, to completion; plus, where bench measured it, `wake_s` less host_op_s: the time the compute op
    that waited for it took to resume after its completion, beyond the host time the twin charges that
    op): the `[[collective_table]]` line measured alone (its bandwidth: the microbenchmark's sizes span
    three decades, the steps' a factor 4) with its latency raised by the mean excess per op inside
    training, so that the line keeps their summed time (`_excess_line`; a free least-squares line
    where nothing was measured alone, `_collective_line`). Inside
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
"""

from __future__ import annotations

import math
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibration.measurements import describe, load_measurement
from topologies.datafile import read_spec
from twin.common import TwinError
from twin.profile import PROFILES_DIR, load_profile

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
MODELED = ("gemm", "attention")  # compute kinds with their own microbenchmarked model
COVERED = 0.5  # a compute op counts as overlapped when a collective ran during this share of its span

# what the CPU executor does (the twin issues collectives in program order where a profile says so)
HOST_ORDERED_SOURCE = ("executor: on a CPU the host is the device, and backend/executor.py runs each op of "
                       "the program on it in program order: a collective is issued only once the compute op "
                       "before it has run, and a compute op starts only after the host waited for the "
                       "collectives issued before it that it needs (twin.program.host_ordered)")
BASE_CPU = Path(__file__).resolve().parent / "base" / "cpu.toml"  # assumed CPU figures bench does not reach
BASE_SCALARS = ("peak_flops", "gemm_flops", "compute_units", "tile_m", "tile_n", "k_half", "hbm_bandwidth",
                "launch_s", "attention_fwd_efficiency", "attention_bwd_efficiency", "overlap_slowdown",
                "layout_large_flops")


@dataclass
class Residual:
    """How well one fitted line reproduces its measurements: relative errors (fit/measured - 1)."""

    what: str
    points: int
    median: float
    worst: float


@dataclass
class Fit:
    """A fitted profile (TOML text) and the residuals of its fits."""

    toml: str
    residuals: list[Residual] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)


def fit_line(x: list[float], t: list[float]) -> tuple[float, float, list[float]]:
    """(intercept a >= 0, slope b >= 0, relative residuals) of t ~ a + b x, least squares on t's
    relative error (each point weighted 1/t), so that small and large sizes count alike."""
    X, T = np.asarray(x, float), np.asarray(t, float)
    w = 1.0 / T
    best = None
    for fix in (None, "a", "b"):
        if fix is None:
            A = np.stack([w, w * X], axis=1)
            (a, b), *_ = np.linalg.lstsq(A, np.ones_like(T), rcond=None)
        elif fix == "a":
            a, b = 0.0, float(np.sum(w * X) / np.sum((w * X) ** 2)) if np.any(X) else 0.0
        else:
            a, b = float(np.sum(w) / np.sum(w * w)), 0.0
        if a < 0 or b < 0:
            continue
        res = (a + b * X) / T - 1.0
        err = float(np.sum(res ** 2))
        if best is None or err < best[0]:
            best = (err, float(a), float(b), res.tolist())
    assert best is not None  # the constant fit (b = 0) always has a >= 0
    return best[1], best[2], best[3]


def _square_rates(group: list[dict]) -> dict[int, float]:
    """flop/s per rank of the square NN GEMMs (m = n = k) a group of measurements timed, by size."""
    out: dict[int, list[float]] = {}
    for r in group:
        for row in r["gemm"]:
            if row["m"] == row["n"] == row["k"] and row["layout"] == "NN":
                out.setdefault(row["m"], []).append(2.0 * row["m"] ** 3 / row["seconds"])
    return {size: statistics.median(v) for size, v in out.items()}


def _compute_scale(square: dict[int, dict[int, float]], ranks: int, most: int, src: str) -> str:
    common = sorted(set(square[ranks]) & set(square[most]))
    if not common:
        return _entry(1.0, "not measured (no square GEMM timed with this many and with the most ranks): 1")
    size = common[-1]
    return _entry(square[ranks][size] / square[most][size],
                  f"measured: {size}^3 GEMM rate per rank with {ranks} over {most} rank(s), {src}")


def _scale_value(square: dict[int, dict[int, float]], ranks: int, most: int) -> float:
    common = sorted(set(square[ranks]) & set(square[most]))
    return square[ranks][common[-1]] / square[most][common[-1]] if common else 1.0


def _measured_rates(by_ranks: dict[int, list[dict]], square: dict[int, dict[int, float]], most: int) -> dict:
    """{key: f(base value, base source) -> (value, source)} for the profile's per-rank figures with the
    most ranks (`most`) sharing the node that bench measures: gemm_flops, their largest square NN
    GEMM's rate per rank (the rate compute_scale scales to other rank counts; the kernel model's
    roofline for shapes no measured point is near). Before, a measured rate above the assumed peak
    had the fit keep an assumed 10 Gflop/s: the roofline fallback put gpt-small's GEMMs 5.7x too slow
    (median over the 35 runs of cpu-2026-12-01c), 1.5x with the measured rate. The peak stays the
    system's (twin.study checks they agree); where one rank alone beat it, the source says so."""
    out = {}
    if square.get(most):
        size = max(square[most])
        files = "; ".join(describe(r) for r in by_ranks[most]
                          if any(row["m"] == row["n"] == row["k"] == size for row in r["gemm"]))
        note = ""
        alone = [(r, row) for r in by_ranks.get(1, []) for row in r["gemm"]]
        if alone:
            r, top = max(alone, key=lambda rr: rr[1]["m"] * rr[1]["n"] * rr[1]["k"] / rr[1]["seconds"])
            fastest = 2.0 * top["m"] * top["n"] * top["k"] / top["seconds"]
            note = (f"; one rank alone ran {top['m']}x{top['n']}x{top['k']} {top['layout']} at {fastest:.3g} "
                    f"flop/s ({describe(r)}), {fastest / most:.3g} per rank of {most}: compare the assumed peak")
        out["gemm_flops"] = lambda v, s: (square[most][size], (
            f"measured: {size}^3 NN GEMM, rate per rank with {most} rank(s) at once, {files}{note}"))
    return out


def _attention(group: list[dict], ranks: int, peak: float, scale: float, src: str) -> list[str]:
    """node_share lines: attention efficiency (program flops over the rank's scaled peak x time), the
    median over the measured shapes; none when attention was not measured."""
    rows = [row for r in group for row in r.get("attention", [])]
    if not rows:
        return []
    out = []
    for phase in ("fwd", "bwd"):
        eff = statistics.median(row[f"{phase}_flops"] / (peak * scale * row[f"{phase}_s"]) for row in rows)
        out.append(f"attention_{phase}_efficiency = " + _entry(
            eff, f"measured: causal attention {'forward' if phase == 'fwd' else 'backward'}, median over "
                 f"{len(rows)} program shapes, of the peak scaled by compute_scale, {src}"))
    return out


def _residual(what: str, res: list[float]) -> Residual:
    a = [abs(r) for r in res]
    return Residual(what, len(a), statistics.median(a) if a else 0.0, max(a) if a else 0.0)


def _num(v: float) -> str:
    return f"{v:.6g}" if not float(v).is_integer() or abs(v) >= 1e15 else f"{v:.6g}"


def _entry(value: float, source: str) -> str:
    return f'{{ value = {_num(value)}, source = "{source}" }}'


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def fit_profile(paths: list[str | Path], name: str, base: str | None = None, gpus: list[str] | None = None) -> Fit:
    """Fit the measurement files at `paths` into a profile called `name` (see the module docstring)."""
    if not paths:
        raise TwinError("twin calibrate needs at least one measurement file (from `backend bench`)")
    runs = [load_measurement(p) for p in paths]
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
           f'name = "{_quote(name)}"',
           f"gpus = [{', '.join(chr(34) + _quote(g) + chr(34) for g in (gpus if gpus is not None else base_data.get('gpus', [])))}]",
           f"activation_bytes = {act_bytes.pop()}", ""]
    shares, gemms, colls = [], [], []
    share_at: dict[int, int] = {}  # rank count -> its [[node_share]] block in `shares`
    # the profile's own figures (peak, GEMM rate) are per rank with the most ranks sharing the node,
    # as the system file counts them; fewer ranks get more of the node: compute_scale, measured on the
    # square GEMMs that every rank count timed
    most = max(by_ranks)
    square = {r: _square_rates(g) for r, g in by_ranks.items()}
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
            fit.residuals.append(_residual(f"{ranks} rank(s): elementwise add, dispatch + bytes/bandwidth", res))
            bw = 1.0 / b if b > 0 else None
            launch = launch if launch is not None else a
        over = [row["overlapped_s"] / row["alone_s"] for r in group for row in r["overlap"]]
        slow = max(1.0, statistics.median(over)) if over else 1.0
        if launch is not None and bw is not None:
            share_at[ranks] = len(shares)
            shares.append("\n".join([
                "[[node_share]]", f"ranks = {ranks}",
                "launch_s = " + _entry(launch, f"measured: eager forward+backward per op of a tiny autograd op, {src}"),
                "hbm_bandwidth = " + _entry(bw, f"fitted: elementwise add over {len(adds)} sizes, {src}"),
                "overlap_slowdown = " + _entry(slow, (f"measured: median GEMM slowdown under an all-reduce "
                                                      f"({len(over)} axes, at least 1), {src}") if over
                                               else "no overlap measured with this many ranks: 1"),
                "compute_scale = " + _compute_scale(square, ranks, most, src)]
                # the executor's host runs the compute ops on CPU only: the twin then charges host time
                # per op and issues collectives in program order (twin.program.host_ordered); a GPU's
                # host launches ahead of its kernels, so its gaps are no cost of the ops
                + ([_host_line(hosts, src)] if hosts and devices == {"cpu"} else [])
                + _attention(group, ranks, base_data["peak_flops"]["value"], _scale_value(square, ranks, most), src)
                + [""]))
        for r in group:
            for row in r["gemm"]:
                flops = 2.0 * row["m"] * row["n"] * row["k"] / row["seconds"]
                gemms.append("\n".join([
                    "[[gemm_table]]", f"m = {row['m']}", f"n = {row['n']}", f"k = {row['k']}",
                    f'layout = "{row["layout"]}"', f"ranks = {ranks}",
                    "flops = " + _entry(flops, f"measured: {row['seconds'] * 1e6:.1f} us, {describe(r)}"), ""]))
        keyed: dict[tuple, list[tuple[dict, dict]]] = {}
        for r in group:
            for row in r["collectives"]:
                keyed.setdefault((row["kind"], row["group_size"], row.get("stride", 0)), []).append((r, row))
        for (kind, p, stride), rows in sorted(keyed.items()):
            a, b, res = fit_line([row["bytes"] for _, row in rows], [row["seconds"] for _, row in rows])
            fit.residuals.append(_residual(f"{ranks} rank(s): {kind} over {p} (stride {stride})", res))
            files = "; ".join(sorted({describe(r) for r, _ in rows}))
            sizes = sorted(row["bytes"] for _, row in rows)
            how = f"fitted over {len(rows)} sizes {sizes[0]}-{sizes[-1]} B, worst residual {max(map(abs, res)):.0%}, {files}"
            colls.append("\n".join([
                "[[collective_table]]", f'kind = "{kind}"', f"group_size = {p}", f"stride = {stride}",
                f"ranks = {ranks}",
                "latency_s = " + _entry(max(a, 1e-9), how),
                "bandwidth = " + _entry(1.0 / b if b > 0 else 1e15, how + ("" if b > 0 else "; no size effect seen")),
                ""]))
    # scalars: the base profile's, with what the most-ranks measurement says instead where it reaches
    least = most
    measured_rates = _measured_rates(by_ranks, square, most)
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
        if key in measured_rates:
            value, source = measured_rates[key](value, source)
        out.append(f"{key} = {_entry(value, _quote(source))}")
    for key in ("layout_penalty", "layout_penalty_small"):
        e = base_data[key]
        out.append(f'{key} = {{ NN = {e["NN"]}, NT = {e["NT"]}, TN = {e["TN"]}, source = "{_quote("base profile " + base_path.name + ": " + e.get("source", ""))}" }}')
    if first is not None:  # measured on CPU only: absent (0) elsewhere
        out += [ln for ln in first.splitlines() if ln.startswith("host_op_s =")]
    if devices == {"cpu"}:
        files = "; ".join(describe(r) for r in runs)
        out.append(f'host_ordered = {{ value = true, source = "{_quote(HOST_ORDERED_SOURCE)}; measured on device cpu: {_quote(files)}" }}')
    out.append("")
    costs = _in_training(by_ranks, "\n".join(out + shares + gemms + colls), shares, share_at, fit, gemms, out)
    fit.toml = "\n".join(out + shares + gemms + colls + costs)
    return fit


def _in_training(by_ranks: dict[int, list[dict]], toml: str, shares: list[str], share_at: dict[int, int],
                 fit: Fit, gemms: list[str], head: list[str]) -> list[str]:
    """The fits of the recorded training steps (module docstring): returns the `[[collective_training]]`
    and `[[op_cost]]` blocks, appends the in-training `[[gemm_table]]` points to `gemms` and adds
    compute_contention, overlap_slowdown and collective_slowdown to the `[[node_share]]` blocks of
    `shares` (in place)."""
    if not any(r.get("steps") for g in by_ranks.values() for r in g):
        return []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "partial.toml"
        path.write_text(toml)
        micro = load_profile(str(path))  # the profile as the microbenchmarks alone fit it
    from twin.grid import Grid
    from twin.kernels import KernelModel
    from twin.program import ACT_BYTES
    costs: list[str] = []
    trained: list[str] = []
    pooled = _pooled_cpu_lines(by_ranks)
    sharing: list[tuple[str, int, int, float, tuple]] = []  # per file: what _core_load fits
    for ranks, group in sorted(by_ranks.items()):
        runs = [r for r in group if r.get("steps")]
        if not runs:
            continue
        src = "; ".join(describe(r) for r in runs)
        prof = micro.for_ranks(ranks)
        km = KernelModel(prof, tuning=False)
        rows = [(r, row) for r in runs for row in r["steps"]]
        span, how_timed, stretch = _fluid_spans(rows, ranks)
        src_t = f"{src}; {how_timed}"
        if stretch is not None and ranks > 1:
            sharing += [p for p in (_sharing_point(r, prof.host_op_s) for r in runs) if p is not None]
        # op kinds without a model of their own: measured lines, per kind and per role
        keyed: dict[tuple[str, str], list[dict]] = {}
        roles = {id(r): _cost_roles(r) for r in runs}
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
                (a0, b0, n_pts, lo, hi), level = shared, _cpu_level(shared, alone)
                a, b = a0 * level * stretch, b0 * level * stretch
                res = [(a + b * row["bytes"]) / span(row) - 1.0 for row in alone]
                how = (f"fitted: on-CPU time of {n_pts} {what} op(s) of recorded training steps with 2 or more ranks "
                       f"(bytes {lo}-{hi}, latency + bytes/bandwidth), x {level:.3f} (the {len(alone)} ops with "
                       f"{ranks} ranks over that line) x stretch {stretch:.3f}, worst residual "
                       f"{max(map(abs, res)):.0%}, {src_t}")
            else:
                a, b, res = _cost_line([row["bytes"] for row in alone], [span(row) for row in alone])
                how = (f"fitted: {len(alone)} {what} op(s) of recorded training steps, bytes "
                       f"{min(r['bytes'] for r in alone)}-{max(r['bytes'] for r in alone)}, worst residual "
                       f"{max(map(abs, res)):.0%}, {src_t}")
            fit.residuals.append(_residual(f"{ranks} rank(s): {what} ops in training, latency + bytes/bandwidth", res))
            costs.append("\n".join([
                "[[op_cost]]", f'kind = "{_quote(kind)}"', f'role = "{_quote(role)}"', f"ranks = {ranks}",
                "latency_s = " + _entry(max(a, 1e-9), how),
                "bandwidth = " + _entry(1.0 / b if b > 0 else 1e15, how + ("" if b > 0 else "; no size effect seen")),
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
                "training = true", "flops = " + _entry(2.0 * m * n * k / t, (
                    f"measured: median span {t * 1e6:.1f} us of {len(secs)} such GEMM(s) no collective overlapped "
                    f"in recorded training steps, {src_t}")), ""]))
        lines = []
        if stretch is not None:
            lines.append("stretch = " + _entry(stretch, (
                f"measured: summed span over summed on-CPU time of the compute ops of recorded training "
                f"steps (the in-training op times below are on-CPU time x this), {src}")))
        # attention: its efficiency inside training (of the rank's peak) replaces the microbenchmark's
        for phase, bwd in (("fwd", False), ("bwd", True)):
            att = [row for _, row in rows if row["kind"] == "attention" and row["name"].endswith(".bwd") == bwd
                   and row.get("covered", 0) < COVERED and row["flops"] > 0]
            if att:
                eff = statistics.median(row["flops"] / (prof.peak_flops * span(row)) for row in att)
                lines.append(f"attention_{phase}_efficiency = " + _entry(eff, (
                    f"measured: causal attention {'backward' if bwd else 'forward'} inside recorded training steps, "
                    f"median over {len(att)} ops no collective overlapped, of the peak scaled by compute_scale, {src_t}")))
        # GEMMs: inside training against the microbenchmarks
        modeled = [(row, _micro_time(km, row)) for _, row in rows if row["kind"] == "gemm"]
        alone = [(row, t) for row, t in modeled if row.get("covered", 0) < COVERED]
        over = [(row, t) for row, t in modeled if row.get("covered", 0) >= COVERED]
        contention = sum(span(r) for r, _ in alone) / sum(t for _, t in alone) if alone else 1.0
        if alone:
            lines.append("compute_contention = " + _entry(contention, (
                f"measured: GEMM time of {len(alone)} ops no collective overlapped in recorded "
                f"training steps, over their microbenchmark-fitted time, {src_t}")))
        if len(over) >= 3:
            slow = max(1.0, sum(span(r) for r, _ in over) / sum(t for _, t in over) / contention)
            lines.append("overlap_slowdown = " + _entry(slow, (
                f"measured: GEMM time of {len(over)} ops a collective overlapped in recorded training "
                f"steps, over their microbenchmark-fitted time x compute_contention (at least 1), {src_t}")))
        table = prof.collectives()
        ratios = []
        per_axis: dict[str, list[float]] = {}  # axis -> [inside training, alone] seconds summed
        lines_of: dict[tuple, list[tuple[dict, float, float]]] = {}  # (kind, axis, p, stride) -> (file, real bytes, s)
        covered = {id(r): _replayed_overlap(r, prof.host_op_s) for r in runs}  # collective -> s its rank computed
        measured = _measured_share(group)
        share, spans = _comm_share(rows, covered, prof.host_op_s, micro.activation_bytes,
                                   None if measured is None else measured[0])
        for r, row in rows:
            if row["kind"] not in COLLECTIVES:
                continue
            grid = Grid.parse(r["grid"])
            p, stride = grid.axis_size(row["axis"]), grid.stride(row["axis"])
            real = row["bytes"] if row["axis"] == "data" else row["bytes"] * micro.activation_bytes / ACT_BYTES
            # the compute op that waited for it resumes `wake_s` after its completion, of which the twin
            # charges that op's host time already (prof.host_op_s)
            # (less, with comm_share < 1, the part of its span it lost to its rank's compute: the twin
            # slows it there)
            woke = max(0.0, row.get("wake_s", 0.0) - prof.host_op_s)
            own = spans[id(row)]
            lines_of.setdefault((row["kind"], row["axis"], p, stride), []).append((r, real, own + woke))
            iso = table.time(row["kind"], row["axis"], p, row["bytes"], stride) if table is not None else None
            if iso:
                ratios.append(own / iso)
                both = per_axis.setdefault(row["axis"], [0.0, 0.0])
                both[0] += own + woke
                both[1] += iso
        for (kind, axis, p, stride), pts in sorted(lines_of.items()):
            alone = _alone_point(table, kind, p, stride)
            if alone is not None:
                a, b, res = _excess_line([x for _, x, _ in pts], [t for _, _, t in pts], alone)
                fitted = (f"fitted: the line measured alone ({kind} over {p}, stride {alone.stride}: its bandwidth) "
                          f"plus the mean excess per op inside training, {(a - alone.latency_s) * 1e3:+.3f} ms (their sum kept)")
            else:
                a, b, res = _collective_line([x for _, x, _ in pts], [t for _, _, t in pts])
                fitted = "fitted (least squares on seconds: their sum kept)"
            fit.residuals.append(_residual(f"{ranks} rank(s): {kind} over {axis} {p} (stride {stride}) in training", res))
            files = "; ".join(sorted({describe(r) for r, _, _ in pts}))
            woken = any("wake_s" in row for r, row in rows if row["kind"] == kind and row["axis"] == axis)
            how = (f"{fitted}: {len(pts)} {kind}s over {axis} of recorded "
                   f"training steps, {min(x for _, x, _ in pts):.0f}-{max(x for _, x, _ in pts):.0f} B, summed "
                   f"span{' and wake-up of the op that waited' if woken else ''} {sum(t for _, _, t in pts) * 1e3:.1f} ms, "
                   f"median residual {statistics.median(map(abs, res)):.0%}, {files}")
            trained.append("\n".join([
                "[[collective_training]]", f'kind = "{kind}"', f'axis = "{axis}"', f"group_size = {p}",
                f"stride = {stride}", f"ranks = {ranks}", "latency_s = " + _entry(max(a, 1e-9), how),
                "bandwidth = " + _entry(1.0 / b if b > 0 else 1e15, how + ("" if b > 0 else "; no size effect seen")),
                ""]))
        if per_axis:
            lines.append("axis_slowdown = { " + ", ".join(f"{a} = {_num(t / iso)}" for a, (t, iso) in sorted(per_axis.items()))
                         + f', source = "measured: per axis, the summed span (and wake-up of the op that waited, where '
                         f'measured) of the collectives of recorded training steps over their summed fitted time alone, '
                         f'{_quote(src)}" }}')
        if measured is not None:
            lines.append("comm_share = " + _entry(share, (
                f"measured: the share of its rate an all-reduce keeps beside a GEMM on its rank (alone vs beside, "
                f"issue to completion; fluid), median over {measured[1]} axes, {src}")))
        elif lines_of:
            lines.append("comm_share = " + _entry(share, (
                f"fitted: the share of its rate a collective keeps while its rank computes; the spans of the recorded "
                f"training steps' collectives less (1 - share) x the time their rank's compute ran beside them "
                f"(replayed from the steps' median spans) fit the per-axis lines best at this share (relative "
                f"least squares, steps of {COMM_SHARE_STEP}), {src}")))
        if ratios:
            lines.append("collective_slowdown = " + _entry(statistics.median(ratios), (
                f"measured: median over {len(ratios)} collectives of recorded training steps of their span over "
                f"their fitted time alone, {src}")))
        block = shares[share_at[ranks]].splitlines()
        keys = {ln.split(" =")[0] for ln in lines}
        block = [ln for ln in block if ln.split(" =")[0] not in keys]
        shares[share_at[ranks]] = "\n".join(block + lines + [""])
    if sharing:
        head[-1:-1] = _core_load(sharing, "; ".join(sorted({describe(r) for g in by_ranks.values() for r in g
                                                              if r.get("steps") and r["ranks_per_node"] > 1})))
    return trained + costs


COMM_SHARE_STEP = 0.05  # the grid of comm_share values tried


def _fluid_spans(rows: list[tuple[dict, dict]], ranks: int):
    """(span(row) -> seconds, how, stretch or None): what a compute op of the recorded steps costs, as the twin counts
    it. Where bench recorded on-CPU times (`cpu_s`): the op's on-CPU time x the stretch of all the
    recorded steps with this many ranks (their compute ops' summed span over summed on-CPU time: the
    rate at which a rank's compute progresses while `ranks` ranks share the cores, as a fluid).
    With more ranks than cores, a rank descheduled inside an op leaves that op's span long and the
    next one short, and each grid's steps time-slice their own way (8 ranks: a stretch of 1.9-3.1
    in the 35 runs of cpu-2026-12-01c); one op's span from one grid's steps then sets its shape's
    rate for every grid. Fitted from those runs' traces of the 13 benched grids (in place of their
    bench steps; benchmarks/cpu_op_points.py), the 35 runs' per-op median |error| is 17 % (24
    within 20 %) this way against 27 % (8) from the spans, 18 % against 30 % on the 22 grids not
    benched. Files without cpu_s: the spans."""
    comp = [row for _, row in rows if row["stream"] == "compute" and row["kind"] not in COLLECTIVES]
    timed = [row for row in comp if "cpu_s" in row]
    cpu = sum(row["cpu_s"] for row in timed)
    if not comp or len(timed) < len(comp) or cpu <= 0:
        return (lambda row: row["seconds"]), "spans (no on-CPU times recorded)", None
    stretch = max(1.0, sum(row["seconds"] for row in timed) / cpu)
    return ((lambda row: row["cpu_s"] * stretch if "cpu_s" in row else row["seconds"]),
            f"on-CPU time x stretch {stretch:.3f} (summed span over summed on-CPU time of the {len(timed)} "
            f"compute ops recorded with {ranks} rank(s))", stretch)


def _pooled_cpu_lines(by_ranks: dict[int, list[dict]]) -> dict[tuple[str, str], tuple]:
    """Per (kind, role) of the compute ops without a model of their own, the line of their on-CPU
    time (`cpu_s`) over the recorded steps of every file with 2 or more ranks: (latency s, seconds
    per byte, ops, smallest and largest bytes); least squares on relative error over the ops no
    collective overlapped. What an op costs on the CPU that runs it is the kernel's work, whatever
    the rank count; the rank count sets how long it waits for a core (the stretch) and, a little,
    the caches and memory it shares (each count's level, `_cpu_level`). Pooled, the line sees each
    op at every count's size: a norm over whole features is recorded at one size per rank count
    (262 kB with 8 ranks, cpu-2026-12-01d), where a line of 8 ranks alone is bandwidth alone and
    gave 1x8x1x1's 2 MB norms 1.3 ms of on-CPU time against 0.64 measured. One rank is left out:
    alone, it runs 2 threads (OMP_NUM_THREADS unset) and its main thread's on-CPU time is not its
    work. {} where the files did not record on-CPU times."""
    pts: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for ranks, group in by_ranks.items():
        if ranks < 2:
            continue
        for r in group:
            roles = _cost_roles(r)
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
        a, b, _ = _cost_line([x for x, _ in v], [t for _, t in v])
        out[key] = (a, b, len(v), min(x for x, _ in v), max(x for x, _ in v))
    return out


def _cpu_level(line: tuple, rows: list[dict]) -> float:
    """One rank count's on-CPU time of its ops over the pooled line's (summed; 1 without time)."""
    a, b = line[0], line[1]
    model = sum(a + b * row["bytes"] for row in rows)
    return sum(row["cpu_s"] for row in rows) / model if model > 0 else 1.0


def _cost_roles(run: dict) -> dict[str, str]:
    """Per op name of a measurement file's program, the role its measured cost line is keyed by
    (twin.kernels.cost_role: a norm over x-split features has its own); {} without a model."""
    from twin.grid import Grid
    from twin.kernels import cost_role
    from twin.model import load_model
    from twin.program import Options, build_program
    if not run.get("steps") or not run.get("model"):
        return {}
    prog = build_program(load_model(run["model"]), Grid.parse(run["grid"]), Options())
    return {op.name: cost_role(op) for op in prog.ops if op.role}


def _replay(run: dict, host_s: float):
    """(program, engine result with spans) of a measurement file's recorded steps replayed by the
    twin's engine with every op at its measured median span (compute ops plus the host time between
    them), host-ordered as the CPU executor issues them; None without steps."""
    from twin.engine import simulate_program
    from twin.grid import Grid
    from twin.model import load_model
    from twin.program import Options, build_program, host_ordered
    if not run.get("steps") or not run.get("model"):
        return None
    prog = host_ordered(build_program(load_model(run["model"]), Grid.parse(run["grid"]), Options()))
    secs = {row["name"]: row["seconds"] for row in run["steps"]}
    compute = [0.0 if op.is_collective else secs.get(op.name, 0.0) + host_s for op in prog.ops]
    return prog, simulate_program(prog, compute, lambda i, _: secs.get(prog.ops[i].name, 0.0), record=True)


def _replayed_overlap(run: dict, host_s: float) -> dict[str, float]:
    """Per collective of a measurement file's recorded steps, the seconds its rank's compute stream ran
    an op during its span, in the replay of the steps (_replay). {} without steps."""
    replayed = _replay(run, host_s)
    if replayed is None:
        return {}
    prog, res = replayed
    busy = sorted((s, s + d) for _, i, s, d in res.spans if not prog.ops[i].is_collective)
    out = {}
    for _, i, s, d in res.spans:
        if prog.ops[i].is_collective:
            out[prog.ops[i].name] = sum(max(0.0, min(s + d, b) - max(s, a)) for a, b in busy)
    return out


def _sharing_point(run: dict, host_s: float):
    """(grid, ranks, cores, stretch, busy shares) of one file's recorded steps for _core_load: the
    stretch of its compute ops (summed span over summed on-CPU time) and twin.cores.busy_shares of
    their replay; None where a compute op lacks its on-CPU time or the machine its core count."""
    from twin.cores import busy_shares
    comp = [row for row in run.get("steps", []) if row["stream"] == "compute" and row["kind"] not in COLLECTIVES]
    cores = run["machine"].get("cores")
    if not comp or not cores or not all("cpu_s" in row for row in comp):
        return None
    cpu = sum(row["cpu_s"] for row in comp)
    replayed = _replay(run, host_s)
    if cpu <= 0 or replayed is None:
        return None
    prog, res = replayed
    shares = busy_shares(res.spans, lambda i: prog.ops[i].is_collective, host_s)
    return run["grid"], run["ranks_per_node"], int(cores), sum(row["seconds"] for row in comp) / cpu, shares


LOAD_STEP = 0.01  # the grid of collective_core_load values tried
LOAD_MAX = 3.0


def _core_load(points: list[tuple[str, int, int, float, tuple]], src: str) -> list[str]:
    """The top-level lines node_cores and collective_core_load (twin.cores): the load (share of a
    core a collective in flight keeps busy) whose model stretch best matches the recorded steps'
    measured stretch (summed span over summed on-CPU time of the compute ops), least squares on
    the log of the ratio, over the files with 2 or more ranks; the busy shares from the steps'
    replay through the twin's engine. points: (grid, ranks, cores, stretch, shares). [] without
    points, or where the files disagree on the node's cores."""
    from twin.cores import core_stretch
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
    return [f"node_cores = " + _entry(cores.pop(), f"measured: os.cpu_count() of the bench machine, {src}"),
            "collective_core_load = " + _entry(load, (
                f"fitted: the share of a core a collective in flight keeps busy (twin.cores) that reproduces the "
                f"stretch (summed span over summed on-CPU time of the compute ops) of the recorded training steps "
                f"of {len(points)} grids of 2 or more ranks, from their busy shares replayed through the engine; "
                f"least squares on log(model/measured), median |residual| "
                f"{statistics.median(abs(e) for _, e in res):.0%}, worst {worst[1]:+.0%} ({worst[0]}), {src}"))]


def _measured_share(group: list[dict]) -> tuple[float, int] | None:
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


def _comm_share(rows: list[tuple[dict, dict]], covered: dict[int, dict[str, float]], host_s: float,
                act_bytes: int, share: float | None = None) -> tuple[float, dict[int, float]]:
    """(share, {id(row): seconds}) : the share of its rate a collective keeps while its rank's compute
    runs (CPU: gloo's threads and the compute share the cores), and each recorded collective's span
    less what it lost to the compute beside it, (1 - share) x its compute-covered seconds. The share
    is the one whose per-(kind, axis, group) lines (as _collective_line fits them) leave the least
    squared residual relative to the squared times (a scale-free criterion: taking time away shrinks
    the residuals too). 1 when no recorded collective had compute beside it. `share`: a measured one
    (bench's overlap rows), used as it is."""
    from twin.grid import Grid
    from twin.program import ACT_BYTES
    pts: dict[tuple, list[tuple[int, float, float, float]]] = {}
    for r, row in rows:
        if row["kind"] not in COLLECTIVES:
            continue
        grid = Grid.parse(r["grid"])
        real = row["bytes"] if row["axis"] == "data" else row["bytes"] * act_bytes / ACT_BYTES
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
                a, b, _ = _collective_line(x, t)
                sse += sum((a + b * xx - tt) ** 2 for xx, tt in zip(x, t))
                norm += sum(tt * tt for tt in t)
            if norm > 0 and sse / norm < best[0] - 1e-12:
                best = (sse / norm, share)
    share = best[1]
    return share, {i: s - (1 - share) * o for v in pts.values() for i, _, s, o, _ in v}


def _host_line(hosts: list[dict], src: str) -> str:
    """node_share host_op_s: the mean gap between consecutive compute ops with no collective in flight
    (`free_mean_s`: the twin charges it to every compute op, so it must sum as the gaps do; a few gaps
    are long when more ranks than cores time-slice), median over the files; files written before
    bench measured it give the median gap instead."""
    model = hosts[0].get("model", "the model")
    if all("free_mean_s" in row for row in hosts):
        return "host_op_s = " + _entry(statistics.median(row["free_mean_s"] for row in hosts), (
            f"measured: mean gap between consecutive compute ops of the executor with no collective in flight "
            f"({model} training steps), {src}"))
    return "host_op_s = " + _entry(statistics.median(row["seconds"] for row in hosts), (
        f"measured: median gap between consecutive compute ops of the executor ({model} training steps), {src}"))


def _collective_line(nbytes: list[float], seconds: list[float]) -> tuple[float, float, list[float]]:
    """(latency a >= 0, seconds per byte b >= 0, relative residuals) of seconds ~ a + b bytes over the
    collectives of recorded training steps, least squares on seconds (not on relative error): the
    fitted line then gives back their summed time, which is what an iteration pays (where the free fit
    has a term below 0, the one-term fit that keeps the sum: seconds ~ bytes x sum/sum, or the mean). A span inside
    training can be near 0 (a collective of a burst that completed while the one before it ran, as
    the data-axis all-reduces at the end of a step do: the span starts when the previous one ends),
    and a relative fit lets such spans pull the whole line to 0."""
    X, T = np.asarray(nbytes, float), np.asarray(seconds, float)
    best = None
    for fix in ((None, "a", "b") if len(set(nbytes)) >= 2 else ("b",)):
        if fix is None:
            (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(X), X], axis=1), T, rcond=None)
        elif fix == "a":
            a, b = 0.0, float(T.sum() / X.sum()) if np.any(X) else 0.0  # keeps the sum too
        else:
            a, b = float(T.mean()), 0.0
        if a < 0 or b < 0:
            continue
        err = float(np.sum((a + b * X - T) ** 2))
        if best is None or err < best[0]:
            best = (err, float(a), float(b))
    assert best is not None  # the constant fit (b = 0) always has a >= 0
    _, a, b = best
    return a, b, [((a + b * x) / t - 1.0) if t > 0 else 0.0 for x, t in zip(X, T)]


def _alone_point(table, kind: str, p: int, stride: int):
    """The `[[collective_table]]` point (measured alone) of this kind and group size, the nearest
    stride; None without one."""
    pts = [q for q in table.points if q.kind == kind and q.group_size == p] if table is not None else []
    return min(pts, key=lambda q: (q.stride != stride, abs(q.stride - stride))) if pts else None


def _excess_line(nbytes: list[float], seconds: list[float], alone) -> tuple[float, float, list[float]]:
    """(latency, seconds per byte, relative residuals) of a collective inside training: the line
    measured alone (`alone`, a CollectivePoint) with its latency raised by the mean excess of the
    recorded spans over it, so that the line gives back their summed time. The slope stays the
    microbenchmark's: it timed 5 sizes over three decades, alone, while the recorded steps hold a few
    sizes within a factor 4, each span carrying time-slicing noise and the wait for the group's last
    member, whose free least-squares slope came out anywhere from 7 MB/s to infinite (`[[collective_training]]`
    of cpu-2026-12-01c); 1x1x2x4's z reduce-scatters, 4x the bytes of the benched 2x2x2x1's, were
    predicted 4x their measured span. What training adds to a collective (the wait for the last
    member, the wake-up of its threads among busy cores) is taken per op, not per byte. Where the
    excess would leave a negative latency, the latency is 0 (the sum is then not kept)."""
    a0, b0 = alone.latency_s, 1.0 / alone.bandwidth
    extra = statistics.fmean(t - (a0 + b0 * x) for x, t in zip(nbytes, seconds))
    a = max(a0 + extra, 1e-9)
    return a, b0, [((a + b0 * x) / t - 1.0) if t > 0 else 0.0 for x, t in zip(nbytes, seconds)]


def _cost_line(nbytes: list[float], seconds: list[float]) -> tuple[float, float, list[float]]:
    """fit_line, or with a single size, bandwidth alone (latency when that size is 0 bytes)."""
    if len(set(nbytes)) >= 2:
        return fit_line(nbytes, seconds)
    t = statistics.median(seconds)
    res = [t / s - 1.0 for s in seconds]
    return (0.0, t / nbytes[0], res) if nbytes[0] > 0 else (t, 0.0, res)


def _micro_time(km, row: dict) -> float:
    """Seconds the microbenchmark-fitted kernel model gives a recorded GEMM."""
    return km.gemm_time(row["m"], row["n"], row["k"], row["layout"] or "NN")


def calibrate(paths: list[str | Path], out: str | Path, base: str | None = None) -> Fit:
    """Fit and write the profile to `out` (its name: the file's stem); checks that the twin loads it."""
    from twin.common import write_atomic
    from twin.profile import load_profile
    out = Path(out)
    if out.suffix != ".toml":
        raise TwinError(f"--out {out} must be a .toml file (calibration/profiles/NAME.toml)")
    fit = fit_profile(paths, out.stem, base)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".check.toml")
    tmp.write_text(fit.toml)
    try:
        load_profile(str(tmp))
    finally:
        tmp.unlink()
    write_atomic(out, fit.toml)
    return fit


def worst(fit: Fit) -> float:
    """The largest residual of all the fits (a ratio)."""
    return max((r.worst for r in fit.residuals), default=0.0) if fit.residuals else math.nan
