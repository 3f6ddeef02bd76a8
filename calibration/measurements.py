"""Reading `backend bench` measurement files, with one clear line for each way a file can be wrong.

A measurement file is the JSON that backend/bench/bench.py writes (format "backend-bench/2"): a `machine`
stamp, the grid and rank count, and rows of GEMM, small-op, collective and overlap timings (seconds),
and the program's ops as recorded training steps ran them (`steps`).
"""

from __future__ import annotations

import json
from pathlib import Path

from topologies.common import InputError, TwinError
from topologies.schema import MEASUREMENT, MEASUREMENT_FORMAT, check

FORMAT = MEASUREMENT_FORMAT

# kinds of the ops a file's recorded training steps (`steps` rows) hold
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")  # all_to_all: MoE (twin/program/moe.py)
MODELED = ("gemm", "attention")  # compute kinds with their own microbenchmarked model
COVERED = 0.5  # a compute op counts as overlapped when a collective ran during this share of its span


def _bad(path: Path, what: str) -> TwinError:
    return TwinError(f"measurement file {path}: {what} (rerun `backend bench` to write a complete one)")


def load_measurement(path: str | Path) -> dict:
    """Read and check one measurement file; returns its dict with `path` added. Raises TwinError.

    Every key, type and range is checked by topologies.schema.MEASUREMENT (one line naming the file, the key
    and the rule); here only what relates keys to each other: the grid and its ranks, each
    collective's group size against its axis."""
    path = Path(path)
    if not path.exists():
        raise TwinError(f"measurement file {path} does not exist (write one with `backend bench --out {path}`)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TwinError(f"measurement file {path} is not valid JSON: {e}") from None
    try:
        check(data, MEASUREMENT, path, "measurement")
    except InputError as e:
        raise TwinError(f"{e} (rerun `backend bench` to write a complete one)") from None
    data.setdefault("attention", [])
    data.setdefault("steps", [])
    from twin.program.grid import Grid
    try:
        grid = Grid.parse(data["grid"])
    except TwinError as e:
        raise _bad(path, f"grid: {e}") from None
    if grid.size != data["ranks"]:
        raise _bad(path, f"grid {grid} has {grid.size} ranks but `ranks` is {data['ranks']}")
    for i, row in enumerate(data["collectives"]):
        if row["group_size"] != grid.axis_size(row["axis"]):
            raise _bad(path, f"collectives[{i}]: axis {row['axis']!r} with group size "
                             f"{row['group_size']} does not match grid {grid}")
    for i, row in enumerate(data["steps"]):  # a collective's span may be 0 (it completed with the one before)
        if row["seconds"] < 1e-12 and row["kind"] not in COLLECTIVES:
            raise _bad(path, f"steps[{i}].seconds must be > 0 for a {row['kind']} op, got {row['seconds']}")
    return {**data, "path": str(path)}


def describe(data: dict) -> str:
    """'FILE (host, date)': how a fitted number names the measurement it came from (and, where its
    recorded steps were scaled to unrecorded ones, by how much: `unobserved`)."""
    m = data["machine"]
    scaled = f"; recorded steps / {data['observer']:.3f}" if data.get("observer") else ""
    return f"{Path(data['path']).name} ({m['host']}, {m['date']}{scaled})"


STEP_TIMES = ("seconds", "wake_s", "issue_s")  # a recorded step row's wall times (cpu_s: its own work, kept)
HOST_TIMES = ("seconds", "mean_s", "all_gaps_s", "free_mean_s", "busy_mean_s", "step_s")


def _host_row(data: dict) -> dict | None:
    return next((row for row in data.get("ops", []) if row.get("op") == "host"), None)


def observer_ratio(data: dict) -> float | None:
    """How much longer bench's recorded training steps of this file took than the unrecorded ones it
    ran between them (step_s / free_step_s of its host row); None where it did not time both."""
    host = _host_row(data)
    if host and host.get("free_step_s") and host.get("step_s") and data.get("steps"):
        return host["step_s"] / host["free_step_s"]
    return None


def unobserved(data: dict) -> dict:
    """A measurement file with its recorded training steps as unrecorded training runs them: where bench
    timed unrecorded steps between the recorded ones (the host row's `free_step_s`), every wall time
    of the recorded steps (the ops' spans, wake-ups and issue times, the host gaps) divided by the
    ratio of recorded to unrecorded step time (observer_ratio), recorded in `observer`; the file as it
    is otherwise.

    Recording lengthens a step (backend.bench.steps: the recorder's work per op and per collective,
    where ranks time-slice the cores), while `twin validate` compares the twin's iteration with the
    run's median step, of which only one step is recorded: a profile fitted from recorded steps
    predicts the recorded step. How the recorder's time spreads over a step's ops is not measured;
    spread evenly over its wall times, the fitted step comes out at the unrecorded one. On-CPU times
    stay (the op's own work), kept within their spans. Per file, not pooled per rank count: the
    ratio is the grid's own (mixtral-tiny on the 2-core development VM, one file per grid and bench
    pass: 2x2x2x1 1.11-1.19 in every pass, 1x1x1x4e2 1.00-1.10; a file's 4 steps each way scatter by
    about 10 %; `backend run` with every other step recorded, 10 against 9, 3 runs per grid: 1.14x
    on 2x1x1x4e2, 1.07x on 1x1x1x8e4, 1.11x on 2x2x2x1, 1.01x on 1x1x1x2e2; docs/moe-backend.md)."""
    ratio = observer_ratio(data)
    return data if ratio is None else _scaled(data, ratio)


def _scaled(data: dict, ratio: float) -> dict:
    """`data` with its recorded steps' wall times divided by `ratio` (unobserved)."""
    steps = []
    for row in data["steps"]:
        row = {**row, **{k: row[k] / ratio for k in STEP_TIMES if k in row}}
        if "cpu_s" in row:
            row["cpu_s"] = min(row["cpu_s"], row["seconds"])
        steps.append(row)
    host = _host_row(data)
    ops = data["ops"]
    if host is not None:
        scaled = {**host, **{k: host[k] / ratio for k in HOST_TIMES if k in host}}
        if isinstance(host.get("busy_by_kind_s"), dict):
            scaled["busy_by_kind_s"] = {k: v / ratio for k, v in host["busy_by_kind_s"].items()}
        ops = [scaled if row is host else row for row in ops]
    return {**data, "steps": steps, "ops": ops, "observer": ratio}
