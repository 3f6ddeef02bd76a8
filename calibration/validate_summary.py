"""Validation's summaries: errors per kind of op, repeated runs of one job pooled, the grid ranking.

`by_kind` sums a run's per-op errors per kind (median and 90th percentile of |error|, shares of peer
wait and predicted excess for collectives); `pool_repeats` makes one report entry of repeated runs of
the same job, at their medians; `spearman` ranks the grids, predicted against measured; `Targets`
are the project's per machine (`targets_for` a report).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from calibration.validate_measured import COLLECTIVES


@dataclass(frozen=True)
class Targets:
    """How close the twin should come (fractions; README, "Calibration: is the twin right?")."""
    iteration: float
    per_op: float
    memory: float
    spearman: float


CPU_TARGETS = Targets(iteration=0.15, per_op=0.20, memory=0.10, spearman=0.9)  # 1-8 ranks on one CPU node
GPU_TARGETS = Targets(iteration=0.05, per_op=0.10, memory=0.10, spearman=0.9)  # one H200


def targets_for(report: dict) -> Targets:
    """The targets of a validation report's runs: the CPU loop's where they ran on the `cpu` system,
    else one H200's."""
    return CPU_TARGETS if report["runs"][0].get("system") == "cpu" else GPU_TARGETS


def _percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    i = q * (len(v) - 1)
    lo = int(i)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (i - lo)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (average ranks for ties)."""
    if len(a) != len(b) or len(a) < 2:
        return float("nan")

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def by_kind(ops: list[dict], zero: dict[str, list[int]]) -> dict:
    """Per kind of op: count, median and 90th percentile of |error|, summed seconds; for collectives the
    peer-wait and predicted-excess shares, the error from the last arrival, from `zero` (kind ->
    [spans, spans of 0 s]) the share completed with the one before, and the host's mean wall time
    per issue where the trace recorded it (`issue_s`)."""
    per_kind = {}
    for kind in sorted({o["kind"] for o in ops}):
        sel = [o for o in ops if o["kind"] == kind]
        errs = [abs(o["error"]) for o in sel]
        per_kind[kind] = {"ops": len(errs), "median_abs_error": statistics.median(errs),
                          "p90_abs_error": _percentile(errs, 0.9),
                          "median_error": statistics.median(o["error"] for o in sel),
                          "measured_s": sum(o["measured_s"] for o in sel),
                          "predicted_s": sum(o["predicted_s"] for o in sel),
                          "wall_s": sum(o["wall_s"] for o in sel)}
        if kind in COLLECTIVES:
            per_kind[kind]["peer_wait_share"] = (sum(o.get("peer_wait_s", 0.0) for o in sel)
                                                 / max(per_kind[kind]["wall_s"], 1e-12))
            per_kind[kind]["predicted_excess_share"] = (sum(o.get("predicted_excess_s", 0.0) for o in sel)
                                                        / max(per_kind[kind]["predicted_s"], 1e-12))
            after = [abs(o["error_from_last_arrival"]) for o in sel if "error_from_last_arrival" in o]
            if after:
                per_kind[kind]["median_abs_error_from_last_arrival"] = statistics.median(after)
            if kind in zero:
                per_kind[kind]["completed_with_previous_share"] = zero[kind][1] / zero[kind][0]
            issued = [o["issue_s"] for o in sel if "issue_s" in o]
            if issued:  # the host's wall time per issue, mean over the kind's collectives (trace's issue_us)
                per_kind[kind]["issue_s"] = statistics.fmean(issued)
        else:
            per_kind[kind]["cpu_s"] = sum(o.get("cpu_s", 0.0) for o in sel)
    return per_kind


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def pool_repeats(runs: list[dict]) -> dict:
    """One report entry for repeated runs of the same job (validate_run's results: same model, grid,
    batch, switches; so the same prediction). Measured figures are medians over the repeats: the
    iteration (with each run's and their spread, max/min - 1, beside it), each op's measured, wall,
    on-CPU, peer-wait, wake-up and issue figures (per op name; its error taken again against the median), the
    stretch, the time outside ops and the memory peak. `repeats` counts the runs, `runs` names them."""
    first = runs[0]
    its = [r["iteration"]["measured_s"] for r in runs]
    measured = statistics.median(its)
    predicted = first["iteration"]["predicted_s"]
    iteration = {**first["iteration"], "measured_s": measured, "error": predicted / measured - 1,
                 "steps_used": sum(r["iteration"]["steps_used"] for r in runs),
                 "outside_ops_measured_s": _median([r["iteration"]["outside_ops_measured_s"] for r in runs]),
                 "measured_each_s": its, "spread": max(its) / min(its) - 1}
    if len(runs) == 1:
        return {**first, "runs": [first["run"]], "repeats": 1, "iteration": iteration}
    by_name: dict[str, list[dict]] = {}
    for r in runs:
        for o in r["per_op"]:
            by_name.setdefault(o["name"], []).append(o)
    ops = []
    for name, same in by_name.items():
        o = dict(same[0])
        for key in ("measured_s", "wall_s", "cpu_s", "peer_wait_s", "wake_s", "issue_s"):
            if key in o:
                o[key] = statistics.median(x[key] for x in same if key in x)
        o["error"] = o["predicted_s"] / o["measured_s"] - 1
        o.pop("error_from_last_arrival", None)
        after = o["measured_s"] - o.get("peer_wait_s", 0.0)
        if "predicted_excess_s" in o and after > 0:
            o["error_from_last_arrival"] = (o["predicted_s"] - o["predicted_excess_s"]) / after - 1
        ops.append(o)
    zero: dict[str, list[int]] = {}
    for r in runs:
        for kind, (n, n0) in r["ops"].get("collective_spans", {}).items():
            z = zero.setdefault(kind, [0, 0])
            z[0] += n
            z[1] += n0
    compute = [abs(o["error"]) for o in ops if o["kind"] not in COLLECTIVES]
    ops_summary = {**first["ops"], "matched": len(ops),
                   "unmatched": sorted({u for r in runs for u in r["ops"]["unmatched"]}),
                   "stretch": _median([r["ops"]["stretch"] for r in runs]),
                   "median_abs_error": statistics.median([abs(o["error"]) for o in ops]) if ops else None,
                   "compute_median_abs_error": statistics.median(compute) if compute else None,
                   "by_kind": by_kind(ops, zero), "collective_spans": zero}
    mem = first["memory"]
    mem_meas = _median([r["memory"]["measured_bytes"] for r in runs])
    memory = {**mem, "measured_bytes": mem_meas,
              "error": mem["predicted_bytes"] / mem_meas - 1 if mem_meas else None}
    return {**first, "runs": [r["run"] for r in runs], "repeats": len(runs), "iteration": iteration,
            "ops": ops_summary, "memory": memory, "per_op": ops}
