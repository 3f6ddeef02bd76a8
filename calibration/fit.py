"""Fitting `backend bench` measurements into a kernel profile (calibration/profiles/NAME.toml).

What is fitted, per count of ranks sharing a node (one measurement file per count, or several):
- GEMMs: each measured shape and layout becomes a `[[gemm_table]]` point (flop/s per rank, with the
  rank count); the kernel model uses the nearest point within a factor 2 in m, n and k.
- `[[node_share]]`: per-op overhead `launch_s` = eager forward+backward cost per op of a tiny autograd
  op; per-rank memory bandwidth from the elementwise-add sizes (seconds = dispatch + bytes / bandwidth,
  least squares on relative error); `overlap_slowdown` = median GEMM slowdown while an all-reduce runs
  (at least 1); `host_op_s` = the executor's host time per compute op (median gap between consecutive
  compute ops of a few training steps of the model on the grid), where bench measured it.
- `[[collective_table]]`: per kind, group size and stride, seconds = latency + bytes / bandwidth over
  the measured payloads (least squares on relative error, both terms kept >= 0).
Scalars the measurements do not reach (peak, tiles, attention efficiency, layout penalties) are
copied from a base profile with their sources. Every fitted number's source names its measurement file.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibration.measurements import describe, load_measurement
from topologies.datafile import read_spec
from twin.common import TwinError
from twin.profile import PROFILES_DIR

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
            shares.append("\n".join([
                "[[node_share]]", f"ranks = {ranks}",
                "launch_s = " + _entry(launch, f"measured: eager forward+backward per op of a tiny autograd op, {src}"),
                "hbm_bandwidth = " + _entry(bw, f"fitted: elementwise add over {len(adds)} sizes, {src}"),
                "overlap_slowdown = " + _entry(slow, (f"measured: median GEMM slowdown under an all-reduce "
                                                      f"({len(over)} axes, at least 1), {src}") if over
                                               else "no overlap measured with this many ranks: 1"),
                "compute_scale = " + _compute_scale(square, ranks, most, src)]
                + (["host_op_s = " + _entry(statistics.median(row["seconds"] for row in hosts),
                                            f"measured: median gap between consecutive compute ops of the executor "
                                            f"({hosts[0].get('model', 'the model')} training steps), {src}")] if hosts else [])
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
        if key == "gemm_flops" and by_ranks[least][0]["gemm"]:
            rows = [row for r in by_ranks[least] for row in r["gemm"]]
            top = max(rows, key=lambda row: row["m"] * row["n"] * row["k"] / row["seconds"])
            value = 2.0 * top["m"] * top["n"] * top["k"] / top["seconds"]
            source = f"measured: fastest GEMM ({top['m']}x{top['n']}x{top['k']} {top['layout']}) with {least} rank(s), {describe(by_ranks[least][0])}"
            if value > base_data["peak_flops"]["value"]:  # the assumed peak is too low: keep the base figure
                value, source = entry["value"], (f"base profile {base_path.name} (the measured {value:.3g} "
                                                 f"flop/s exceeds its assumed peak): {entry.get('source', '')}")
        out.append(f"{key} = {_entry(value, _quote(source))}")
    for key in ("layout_penalty", "layout_penalty_small"):
        e = base_data[key]
        out.append(f'{key} = {{ NN = {e["NN"]}, NT = {e["NT"]}, TN = {e["TN"]}, source = "{_quote("base profile " + base_path.name + ": " + e.get("source", ""))}" }}')
    if first is not None:  # measured on CPU only: absent (0) elsewhere
        out += [ln for ln in first.splitlines() if ln.startswith("host_op_s =")]
    out.append("")
    fit.toml = "\n".join(out + shares + gemms + colls)
    return fit


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
