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
    """'FILE (host, date)': how a fitted number names the measurement it came from."""
    m = data["machine"]
    return f"{Path(data['path']).name} ({m['host']}, {m['date']})"
