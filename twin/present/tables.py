"""Tables the command lines print: plain text, readable in an 80-column terminal.

`table(...)` makes a table with light rules: a rule of '─' under the header, no lines between
columns, two spaces between them, the title above on the left. Cells wrap at spaces but are never
cut with an ellipsis: a grid, a system name or a number is printed whole. Columns named in `keep`
never wrap (names, grids, numbers a reader compares down the column); the others wrap at spaces.
tests/test_tables.py prints every table at 80 columns.

This is our own small layout, not rich's: printing a result never imports rich (about 0.05 s of a
command's start). It lays tables out as rich laid them out before (the same text at the same width;
tests/test_tables.py compares the two), without rich's colours, with one difference: where even one
word per line does not fit the console, the table grows wider than the console (rich cut the words).
"""

from __future__ import annotations

import os
import re
import sys
import textwrap

_RULE = "─"
_GAP = 2  # spaces between two columns
_WORD = re.compile(r"\s*\S+\s*")


class Table:
    """Columns (header, never wrapped or not, left or right aligned) and rows of strings;
    `render(width)` lays it out for a console `width` columns wide (a list of lines)."""

    def __init__(self, title: str | None = None):
        self.title = title
        self.headers: list[str] = []
        self.no_wrap: list[bool] = []
        self.right: list[bool] = []
        self.rows: list[list[str]] = []
        self.section_ends: set[int] = set()  # indices of rows followed by a blank separator line

    def add_column(self, header: str, no_wrap: bool = False, right: bool = False) -> None:
        self.headers.append(header)
        self.no_wrap.append(no_wrap)
        self.right.append(right)

    def add_row(self, *cells: str) -> None:
        self.rows.append([str(c) for c in cells] + [""] * (len(self.headers) - len(cells)))

    def add_section(self) -> None:
        """A blank line after the rows so far."""
        if self.rows:
            self.section_ends.add(len(self.rows) - 1)

    def widths(self, width: int) -> tuple[list[int], list[str]]:
        """Each column's width and header for a console `width` columns wide.

        Each column gets at least its longest word (its longest line when it does not wrap; a header
        always wraps at spaces); what is left of the width goes to the columns that would use it, in
        proportion to how much more they need for one line per cell. Cells then wrap at spaces."""
        heads = list(self.headers)
        body = [[line for row in self.rows for line in (row[i].splitlines() or [""])] or [""]
                for i in range(len(heads))]
        longest = [max(len(line) for line in [h, *ls]) for h, ls in zip(heads, body)]
        words = [max(len(w) for line in [h, *ls] for w in (line.split() or [""])) for h, ls in zip(heads, body)]
        least = [max(wd, *map(len, ls)) if keep else wd for keep, wd, ls in zip(self.no_wrap, words, body)]
        room = width - (len(heads) - 1) * _GAP
        if sum(longest) <= room:
            return longest[:-1] + [longest[-1] or 1], heads  # an empty last column is one space wide
        extra = max(0, room - sum(least))
        want = [hi - lo for hi, lo in zip(longest, least)]
        total = sum(want) or 1
        widths = [lo + min(w, extra * w // total) for lo, w in zip(least, want)]
        for i in sorted(range(len(widths)), key=lambda i: want[i] - (widths[i] - least[i]), reverse=True):
            if sum(widths) >= room:
                break
            widths[i] += min(room - sum(widths), longest[i] - widths[i])  # what the rounding left
        heads = [textwrap.fill(h, w) if len(h) > w else h for h, w in zip(heads, widths)]
        return widths[:-1] + [widths[-1] or 1], heads

    def render(self, width: int = 80, bold: bool = False) -> list[str]:
        """The table's lines for a console `width` columns wide (`bold`: the header in bold, for a terminal)."""
        widths, heads = self.widths(width)
        total = sum(widths) + _GAP * (len(widths) - 1)
        lines = [_pad(line, total) for line in wrap(self.title, total)] if self.title else []
        head = self._row(heads, widths, bottom=True)
        lines += [f"\x1b[1m{line}\x1b[0m" for line in head] if bold else head
        lines.append(_RULE * total)
        for i, row in enumerate(self.rows):
            lines += self._row(row, widths)
            if i in self.section_ends and i < len(self.rows) - 1:
                lines.append(" " * total)
        return lines

    def _row(self, cells: list[str], widths: list[int], bottom: bool = False) -> list[str]:
        """One row's lines: each cell wrapped to its column, aligned, the columns side by side
        (`bottom`: shorter cells at the bottom of the row, as headers are)."""
        cols = [[line.rstrip().rjust(w) if right else _pad(line, w) for line in (c.split("\n") if keep else wrap(c, w))]
                for c, w, keep, right in zip(cells, widths, self.no_wrap, self.right)]
        height = max(len(c) for c in cols)
        cols = [[" " * w] * (height - len(c)) + c if bottom else c + [" " * w] * (height - len(c))
                for c, w in zip(cols, widths)]
        return [(" " * _GAP).join(parts) for parts in zip(*cols)]


def _pad(line: str, width: int) -> str:
    return line + " " * (width - len(line))


def wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` columns, broken at spaces (a word longer than a line is
    broken where the line ends). A line keeps the spaces that end it where they fit."""
    lines: list[str] = []
    width = max(1, width)
    for para in text.split("\n"):
        line = ""
        for m in _WORD.finditer(para) if para.strip() else [para]:
            word = m.group() if not isinstance(m, str) else m
            if len(line) + len(word.rstrip()) <= width:
                line += word
            elif len(word.rstrip()) > width:  # longer than a line: in pieces of a line each
                pieces = [word[i:i + width] for i in range(0, len(word), width)]
                lines += [line, *pieces[:-1]] if line else pieces[:-1]
                line = pieces[-1]
            else:
                lines.append(line)
                line = word
        lines.append(line)
    return [line[:max(width, len(line.rstrip()))] for line in lines]


class Printer:
    """Where the twin's commands print: plain text on stdout, tables laid out for its width.

    The width is `width` when set (tests set 80), else $COLUMNS, else the terminal's (stdin, stdout or
    stderr, the first that is one), else 80. Long lines of text wrap at spaces. On a terminal the
    headers of tables are bold (not under NO_COLOR)."""

    width: int | None = None

    def console_width(self) -> int:
        if self.width is not None:
            return self.width
        columns = os.environ.get("COLUMNS", "")
        if columns.isdigit():
            return int(columns)
        for fd in (0, 1, 2):
            try:
                return os.get_terminal_size(fd).columns or 80
            except OSError:
                pass
        return 80

    def print(self, *objects) -> None:
        width = self.console_width()
        out: list[str] = []
        for obj in objects:
            if isinstance(obj, Table):
                bold = sys.stdout.isatty() and "NO_COLOR" not in os.environ
                out += obj.render(width, bold=bold)
            else:
                out += wrap(str(obj), width)
        sys.stdout.write("".join(line + "\n" for line in out))
        sys.stdout.flush()


def table(*columns: str, title: str | None = None, keep: tuple[str, ...] = (), right: tuple[str, ...] = ()) -> Table:
    """A table with these column headers; `keep`: columns that never wrap; `right`: right-aligned columns."""
    t = Table(title=title)
    for c in columns:
        t.add_column(c, no_wrap=c in keep, right=c in right)
    return t


def human_bytes(n: float) -> str:
    """Bytes with a binary prefix that keeps three significant digits (0.09 MiB is '96.0 KiB', never '0.00 GiB')."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{_three(n / scale)} {unit}"
    return f"{n:.0f} B"


def _three(x: float) -> str:
    """Three significant digits with trailing zeros kept, so that a column lines up: 1.70, 96.0, 535."""
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def human_flops(flops_per_s: float) -> str:
    """flop/s with an SI prefix and three significant digits: '1.77 EF/s', '412 TF/s', '20.8 GF/s'."""
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(flops_per_s) >= scale:
            return f"{_three(flops_per_s / scale)} {prefix}F/s"
    return f"{_three(flops_per_s)} F/s"


def with_unit(parameter: str, value: str) -> tuple[str, str]:
    """A sensitivity value (as twin.predict.sensitivity writes it) as (number, unit), the unit read
    from the parameter's name: flop/s, bytes/s, seconds (µs), links, a factor (x); an efficiency,
    a fraction or a size has no unit (""); text (an alternative) is returned whole, without unit."""
    try:
        v = float(value)
    except ValueError:
        return value, ""
    name = parameter.lower()
    if name.endswith("flops"):
        return tuple(human_flops(v).split(" "))
    if "bandwidth" in name:
        return tuple(human_flops(v).replace("F/s", "B/s").split(" "))
    if name.endswith(("latency", "_s", "_floor")):
        return f"{v * 1e6:.3g}", "µs"
    if name.endswith("links_per_pair"):
        return f"{v:g}", "links"
    if name.endswith("x)"):
        return f"x{v:g}", ""
    return f"{v:.3g}", ""


def sensitivity_table(r) -> Table:
    """The table of `twin sensitivity` (a twin.predict.sensitivity.SensitivityResult), within 80 columns:
    each parameter, its value with its unit and the values it moved to (or the alternative), and how
    the iteration time changes (%)."""
    low, high = f"-{100 * r.step:.0f} %", f"+{100 * r.step:.0f} %"
    t = table("parameter", "value (low / high), or alternative", low, high,
              title=f"{r.model} on {r.gpus} GPUs of {r.system}, grid {r.grid}, batch {r.batch}: {r.base_s:.3f} s "
                    f"per iteration, and how much it changes (%) when a parameter moves by -/+{100 * r.step:.0f} % "
                    "or to an alternative (profile.*: kernel profile; others: system file)",
              keep=("parameter", low, high), right=(low, high))
    for row in r.rows:
        name = row.parameter
        if len(name) > 24 and "." in name:  # the prefix on a line of its own keeps the column narrow
            head, tail = name.split(".", 1)
            name = f"{head}.\n  {tail}"
        (base, unit), (low, _), (high, _) = (with_unit(row.parameter, v) for v in (row.base, row.low, row.high))
        value = f"{base} ({low} / {high}) {unit}".rstrip() if row.high else f"{base} -> {low}"
        t.add_row(name, value, "-" if row.low_pct is None else f"{row.low_pct:+.1f} %",
                  "-" if row.high_pct is None else f"{row.high_pct:+.1f} %")
    return t
