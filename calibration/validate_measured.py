"""What a `backend run` wrote and measured, read as validation compares it with the twin.

`read_run(RUN_DIR)` reads the run's trace, step log and summary; `measured_ops` turns its spans into
per-op figures (wall spans, on-CPU times, the fluid spans compared with the twin, each rank's stretch,
a collective's peer wait and wake-up): calibration.validate's docstring says why each is taken so.
"""

from __future__ import annotations

import json
from pathlib import Path

from topologies.common import TwinError
from twin.program.grid import Grid

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def read_run(run_dir: str | Path) -> dict:
    """What a run wrote: metadata, step times, memory peaks, spans. Raises TwinError, one line."""
    from twin.program.trace import read_metadata, read_trace, trace_files
    d = Path(run_dir)
    trace, log = d / "trace", d / "log.jsonl"
    if not trace.exists() and (d / "trace.json").exists():
        trace = d / "trace.json"  # a run written before traces became one file per rank
    for f in (trace, log):
        if not f.exists():
            raise TwinError(f"{d} is not a run directory of `backend run`: {f.name} is missing")
    if not trace_files(trace):
        raise TwinError(f"{trace} holds no trace files (rank0.json, ...): rerun `backend run --out {d}`")
    try:
        meta = read_metadata(trace)
        steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TwinError(f"{d}: a file of the run is not valid JSON ({e})") from None
    missing = [k for k in ("model", "grid", "options") if k not in meta]
    if missing:
        raise TwinError(f"{trace}: trace metadata lacks {', '.join(missing)} (write it with `backend run`)")
    if not steps:
        raise TwinError(f"{log}: no step times (each line needs step_time_s)")
    from topologies.schema import RUN_LOG_RECORD, RUN_SUMMARY, check
    for i, record in enumerate(steps, 1):
        check(record, RUN_LOG_RECORD, f"{log} line {i}", "run log")
    check(summary, RUN_SUMMARY, d / "summary.json", "run summary")
    return {"dir": str(d), "meta": meta, "steps": steps, "summary": summary, "spans": read_trace(trace)}


def measured_ops(spans: list, grid: Grid, time_sliced: bool = True, host_s: float = 0.0) -> dict:
    """Per op name, what was measured (seconds, one value per rank): `wall` spans, `cpu` on-CPU times
    and the `fluid` spans compared with the twin (see calibration.validate's docstring); plus `stretch` (rank ->
    wall over on-CPU time of its compute ops), `cpu_source` and, per collective, `wait` (time its
    rank waited for the group's last member to issue it) and `wake` (from its completion to the start
    of the compute op that waited for it, where it completed last in the gap before that op; else 0)
    and `issue` (the host's wall time issuing it, the trace's issue_us, where recorded).
    time_sliced: the ranks ran on CPU cores (False on GPUs, whose kernels are not descheduled: the
    fluid span is the wall span, and no wake-up is added). A collective's fluid figure is its span plus
    its wake-up beyond `host_s` (the host time the twin charges the op that waited), as the twin's
    line inside training holds it (calibration/fit.py fits bench's `wake_s` so)."""
    wall: dict[str, list[float]] = {}
    for s in spans:
        wall.setdefault(s.name, []).append(s.duration_s)
    recorded = any("cpu_us" in s.args for s in spans if s.kind not in COLLECTIVES)
    fastest = {name: min(times) for name, times in wall.items()}

    def cpu_of(s) -> float:
        if not time_sliced:
            return s.duration_s
        if recorded:
            return min(s.args.get("cpu_us", s.duration_s * 1e6) / 1e6, s.duration_s)
        return fastest[s.name]

    stretch: dict[int, float] = {}
    for rank in {s.rank for s in spans}:
        comp = [s for s in spans if s.rank == rank and s.kind not in COLLECTIVES]
        on_cpu = sum(cpu_of(s) for s in comp)
        stretch[rank] = max(sum(s.duration_s for s in comp) / on_cpu, 1.0) if on_cpu > 0 else 1.0
    cpu: dict[str, list[float]] = {}
    fluid: dict[str, list[float]] = {}
    wait: dict[str, list[float]] = {}
    woke = _wake_ups(spans) if time_sliced else {}
    starts = {(s.name, s.rank): s.start_s for s in spans if s.kind in COLLECTIVES}
    for s in spans:
        if s.kind not in COLLECTIVES:
            c = cpu_of(s)
            cpu.setdefault(s.name, []).append(c)
            fluid.setdefault(s.name, []).append(c * stretch[s.rank])
            continue
        fluid.setdefault(s.name, []).append(s.duration_s + max(0.0, woke.get((s.name, s.rank), 0.0) - host_s))
        axis = s.args.get("axis")
        if axis in ("x", "y", "z", "data") and s.rank < grid.size:
            last = max(starts.get((s.name, r), s.start_s) for r in _group(grid, s.rank, axis))
            wait.setdefault(s.name, []).append(min(max(last - s.start_s, 0.0), s.duration_s))
    source = ("recorded (cpu_us)" if recorded else "fastest rank's wall span") if time_sliced else "wall span (GPU)"
    wake: dict[str, list[float]] = {}
    issue: dict[str, list[float]] = {}
    for s in spans:
        if s.kind in COLLECTIVES:
            wake.setdefault(s.name, []).append(woke.get((s.name, s.rank), 0.0))
            if "issue_us" in s.args:
                issue.setdefault(s.name, []).append(s.args["issue_us"] / 1e6)
    return {"wall": wall, "cpu": cpu, "fluid": fluid, "wait": wait, "wake": wake, "issue": issue,
            "stretch": stretch, "cpu_source": source}


def _wake_ups(spans: list) -> dict[tuple[str, int], float]:
    """(collective name, rank) -> seconds from its completion to the start of the compute op that waited
    for it: the collective that completed last in the gap between two compute ops of its rank (as
    `backend bench` measures `wake_s`); absent where none waited."""
    out = {}
    for rank in {s.rank for s in spans}:
        comp = sorted((s for s in spans if s.rank == rank and s.kind not in COLLECTIVES), key=lambda s: s.start_s)
        colls = sorted(((s.start_s + s.duration_s, s.name) for s in spans if s.rank == rank and s.kind in COLLECTIVES))
        j = 0
        for a, b in zip(comp, comp[1:]):
            end, last = a.start_s + a.duration_s, None
            while j < len(colls) and colls[j][0] <= b.start_s:
                if colls[j][0] > end:
                    last = colls[j]
                j += 1
            if last is not None:
                out[(last[1], rank)] = b.start_s - last[0]
    return out


def _group(grid: Grid, rank: int, axis: str) -> list[int]:
    """The ranks of `rank`'s group along `axis`."""
    c = list(grid.coords(rank))
    i = ("x", "y", "z", "data").index(axis)
    out = []
    for v in range((grid.x, grid.y, grid.z, grid.data)[i]):
        c[i] = v
        out.append(c[0] + grid.x * (c[1] + grid.y * (c[2] + grid.z * c[3])))
    return out
