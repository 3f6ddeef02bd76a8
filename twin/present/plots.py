"""Figures of a simulated (or measured) iteration with plotly: the timeline of the streams, where the
time goes, the ranks of a full run, the grid search, the scaling curve, predicted vs measured.

Timeline: one row per (rank, stream), time in seconds, one trace per op kind so the legend filters
kinds. Under each rank's streams a row "waits" shows when its compute stream runs nothing: one
colour per axis while it waits for a collective of that axis (exposed communication, as the engine
attributed it: the stretches its breakdown sums, never recomputed here; only a measured trace, which
has no attribution, falls back to twin.program.trace.compute_gaps), grey when it is idle. The critical path (the chain of ops whose durations add up to the iteration) is drawn as a black
line through its ops. Past `MAX_BARS` spans, bars become `Scattergl` line segments. At most
`MAX_RANKS` ranks are drawn (the first and the slowest ones): a full run of thousands of ranks stays
a page a browser can draw, and `ranks_figure` summarises every rank. (`px.timeline` is not used: it
forces a date axis.)
"""

from __future__ import annotations

from collections import defaultdict

import plotly.graph_objects as go

from topologies.draw import AXIS_COLOURS  # one colour per axis on every page

from twin.program.trace import TRACE_STREAMS as STREAMS, Span, attributed_gaps, compute_gaps

MAX_BARS = 20_000
MAX_RANKS = 8
KIND_COLOURS = {
    "gemm": "#1f77b4", "attention": "#9467bd", "elementwise": "#7f7f7f", "embedding": "#8c564b",
    "loss": "#bcbd22", "optimizer": "#17becf", "all_gather": "#2ca02c", "reduce_scatter": "#ff7f0e",
    "all_reduce": "#d62728", "send": "#006d2c", "recv": "#74c476",
}
IDLE_COLOUR = "#bdbdbd"
PART_COLOURS = {"compute": "#1f77b4", "idle": IDLE_COLOUR, "pipeline bubble": "#fdae6b",
                **{f"exposed {a}": c for a, c in AXIS_COLOURS.items()}}


def _row(rank: int, stream: str) -> str:
    return f"rank {rank} {stream}"


def pick_ranks(spans: list[Span], limit: int = MAX_RANKS) -> list[int]:
    """The ranks a timeline draws: all when they are few, else the first, the busiest (a straggler)
    and the ones whose compute stream is busy least (those that wait most), `limit` in all."""
    ranks = sorted({s.rank for s in spans})
    if len(ranks) <= limit:
        return ranks
    busy: dict[int, float] = defaultdict(float)
    for s in spans:
        if s.stream == "compute":
            busy[s.rank] += s.duration_s
    least = sorted(ranks, key=lambda r: (busy[r], r))
    pick = {ranks[0], least[-1]}  # the first rank and the busiest one
    for r in least:  # then those whose compute stream is busy least: stragglers' partners, the waiting
        if len(pick) >= limit:
            break
        pick.add(r)
    return sorted(pick)


def rank_gaps(by_rank: dict[int, list[Span]], ranks: list[int],
              waits: list[Span] | None) -> dict[int, list[tuple[float, float, str | None]]]:
    """Per rank, the stretches its compute stream runs nothing, (start, end, axis or None for idle):
    the engine's attribution where `waits` is given (from 0 to the iteration's end), else the guess
    from the spans alone (a measured trace)."""
    if waits is None:
        return {r: compute_gaps(by_rank[r]) for r in ranks}
    end = max((s.start_s + s.duration_s for ss in by_rank.values() for s in ss), default=0.0)
    end = max([end] + [w.start_s + w.duration_s for w in waits])
    mine: dict[int, list[Span]] = defaultdict(list)
    for w in waits:
        mine[w.rank].append(w)
    return {r: attributed_gaps(by_rank[r], mine[r], end) for r in ranks}


def timeline_figure(spans: list[Span], title: str = "", critical: set[tuple[int, str]] | None = None,
                    window: tuple[float, float] | None = None, ranks: list[int] | None = None,
                    note: str = "", waits: list[Span] | None = None) -> go.Figure:
    """The timeline of `spans` (see the module docstring). `critical`: (rank, op name) of the ops on
    the critical path; `window`: the x range it opens on (seconds; double-click shows everything);
    `ranks`: which ranks to draw (default `pick_ranks`); `waits`: the engine's attributed waits
    (SimulationResult.waits; None for a measured trace)."""
    ranks = pick_ranks(spans) if ranks is None else ranks
    chosen = set(ranks)
    spans = [s for s in spans if s.rank in chosen]
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        by_rank[s.rank].append(s)
    order = []
    for r in ranks:
        order += [_row(r, st) for st in STREAMS if any(s.stream == st for s in by_rank[r])] + [_row(r, "waits")]
    by_kind: dict[str, list[Span]] = defaultdict(list)
    for s in sorted(spans, key=lambda s: (s.rank, STREAMS.index(s.stream), s.start_s)):
        by_kind[s.kind].append(s)
    fig = go.Figure()
    bars = len(spans) <= MAX_BARS

    def add(name, ss, colour, rows, starts, lengths, texts, legend=True):
        if bars:
            fig.add_trace(go.Bar(
                name=name, orientation="h", y=rows, x=lengths, base=starts, marker_color=colour,
                marker_line_width=0, customdata=texts, textposition="none", showlegend=legend,
                hovertemplate="%{customdata}<br>start %{base:.6f} s<br>duration %{x:.6f} s<extra>" + name + "</extra>"))
        else:
            xs, ys, names = [], [], []
            for row, a, d, t in zip(rows, starts, lengths, texts):
                xs += [a, a + d, None]
                ys += [row, row, None]
                names += [t, t, None]
            fig.add_trace(go.Scattergl(name=name, x=xs, y=ys, mode="lines", text=names, showlegend=legend,
                                       line=dict(color=colour, width=10), hoverinfo="text+x"))

    for kind in sorted(by_kind):
        ss = by_kind[kind]
        add(kind, ss, KIND_COLOURS.get(kind, "#444444"), [_row(s.rank, s.stream) for s in ss],
            [s.start_s for s in ss], [s.duration_s for s in ss], [s.name for s in ss])
    shaded: dict[str | None, list] = defaultdict(list)
    for r, gaps in rank_gaps(by_rank, ranks, waits).items():
        for a, b, axis in gaps:
            shaded[axis].append((r, a, b))
    for axis in sorted(shaded, key=lambda a: (a is None, STREAMS.index(a) if a else 0)):
        ws = shaded[axis]
        name = "idle (nothing runs)" if axis is None else f"exposed comm {axis}"
        add(name, ws, IDLE_COLOUR if axis is None else AXIS_COLOURS[axis], [_row(r, "waits") for r, _, _ in ws],
            [a for _, a, _ in ws], [b - a for _, a, b in ws],
            [f"compute waits for {axis}" if axis else "idle" for _ in ws])
    if critical:
        xs, ys = [], []
        for s in spans:
            if (s.rank, s.name) in critical:
                xs += [s.start_s, s.start_s + s.duration_s, None]
                ys += [_row(s.rank, s.stream)] * 2 + [None]
        fig.add_trace(go.Scatter(name="critical path", x=xs, y=ys, mode="lines", hoverinfo="skip",
                                 line=dict(color="black", width=3)))
    xaxis = dict(title="time (s)")
    if window:
        xaxis["range"] = list(window)
    fig.update_layout(
        title=dict(text=title + (f"<br><sup>{note}</sup>" if note else "")), barmode="overlay", xaxis=xaxis,
        yaxis=dict(categoryorder="array", categoryarray=order[::-1], type="category"),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0),
        height=max(380, 200 + (34 if len(order) <= 20 else 24) * len(order)), bargap=0.25, template="plotly_white",
        margin=dict(t=150 if note else 120),
    )
    return fig


def timeline_html(spans: list[Span], title: str = "", **kwargs) -> str:
    """The timeline as a self-contained HTML page (plotly.js inlined, so it opens offline)."""
    return timeline_figure(spans, title, **kwargs).to_html(include_plotlyjs=True, full_html=True)


def breakdown_parts(breakdown_s: dict) -> list[tuple[str, float]]:
    """(label, seconds) of a breakdown: compute, exposed comm per axis (those that are not zero), idle."""
    parts = [("compute", breakdown_s["compute"])]
    parts += [(f"exposed {a}", v) for a, v in breakdown_s["exposed_comm"].items() if v > 0]
    if "bubble" in breakdown_s:  # a pipelined grid's (twin.engine.pipeline)
        parts.append(("pipeline bubble", breakdown_s["bubble"]))
    parts.append(("idle", breakdown_s["idle"]))
    return parts


def breakdown_figure(breakdown_s: dict, iteration_s: float, title: str = "where one iteration's time goes") -> go.Figure:
    """One horizontal bar of the iteration, split into compute, exposed communication per axis and idle."""
    fig = go.Figure()
    for label, v in breakdown_parts(breakdown_s):
        share = 100 * v / iteration_s if iteration_s else 0.0
        fig.add_trace(go.Bar(name=f"{label} {share:.1f} %", y=["iteration"], x=[v], orientation="h",
                             marker_color=PART_COLOURS.get(label, "#444"), text=[f"{label}<br>{share:.1f} %"],
                             textposition="inside", insidetextanchor="middle",
                             hovertemplate=f"{label}: %{{x:.4f}} s ({share:.1f} %)<extra></extra>"))
    fig.update_layout(barmode="stack", title=title, xaxis_title="seconds", height=230, template="plotly_white",
                      legend=dict(orientation="h", y=-0.45), margin=dict(t=50, b=10))
    return fig


def ranks_figure(spans: list[Span], iteration_s: float, waits: list[Span] | None = None) -> go.Figure:
    """Every rank's breakdown (stacked bars: compute, exposed per axis, idle), for a full run;
    `waits`: the engine's attribution (as in timeline_figure)."""
    from twin.program.trace import trace_breakdown
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        by_rank[s.rank].append(s)
    ranks = sorted(by_rank)
    mine: dict[int, list[Span]] = defaultdict(list)
    for w in waits or ():
        mine[w.rank].append(w)
    rows = {r: trace_breakdown(by_rank[r], None if waits is None else mine[r]) for r in ranks}
    fig = go.Figure()
    parts = [("compute", lambda b: b["compute"])]
    parts += [(f"exposed {a}", lambda b, a=a: b["exposed_comm"].get(a, 0.0)) for a in AXIS_COLOURS]
    parts.append(("idle", lambda b: b["idle"] + max(iteration_s - b["iteration"], 0.0)))
    for label, get in parts:
        ys = [get(rows[r]) for r in ranks]
        if any(ys):
            fig.add_trace(go.Bar(name=label, x=ranks, y=ys, marker_color=PART_COLOURS[label]))
    fig.update_layout(barmode="stack", title=f"every rank's iteration ({len(ranks)} ranks)", xaxis_title="rank",
                      yaxis_title="seconds", height=360, template="plotly_white", bargap=0.05)
    return fig


def search_parts(c) -> tuple[dict[str, float], dict[str, float]]:
    """A candidate's estimate as the search chart draws it: (exposed, hidden) seconds per axis, the
    exposed parts adding with compute to `analytical_s`, the hidden ones overlapped with compute."""
    exposed = c.exposed_s if c.exposed_s is not None else {a: 0.0 for a in c.comm_s}
    return exposed, {a: max(0.0, c.comm_s.get(a, 0.0) - exposed.get(a, 0.0)) for a in c.comm_s}


def search_figure(candidates: list, chosen=None) -> go.Figure:
    """The best grids (twin.predict.search.Candidate) as the estimate adds them up: compute, then the
    communication it cannot hide (per axis, stacked on compute: the bar's top is the estimate), and the
    communication hidden behind compute drawn as thin hatched bars, side by side from 0, inside the
    compute bar (overlapped, so adding nothing); the simulated time where there is one (black diamonds); `chosen`, the grid the
    study runs, marked with a star."""
    names = [str(c.grid) for c in candidates]
    parts = [search_parts(c) for c in candidates]
    fig = go.Figure()
    fig.add_trace(go.Bar(name="compute (analytical)", x=names, y=[c.compute_s for c in candidates], base=[0.0] * len(names),
                         marker_color=PART_COLOURS["compute"], width=0.8,
                         hovertemplate="%{x}: compute %{y:.3f} s<extra></extra>"))
    top = [c.compute_s for c in candidates]
    for a, colour in AXIS_COLOURS.items():
        ys = [e.get(a, 0.0) for e, _ in parts]
        if any(ys):
            fig.add_trace(go.Bar(name=f"exposed comm {a}", x=names, y=ys, base=list(top), marker_color=colour, width=0.8,
                                 hovertemplate=f"%{{x}}: exposed {a} %{{y:.3f}} s<extra></extra>"))
            top = [t + y for t, y in zip(top, ys)]
    hidden = [a for a in AXIS_COLOURS if any(h.get(a, 0.0) for _, h in parts)]
    for k, a in enumerate(hidden):  # side by side from 0: each runs beside compute, none after another
        ys = [h.get(a, 0.0) for _, h in parts]
        fig.add_trace(go.Bar(name=f"comm {a} hidden behind compute", x=names, y=ys, base=[0.0] * len(names),
                             width=0.7 / len(hidden), offset=-0.35 + 0.7 * k / len(hidden),
                             marker=dict(color="rgba(255,255,255,0.25)", line=dict(color=AXIS_COLOURS[a], width=1.5),
                                         pattern=dict(shape="/", fgcolor=AXIS_COLOURS[a])),
                             hovertemplate=f"%{{x}}: {a} overlapped with compute %{{y:.3f}} s<extra></extra>"))
    sim = [(n, c.simulated_s) for n, c in zip(names, candidates) if c.simulated_s is not None]
    if sim:
        fig.add_trace(go.Scatter(name="simulated", x=[n for n, _ in sim], y=[v for _, v in sim], mode="markers",
                                 marker=dict(symbol="diamond", size=13, color="black")))
    if chosen is not None and str(chosen) in names:
        k = names.index(str(chosen))
        y = max(top[k], candidates[k].simulated_s or 0.0)
        fig.add_trace(go.Scatter(name="chosen grid", x=[names[k]], y=[y * 1.06], mode="markers+text", text=["chosen"], textfont=dict(size=14),
                                 textposition="top center", cliponaxis=False,
                                 marker=dict(symbol="star", size=16, color="#ffbf00", line=dict(color="black", width=1))))
    highest = max(top + [c.simulated_s or 0.0 for c in candidates], default=1.0)
    fig.update_yaxes(range=[0, 1.2 * highest])  # room for the star and its label above the bars
    fig.update_layout(barmode="overlay", title="the best grids: analytical estimate and simulation",
                      xaxis_title="grid XxYxZxD (ranked best first)", yaxis_title="seconds per iteration",
                      height=440, template="plotly_white", legend=dict(orientation="h", y=-0.3))
    return fig


def scaling_figure(points: list[dict]) -> go.Figure:
    """Scaling curve: flop/s (PF/s) against GPUs (log-log), with the ideal line from the first point.
    Each point: {"gpus": N, "flops_per_s": F} (and optionally "percent_of_peak", "grid")."""
    pts = sorted(points, key=lambda p: p["gpus"])
    xs = [p["gpus"] for p in pts]
    ys = [p["flops_per_s"] / 1e15 for p in pts]
    fig = go.Figure()
    fig.add_trace(go.Scatter(name="twin", x=xs, y=ys, mode="lines+markers",
                             text=[f"{p.get('grid', '')} {p.get('percent_of_peak', 0):.1f} % of peak" for p in pts],
                             hovertemplate="%{x:,d} GPUs: %{y:.1f} PF/s<br>%{text}<extra></extra>"))
    if pts:
        fig.add_trace(go.Scatter(name="perfect scaling", x=xs, y=[ys[0] * x / xs[0] for x in xs], mode="lines",
                                 line=dict(dash="dash", color="grey")))
    fig.update_layout(title="scaling", xaxis=dict(title="GPUs", type="log", tickvals=xs, tickformat=",d"),
                      yaxis_title="PF/s", yaxis_type="log", height=400, template="plotly_white")
    return fig


def validation_figure(ops: list[dict]) -> go.Figure:
    """Predicted against measured per op (log-log, one colour per kind, the y = x line). Each op:
    {"name", "kind", "measured_s", "predicted_s"} (a `twin validate` report's per_op), and where given its
    run's "grid" and its "wall_s", "cpu_s" and "peer_wait_s" (shown on hover)."""
    def hover(o: dict) -> str:
        text = (f"{o['grid']} " if "grid" in o else "") + o["name"]
        parts = [f"{what} {o[key] * 1e3:.3f} ms" for what, key in
                 (("wall span", "wall_s"), ("on-CPU", "cpu_s"), ("peer wait", "peer_wait_s")) if key in o]
        return text + ("<br>" + ", ".join(parts) if parts else "")

    fig = go.Figure()
    for kind in sorted({o["kind"] for o in ops}):
        sel = [o for o in ops if o["kind"] == kind]
        fig.add_trace(go.Scatter(name=kind, x=[o["measured_s"] * 1e3 for o in sel],
                                 y=[o["predicted_s"] * 1e3 for o in sel], mode="markers",
                                 marker_color=KIND_COLOURS.get(kind), text=[hover(o) for o in sel],
                                 hovertemplate="%{text}<br>measured %{x:.3f} ms<br>predicted %{y:.3f} ms<extra></extra>"))
    vals = [v for o in ops for v in (o["measured_s"], o["predicted_s"]) if v > 0]
    if vals:
        lo, hi = min(vals) * 1e3, max(vals) * 1e3
        fig.add_trace(go.Scatter(name="predicted = measured", x=[lo, hi], y=[lo, hi], mode="lines",
                                 line=dict(dash="dash", color="grey")))
    fig.update_layout(title="the twin against the backend, per op", xaxis_title="measured (ms)",
                      yaxis_title="predicted (ms)", xaxis_type="log", yaxis_type="log", height=480,
                      template="plotly_white")
    return fig


def iteration_validation_figure(runs: list[dict], target: float) -> go.Figure:
    """Predicted against measured iteration time per grid (a `twin validate` report's runs: "grid" and
    "iteration" with "measured_s", "predicted_s", "error"), with the y = x line and the band of
    +-`target` (a fraction) around it."""
    fig = go.Figure()
    x = [r["iteration"]["measured_s"] for r in runs]
    fig.add_trace(go.Scatter(name="grids", x=x, y=[r["iteration"]["predicted_s"] for r in runs], mode="markers",
                             text=[f"{r['grid']}: {100 * r['iteration']['error']:+.0f} %" for r in runs],
                             hovertemplate="%{text}<br>measured %{x:.3f} s<br>predicted %{y:.3f} s<extra></extra>"))
    if x:
        lo, hi = min(x) * 0.8, max(x) * 1.2
        for f, name, dash in ((1.0, "predicted = measured", "dash"), (1 + target, f"+{100 * target:.0f} %", "dot"),
                              (1 - target, f"-{100 * target:.0f} %", "dot")):
            fig.add_trace(go.Scatter(name=name, x=[lo, hi], y=[lo * f, hi * f], mode="lines",
                                     line=dict(dash=dash, color="grey"), hoverinfo="skip"))
    fig.update_layout(title="the twin against the backend, iteration time per grid", xaxis_title="measured (s)",
                      yaxis_title="predicted (s)", height=480, template="plotly_white")
    return fig
