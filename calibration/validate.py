"""Validation: the twin's prediction of a run against what `backend run` measured.

`validate_run(RUN_DIR)` reads what the run wrote (trace/: every op of the traced step, one file per
rank, with model, grid and switches in its metadata; log.jsonl: the step times; summary.json: the
measured memory peak per rank), simulates the same run (model, grid, batch, switches, GEMMs in the
program's layout as the backend runs them) on a system with a kernel profile, and compares:
- iteration: predicted time against the median measured step time (steps after the first two);
- per op: for each op name, predicted duration against the median over ranks of the measured one
  (the mean for a collective, see below);
  error = predicted / measured - 1, summarized per kind as the median and 90th percentile of |error|.
  Like is compared with like:
  - a compute op: the twin shares the node's cores among its ranks as a fluid, every op of a rank
    `stretch` times slower (the grid's own, twin.host.cores, reported as `stretch_predicted` beside the
    measured `stretch`; where the profile has no model of it, the pooled `stretch_profile`); the scheduler time-slices them instead, and a descheduled rank's wall
    span lands on whichever op it was running (one op of 1 ms takes 10 ms, the next 1 ms). So the
    measured figure is the op's on-CPU time (the trace's `cpu_us`; in a trace without it, the
    fastest rank's wall span of the same op, which every rank runs on the same shapes) times its
    rank's stretch, wall over on-CPU time summed over the rank's compute ops: the rank's total is
    kept, spread over its ops as a fluid share would. The wall and on-CPU medians are reported too.
    The twin's predicted span holds the host time before the op (the profile's host_op_s, and its
    host_issue_s per collective issued just before the op that it does not wait for:
    twin.host.order.host_times), the measured span only the kernel: the host time is taken off before
    comparing;
  - a collective: its measured span runs from its issue (or the end of the previous collective of
    its stream) to its completion, as the twin's does. Part of it is waiting for the group's last
    member to issue it (on aligned clocks: the latest start among the group's ranks), reported per
    kind as `peer_wait_share`. That wait is skewed over the ranks (the last to arrive waits 0, the
    first the longest), and the twin's one lockstep span stands for the group's mean: its lines keep
    the summed spans of bench's recorded steps, each a mean over ranks. So a collective's measured
    figure, and its peer wait, are the mean over ranks, as bench takes them (on the 2-core development
    VM, all-reduces' median |error| 34 % so, 44 % against the median over ranks). The
    twin's line inside training also holds the wake-up after the collective (from its completion to
    the start of the compute op that waited for it, beyond the host time the twin charges that op:
    bench's `wake_s`, which the fit adds to each span), so the measured figure adds the same, per rank
    (`wake_s` in the report; it took the collectives' per-op median |error| down by 1-4 points on the
    development VM; a GPU span is compared as it is). The
    twin's ranks run in lockstep and arrive together; what a
    collective costs inside training beyond its line measured alone (the profile's per-op excess:
    that wait, wake-ups among busy cores) is its `predicted_excess_s`. So each collective is also
    compared from its last member's arrival: predicted span less the excess against measured span
    less the peer wait (`error_from_last_arrival`, per kind `median_abs_error_from_last_arrival`),
    beside the whole span's error, which stays the headline (the iteration pays the wait).
    Where the trace recorded it (`issue_us`, backend/runtime/comm.py), each collective's `issue_s` is the
    host's wall time issuing it (mean over ranks; per kind, the mean over its collectives), beside
    `host_issue_predicted_s`, what the twin charges the compute op after an issue.
    `completed_with_previous_share`: the share of a kind's spans (all ranks) that completed no later
    than the collective issued before them on their stream (a span of 0: the recorder starts a span
    at the previous one's end), so that two collectives of one axis progressed at once (gloo runs two
    per process group; the twin's axis stream runs one at a time);
- memory: the twin's peak per rank against the measured peak (max over ranks).
`validate_runs` adds the grid ranking: Spearman's rank correlation of predicted against measured
iteration times over the runs. calibration.validate_page draws the report as a page (`--html`).
What the run measured is read in calibration.validate_measured; the summaries (per kind, repeats
pooled, Spearman) are made in calibration.validate_summary.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from calibration.noise import noise_floor
from calibration.validate_measured import COLLECTIVES, measured_ops, read_run
from calibration.validate_summary import by_kind, pool_repeats, spearman, targets_for
from topologies.common import TwinError, cpu_model
from twin.costs.profile_types import HostSharing
from twin.program.grid import Grid
from twin.program.program import Options

SKIP_STEPS = 2  # warm-up steps left out of the measured iteration time


def _excess_of(study, grid: Grid) -> dict[str, float]:
    """Per collective of the study's program (name -> seconds): what the profile's line inside training
    gives beyond its line measured alone (the per-op excess of calibration/fit.py's `_excess_line`),
    at the op's bytes; {} where the profile has no measured collectives."""
    from twin.costs.profile_types import CollectiveTable
    from twin.predict.study_cache import program_for
    table = study.profile.collectives()
    if table is None:
        return {}
    alone = CollectiveTable(table.points, table.activation_bytes)
    out = {}
    for op in program_for(study, grid).ops:
        if op.is_collective and grid.axis_size(op.axis) > 1:
            args = (op.kind, op.axis, grid.axis_size(op.axis), op.bytes, grid.stride(op.axis))
            t, t0 = table.time(*args), alone.time(*args)
            if t is not None and t0 is not None:
                out[op.name] = max(t - t0, 0.0)
    return out


def _host_of(study, grid: Grid) -> dict[str, float]:
    """Per op name of the study's program, the host time the twin charges before it (seconds;
    twin.host.order.host_times: the host's op_s, plus its issue_s per collective issued just before it
    that it does not wait for)."""
    from twin.host.order import host_times
    from twin.predict.study_cache import program_for
    prog = program_for(study, grid)
    host = _host(study)
    return {op.name: h for op, h in zip(prog.ops, host_times(prog.ops, host.op_s, host.issue_s, host.exchange_s))}


def _host(study) -> HostSharing:
    """The host part of the study's profile (for its rank count); all defaults where it has none."""
    return study.kernels.profile.host or HostSharing()


def _predicted_stretch(study, grid: Grid) -> float | None:
    """The twin's stretch of this grid's compute ops (twin.host.sharing.shared_core_stretch), or None."""
    from twin.host.sharing import as_run, shared_core_stretch
    from twin.predict.study_cache import model_for, program_for
    if study.profile.host is None or grid.pipe > 1:  # the host model is not applied to pipelined grids
        return None
    prog = as_run(study.profile.host, program_for(study, grid))
    return shared_core_stretch(study, grid, prog, model_for(study, grid))


def validate_run(run_dir: str | Path, system: str = "cpu", profile: str | None = None) -> dict:
    """Predicted against measured for one run (see the module docstring); a JSON-ready dict."""
    from twin.predict.memory import memory_per_gpu
    from twin.program.model import load_model
    from twin.predict.run import simulate_grid
    from twin.predict.study import prepare

    run = read_run(run_dir)
    meta, steps = run["meta"], run["steps"]
    spec = load_model(meta["model"])
    grid = Grid.parse(meta["grid"])
    known = Options.__dataclass_fields__
    options = Options(**{k: v for k, v in meta["options"].items() if k in known})
    tokens = steps[-1]["tokens_per_s"] * steps[-1]["step_time_s"]
    batch = int(round(tokens / spec.seq_len))
    study = prepare(system, spec, grid.size, batch, spec.seq_len, options, profile=profile, gemm_tuning=False)
    res = simulate_grid(study, grid, record=True)
    warm = [s["step_time_s"] for s in steps if s["step"] > SKIP_STEPS] or [s["step_time_s"] for s in steps]
    measured_it = statistics.median(warm)

    host = _host(study).op_s
    got = measured_ops(run["spans"], grid, time_sliced=meta.get("device", "cpu") == "cpu", host_s=host)
    measured = got["fluid"]
    kinds = {s.name: s.kind for s in run["spans"]}
    predicted: dict[str, list[float]] = {}
    excess = _excess_of(study, grid)
    host_of = _host_of(study, grid)
    for s in res.spans:
        host_s = 0.0 if s.kind in COLLECTIVES else host_of.get(s.name, host)
        predicted.setdefault(s.name, []).append(max(s.duration_s - host_s, 0.0))
    ops = []
    for name, times in measured.items():
        if name not in predicted:
            continue
        coll = kinds[name] in COLLECTIVES
        m, p = (statistics.fmean if coll else statistics.median)(times), statistics.median(predicted[name])
        if m > 0:
            op = {"name": name, "kind": kinds[name], "measured_s": m, "predicted_s": p, "error": p / m - 1,
                  "wall_s": (statistics.fmean if coll else statistics.median)(got["wall"][name])}
            if name in got["cpu"]:
                op["cpu_s"] = statistics.median(got["cpu"][name])
            if name in got["wait"]:
                op["peer_wait_s"] = statistics.fmean(got["wait"][name])
            if coll and name in got["wake"]:
                op["wake_s"] = statistics.fmean(got["wake"][name])
            if coll and got["issue"].get(name):
                op["issue_s"] = statistics.fmean(got["issue"][name])
            if coll and name in excess:
                op["predicted_excess_s"] = min(excess[name], p)
                after = m - op.get("peer_wait_s", 0.0)
                if after > 0:
                    op["error_from_last_arrival"] = (p - op["predicted_excess_s"]) / after - 1
            ops.append(op)
    zero: dict[str, list[int]] = {}  # kind -> [spans, spans of 0 s] of the collectives
    for sp in run["spans"]:
        if sp.kind in COLLECTIVES:
            z = zero.setdefault(sp.kind, [0, 0])
            z[0] += 1
            z[1] += sp.duration_s < 1e-7
    per_kind = by_kind(ops, zero)
    compute = [abs(o["error"]) for o in ops if o["kind"] not in COLLECTIVES]
    from twin.program.trace import trace_breakdown
    idle = [trace_breakdown([s for s in run["spans"] if s.rank == r])["idle"] for r in {s.rank for s in run["spans"]}]
    mem_pred = memory_per_gpu(spec, grid, options, batch, spec.seq_len, study.profile.activation_bytes)
    peaks = run["summary"].get("memory_peak_bytes")
    mem_meas = max(peaks) if isinstance(peaks, list) and peaks else None
    return {
        "run": run["dir"], "model": spec.name, "grid": str(grid), "ranks": grid.size, "batch": batch,
        "options": meta["options"], "profile": study.profile.name, "system": study.system.name,
        "notes": list(res.notes),  # what the prediction extrapolates (twin.predict.study.coverage_notes)
        "iteration": {"measured_s": measured_it, "predicted_s": res.iteration_time_s,
                      "error": res.iteration_time_s / measured_it - 1, "steps_used": len(warm),
                      # time of the traced step outside every recorded op (host work between ops),
                      # median over ranks, and the twin's idle time
                      "outside_ops_measured_s": statistics.median(idle) if idle else None,
                      "idle_predicted_s": res.breakdown_s["idle"],
                      "host_per_op_predicted_s": host,
                      # the host time the twin charges per collective issued (to the compute op after it)
                      "host_issue_predicted_s": _host(study).issue_s},
        "ops": {"matched": len(ops), "unmatched": sorted(set(measured) - set(predicted)),
                "cpu_source": got["cpu_source"],
                # wall over on-CPU time of each rank's compute ops (1: a core to itself), median over ranks
                "stretch": statistics.median(got["stretch"].values()) if got["stretch"] else None,
                # the stretch the profile's compute op times hold (measured by bench's recorded steps
                # with this many ranks; None where not measured): compute ops come out about
                # stretch_profile / stretch of the measured, whatever their on-CPU cost
                "stretch_profile": _host(study).stretch or None,
                # this grid's own stretch as the twin predicts it (twin.host.cores: the ranks share the
                # node's cores with each other and with gloo's threads); None where the profile has
                # no model of it (every grid then at stretch_profile)
                "stretch_predicted": _predicted_stretch(study, grid),
                "median_abs_error": statistics.median([abs(o["error"]) for o in ops]) if ops else None,
                "compute_median_abs_error": statistics.median(compute) if compute else None,
                "by_kind": per_kind, "collective_spans": zero},
        "memory": {"predicted_bytes": mem_pred.total, "predicted": mem_pred.as_dict(), "measured_bytes": mem_meas,
                   "error": mem_pred.total / mem_meas - 1 if mem_meas else None},
        "per_op": ops,
    }


def validate_runs(run_dirs: list[str | Path], system: str = "cpu", profile: str | None = None,
                  progress=None) -> dict:
    """validate_run over several runs, repeated runs of one job pooled into one entry (pool_repeats;
    runs are the same job when model, grid, batch and switches agree), in the order of their first
    run; plus the grid ranking over the entries (Spearman, predicted vs measured) and, where a grid
    ran twice or more, what the runs' own noise allows (calibration.noise.noise_floor; else None).
    progress(what, done, total) is called before each run (twin.present.progress.Steps)."""
    if not run_dirs:
        raise TwinError("twin validate needs at least one run directory (from `backend run --out DIR`)")
    groups: dict[str, list[dict]] = {}
    for i, d in enumerate(run_dirs):
        if progress is not None:
            progress(f"validating {Path(d).name}", i, len(run_dirs))
        r = validate_run(d, system, profile)
        key = json.dumps([r["model"], r["grid"], r["batch"], r["options"]], sort_keys=True)
        groups.setdefault(key, []).append(r)
    runs = [pool_repeats(rs) for rs in groups.values()]
    pred = [r["iteration"]["predicted_s"] for r in runs]
    meas = [r["iteration"]["measured_s"] for r in runs]
    machine = machine_note(system, profile)
    return {"runs": runs, "notes": sorted({n for r in runs for n in r.get("notes", [])}) + ([machine] if machine else []),
            "spearman": spearman(pred, meas) if len(runs) >= 3 else None,
            "worst_iteration_error": max(abs(r["iteration"]["error"]) for r in runs),
            "repeats": sum(r["repeats"] for r in runs),
            "noise": noise_floor([r["iteration"]["measured_each_s"] for r in runs], targets_for({"runs": runs}).iteration)}


def this_cpu() -> str:
    """This machine's CPU model as bench records it (backend.bench.bench.machine_info), "" where unknown."""
    return cpu_model()


def machine_note(system: str, profile: str | None) -> str | None:
    """One line when a CPU profile was fitted on another kind of CPU than this machine's (its
    [fitted_from] machines; where `twin validate` runs is taken as where the runs ran), else None."""
    from topologies.system import load_system
    from twin.costs.profile import load_profile, profile_for_gpu
    if system != "cpu":
        return None
    prof = load_profile(profile) if profile else profile_for_gpu(load_system(system).gpu.name)
    machines = prof.fitted_from.get("machines", [])
    cpu = this_cpu()
    if not machines or not cpu or any(m.startswith(cpu) for m in machines):
        return None
    return (f"kernel profile {prof.name} was fitted on {', '.join(machines)}, not this machine's {cpu}: its "
            f"rates are another machine's (fit this one's with `twin calibrate --run`)")
