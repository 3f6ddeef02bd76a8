"""Interactive timeline of a simulated iteration (plotly): one row per (rank, stream), time in seconds.

Horizontal `go.Bar` with `base=` (start) and length = duration, one trace per op kind so the legend
filters kinds; past `MAX_BARS` spans the bars become `Scattergl` line segments, which stay fast for
hundreds of thousands of ops. (`px.timeline` is not used: it forces a date axis.)
"""

from __future__ import annotations

from collections import defaultdict

import plotly.graph_objects as go

from twin.program import STREAMS
from twin.trace import Span

MAX_BARS = 20_000
KIND_COLOURS = {
    "gemm": "#1f77b4", "attention": "#9467bd", "elementwise": "#7f7f7f", "embedding": "#8c564b",
    "loss": "#bcbd22", "optimizer": "#17becf", "all_gather": "#2ca02c", "reduce_scatter": "#ff7f0e",
    "all_reduce": "#d62728",
}


def _row(span: Span) -> str:
    return f"rank {span.rank} {span.stream}"


def timeline_figure(spans: list[Span], title: str = "") -> go.Figure:
    """A figure of the spans: y = 'rank R stream', x = seconds since the iteration started."""
    rows = sorted({(s.rank, STREAMS.index(s.stream)) for s in spans})
    order = [f"rank {r} {STREAMS[t]}" for r, t in rows]
    by_kind: dict[str, list[Span]] = defaultdict(list)
    for s in sorted(spans, key=lambda s: (s.rank, STREAMS.index(s.stream), s.start_s)):
        by_kind[s.kind].append(s)
    fig = go.Figure()
    bars = len(spans) <= MAX_BARS
    for kind in sorted(by_kind):
        ss = by_kind[kind]
        colour = KIND_COLOURS.get(kind, "#444444")
        if bars:
            fig.add_trace(go.Bar(
                name=kind, orientation="h", y=[_row(s) for s in ss], x=[s.duration_s for s in ss],
                base=[s.start_s for s in ss], marker_color=colour, marker_line_width=0,
                customdata=[s.name for s in ss], textposition="none",
                hovertemplate="%{customdata}<br>start %{base:.6f} s<br>duration %{x:.6f} s<extra>" + kind + "</extra>",
            ))
        else:
            xs, ys, names = [], [], []
            for s in ss:
                xs += [s.start_s, s.start_s + s.duration_s, None]
                ys += [_row(s), _row(s), None]
                names += [s.name, s.name, None]
            fig.add_trace(go.Scattergl(name=kind, x=xs, y=ys, mode="lines", text=names,
                                       line=dict(color=colour, width=8), hoverinfo="text+x"))
    fig.update_layout(
        title=title, barmode="overlay", xaxis_title="time (s)", legend_title="op kind",
        yaxis=dict(categoryorder="array", categoryarray=order[::-1], type="category"),
        height=max(360, 120 + 40 * len(order)), bargap=0.2,
    )
    return fig


def timeline_html(spans: list[Span], title: str = "") -> str:
    """The timeline as a self-contained HTML page (plotly.js inlined, so it opens offline)."""
    return timeline_figure(spans, title).to_html(include_plotlyjs=True, full_html=True)
