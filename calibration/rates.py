"""The `[[node_share]]` figures bench's microbenchmarks give per rank count: the GEMM rate per rank
(compute_scale, gemm_flops), attention efficiency, and the executor's host time per compute op."""

from __future__ import annotations

import statistics

from calibration.measurements import describe
from calibration.profile_text import entry_text


def square_rates(group: list[dict]) -> dict[int, float]:
    """flop/s per rank of the square NN GEMMs (m = n = k) a group of measurements timed, by size."""
    out: dict[int, list[float]] = {}
    for r in group:
        for row in r["gemm"]:
            if row["m"] == row["n"] == row["k"] and row["layout"] == "NN":
                out.setdefault(row["m"], []).append(2.0 * row["m"] ** 3 / row["seconds"])
    return {size: statistics.median(v) for size, v in out.items()}


def compute_scale(square: dict[int, dict[int, float]], ranks: int, most: int, src: str) -> str:
    common = sorted(set(square[ranks]) & set(square[most]))
    if not common:
        return entry_text(1.0, "not measured (no square GEMM timed with this many and with the most ranks): 1")
    size = common[-1]
    return entry_text(square[ranks][size] / square[most][size],
                  f"measured: {size}^3 GEMM rate per rank with {ranks} over {most} rank(s), {src}")


def scale_value(square: dict[int, dict[int, float]], ranks: int, most: int) -> float:
    common = sorted(set(square[ranks]) & set(square[most]))
    return square[ranks][common[-1]] / square[most][common[-1]] if common else 1.0


def measured_rates(by_ranks: dict[int, list[dict]], square: dict[int, dict[int, float]], most: int) -> dict:
    """{key: f(base value, base source) -> (value, source)} for the profile's per-rank figures with the
    most ranks (`most`) sharing the node that bench measures: gemm_flops, their largest square NN
    GEMM's rate per rank (the rate compute_scale scales to other rank counts; the kernel model's
    roofline for shapes no measured point is near), even where it is above the assumed peak: an
    assumed rate in its place put gpt-small's GEMMs 5.7x too slow on the 2-core development VM (1.5x
    with the measured rate; median over its 35 grids). The peak stays the
    system's (twin.predict.study checks they agree); where one rank alone beat it, the source says so."""
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


def attention_lines(group: list[dict], ranks: int, peak: float, scale: float, src: str) -> list[str]:
    """node_share lines: attention efficiency (program flops over the rank's scaled peak x time), the
    median over the measured shapes; none when attention was not measured."""
    rows = [row for r in group for row in r.get("attention", [])]
    if not rows:
        return []
    out = []
    for phase in ("fwd", "bwd"):
        eff = statistics.median(row[f"{phase}_flops"] / (peak * scale * row[f"{phase}_s"]) for row in rows)
        out.append(f"attention_{phase}_efficiency = " + entry_text(
            eff, f"measured: causal attention {'forward' if phase == 'fwd' else 'backward'}, median over "
                 f"{len(rows)} program shapes, of the peak scaled by compute_scale, {src}"))
    return out


def host_line(hosts: list[dict], src: str) -> str:
    """node_share host_op_s: the mean gap between consecutive compute ops with no collective in flight
    (`free_mean_s`: the twin charges it to every compute op, so it must sum as the gaps do; a few gaps
    are long when more ranks than cores time-slice), median over the files; files written before
    bench measured it give the median gap instead."""
    model = hosts[0].get("model", "the model")
    if all("free_mean_s" in row for row in hosts):
        return "host_op_s = " + entry_text(statistics.median(row["free_mean_s"] for row in hosts), (
            f"measured: mean gap between consecutive compute ops of the executor with no collective in flight "
            f"({model} training steps), {src}"))
    return "host_op_s = " + entry_text(statistics.median(row["seconds"] for row in hosts), (
        f"measured: median gap between consecutive compute ops of the executor ({model} training steps), {src}"))
