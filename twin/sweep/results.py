"""The results file of a sweep: one CSV row per point, appended (and flushed) as each point finishes.

Rerunning the same sweep reads the file back and skips the points whose key it holds (done or
failed: a point's error is as deterministic as its prediction). A run stopped hard can leave half a
line at the end; it is cut off before new rows are appended. When every point is in, the file is
rewritten (atomically) in the sweep's order, so a finished file does not depend on which worker ran
what first. CSV needs nothing beyond the standard library (Parquet would need pyarrow).
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from topologies.common import InputError, write_atomic


def _cell(v) -> str:
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    return "" if v is None else str(v)


def _line(columns: list[str], row: dict) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([_cell(row.get(c, "")) for c in columns])
    return buf.getvalue()


def read_rows(path: str | Path) -> tuple[list[str], list[dict]]:
    """(header, rows as dicts of text) of a results file; a last line without its newline is left out."""
    text = Path(path).read_text()
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    reader = csv.reader(io.StringIO(text))
    header = next(reader, [])
    return header, [dict(zip(header, r)) for r in reader if len(r) == len(header)]


class Results:
    """The results file at `path` with these columns; `done` maps the key of every point it holds to its row."""

    def __init__(self, path: str | Path, columns: list[str]):
        self.path, self.columns = Path(path), columns
        self.done: dict[str, dict] = {}
        if self.path.is_file() and self.path.stat().st_size:
            header, rows = read_rows(self.path)
            if header != columns:
                raise InputError(f"results file {self.path} has other columns than this sweep's (another sweep "
                                 "wrote it): give another --out, or remove it to start over")
            self.done = {r["key"]: r for r in rows}
            text = self.path.read_bytes()
            if not text.endswith(b"\n"):  # half a line from a run stopped hard
                with open(self.path, "r+b") as f:
                    f.truncate(text.rfind(b"\n") + 1)
        else:
            self.path.write_text(_line(columns, dict(zip(columns, columns))))
        self._file = open(self.path, "a", newline="")

    def append(self, row: dict) -> None:
        """Write one finished point and flush it to the file."""
        self._file.write(_line(self.columns, row))
        self._file.flush()
        self.done[row["key"]] = {c: _cell(row.get(c, "")) for c in self.columns}

    def close(self) -> None:
        self._file.close()

    def rewrite_in_order(self, keys: list[str]) -> None:
        """Rewrite the file with the rows of `keys` first, in that order, then any others (atomic)."""
        self.close()
        order = [k for k in keys if k in self.done] + [k for k in self.done if k not in set(keys)]
        write_atomic(self.path, _line(self.columns, dict(zip(self.columns, self.columns)))
                     + "".join(_line(self.columns, self.done[k]) for k in order))
