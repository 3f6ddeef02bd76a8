"""Tables the command lines print: readable in an 80-column terminal.

`table(...)` makes a rich table with light rules (no box-drawing columns), one space between columns
and cells that wrap or fold but are never cut with an ellipsis: a grid, a system name or a number
is printed whole. Columns named in `keep` never wrap (names, grids, numbers a reader compares down
the column); the others wrap at spaces. tests/test_tables.py prints every table at 80 columns.
"""

from __future__ import annotations

import textwrap
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table


def _plain(cell) -> str:
    from rich.text import Text
    return Text.from_markup(cell).plain if isinstance(cell, str) else cell.plain if isinstance(cell, Text) else ""


@cache
def _table_class() -> type:
    """The rich Table below, made on first use: `--json` output never needs rich (about 0.03 s to import)."""
    from rich.table import Table

    class _Table(Table):
        """A rich Table laid out so that no word is broken and nothing is cut at the console's width.

        Each column gets at least its longest word (its longest line when it does not wrap; a header
        always wraps at spaces); what is left of the width goes to the columns that would use it, in
        proportion to how much more they need for one line per cell. Rich then wraps cells at spaces."""

        def __rich_console__(self, console, options):
            body = [[line for c in col._cells for line in (_plain(c).splitlines() or [""])] or [""] for col in self.columns]
            heads = [_plain(col.header) for col in self.columns]
            longest = [max(len(h), *map(len, ls)) for h, ls in zip(heads, body)]
            words = [max(len(w) for line in [h, *ls] for w in (line.split() or [""])) for h, ls in zip(heads, body)]
            least = [max(wd, *map(len, ls)) if col.no_wrap else wd for col, wd, ls in zip(self.columns, words, body)]
            gaps = (len(self.columns) - 1) * (self.padding[1] + self.padding[3] + 1)
            room = options.max_width - gaps - (2 if self.show_edge else 0)
            if sum(longest) > room:
                extra = max(0, room - sum(least))
                want = [hi - lo for hi, lo in zip(longest, least)]
                total = sum(want) or 1
                widths = [lo + min(w, extra * w // total) for lo, w in zip(least, want)]
                for i in sorted(range(len(widths)), key=lambda i: want[i] - (widths[i] - least[i]), reverse=True):
                    if sum(widths) >= room:
                        break
                    widths[i] += min(room - sum(widths), longest[i] - widths[i])  # what the rounding left
                for col, head, w in zip(self.columns, heads, widths):
                    col.width = w
                    if len(head) > w:
                        col.header = textwrap.fill(head, w)
            return super().__rich_console__(console, options)

    return _Table


def table(*columns: str, title: str | None = None, keep: tuple[str, ...] = (), right: tuple[str, ...] = ()) -> Table:
    """A table with these column headers; `keep`: columns that never wrap; `right`: right-aligned columns."""
    from rich import box
    t = _table_class()(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                       title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold", no_wrap=c in keep, justify="right" if c in right else "left")
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
