"""One self-contained HTML page of text, tables and plotly figures (plotly.js inlined once, so the page
opens offline): `twin report` and `twin validate --html` write theirs with it."""

from __future__ import annotations

import html

CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1400px;margin:0 auto;
padding:0 24px 48px;color:#222}h1{font-size:1.6em;margin-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
.lead{font-size:1.08em;line-height:1.5}.note{color:#555;font-size:.92em}table{border-collapse:collapse;margin:.6em 0}
td,th{border:1px solid #ddd;padding:3px 9px;text-align:right}th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
.plot{margin:.4em 0 1em}.missing{color:#777;font-style:italic}td.over{background:#fde2e1}"""


def html_table(header: list[str], rows: list[list[str]], over: set[tuple[int, int]] = frozenset()) -> str:
    """A table of text cells (escaped); the cells at (row, column) in `over` are shaded (a figure past
    its target)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td{' class=over' if (i, j) in over else ''}>{html.escape(str(c))}</td>"
                                    for j, c in enumerate(row)) + "</tr>" for i, row in enumerate(rows))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class Page:
    """Parts of a page in order: add HTML with `add`, a figure with `figure` (it is drawn where added)."""

    def __init__(self, title: str):
        self.title = title
        self.parts: list[str] = []
        self.figures: list[tuple[str, object]] = []

    def add(self, part: str) -> None:
        self.parts.append(part)

    def figure(self, name: str, fig) -> None:
        """Draw the plotly figure `fig` here, in the div of id plot-NAME."""
        self.figures.append((name, fig))
        self.parts.append(f'<div class="plot" id="plot-{name}" data-plot="{name}"></div>')

    def html(self) -> str:
        from plotly.offline import get_plotlyjs
        scripts = [f"(function(s){{Plotly.newPlot('plot-{name}', s.data, s.layout, "
                   f"{{responsive: true, displaylogo: false}});}})({f.to_json()});" for name, f in self.figures]
        return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
                f"<title>{html.escape(self.title)}</title>"
                f"<style>{CSS}</style><script>{get_plotlyjs()}</script></head><body>"
                + "\n".join(self.parts)
                + "<script>" + "\n".join(scripts) + "</script></body></html>")
