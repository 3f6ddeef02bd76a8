"""Reading `backend bench` measurement files, with one clear line for each way a file can be wrong.

A measurement file is the JSON that backend/bench.py writes (format "backend-bench/2"): a `machine`
stamp, the grid and rank count, and rows of GEMM, small-op, collective and overlap timings (seconds).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from twin.common import TwinError

FORMAT = "backend-bench/2"
MACHINE_KEYS = ("host", "date", "torch", "commit", "device")
ROW_KEYS = {
    "gemm": ("m", "n", "k", "layout", "seconds"),
    "ops": ("op", "numel", "bytes", "seconds"),
    "collectives": ("axis", "kind", "group_size", "bytes", "seconds"),
    "overlap": ("m", "n", "k", "axis", "alone_s", "overlapped_s"),
    "attention": ("m", "n", "k", "fwd_flops", "bwd_flops", "fwd_s", "bwd_s"),
}
OPTIONAL_TABLES = ("attention",)  # absent in files written before it was measured
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _bad(path: Path, what: str) -> TwinError:
    return TwinError(f"measurement file {path}: {what} (rerun `backend bench` to write a complete one)")


def load_measurement(path: str | Path) -> dict:
    """Read and check one measurement file; returns its dict with `path` added. Raises TwinError."""
    path = Path(path)
    if not path.exists():
        raise TwinError(f"measurement file {path} does not exist (write one with `backend bench --out {path}`)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TwinError(f"measurement file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _bad(path, "the top level must be a JSON object")
    if data.get("format") != FORMAT:
        raise _bad(path, f"format is {data.get('format')!r}, expected {FORMAT!r}")
    machine = data.get("machine")
    if not isinstance(machine, dict):
        raise _bad(path, "missing the `machine` stamp")
    missing = [k for k in MACHINE_KEYS if not machine.get(k)]
    if missing:
        raise _bad(path, f"machine stamp lacks {', '.join(missing)}")
    for key in ("ranks", "ranks_per_node", "dtype_bytes"):
        if isinstance(data.get(key), bool) or not isinstance(data.get(key), int) or data[key] < 1:
            raise _bad(path, f"`{key}` must be a positive integer, got {data.get(key)!r}")
    if not isinstance(data.get("grid"), str):
        raise _bad(path, "missing `grid`")
    from twin.grid import Grid
    try:
        grid = Grid.parse(data["grid"])
    except TwinError as e:
        raise _bad(path, f"grid: {e}") from None
    if grid.size != data["ranks"]:
        raise _bad(path, f"grid {grid} has {grid.size} ranks but `ranks` is {data['ranks']}")
    for table, keys in ROW_KEYS.items():
        rows = data.get(table, [] if table in OPTIONAL_TABLES else None)
        data[table] = rows
        if not isinstance(rows, list):
            raise _bad(path, f"missing the `{table}` list")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise _bad(path, f"{table}[{i}] is not an object")
            lack = [k for k in keys if k not in row]
            if lack:
                raise _bad(path, f"{table}[{i}] lacks {', '.join(lack)}")
            for k in keys:
                if k in ("layout", "op", "axis", "kind"):
                    continue
                v = row[k]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (k.endswith("s") and k != "bytes" and v <= 0):
                    raise _bad(path, f"{table}[{i}].{k} must be a positive number, got {v!r}")
        if table == "collectives":
            for i, row in enumerate(rows):
                if row["kind"] not in KINDS:
                    raise _bad(path, f"collectives[{i}].kind {row['kind']!r} is not one of {', '.join(KINDS)}")
                if row["axis"] not in ("x", "y", "z", "data") or row["group_size"] != grid.axis_size(row["axis"]):
                    raise _bad(path, f"collectives[{i}]: axis {row['axis']!r} with group size "
                                     f"{row['group_size']} does not match grid {grid}")
    return {**data, "path": str(path)}


def describe(data: dict) -> str:
    """'FILE (host, date)': how a fitted number names the measurement it came from."""
    m = data["machine"]
    return f"{Path(data['path']).name} ({m['host']}, {m['date']})"
