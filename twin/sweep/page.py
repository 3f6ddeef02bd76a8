"""The page of a sweep (`twin sweep --html`): every point in a table that sorts and filters, heat maps
over any two of the axes the sweep varies (the best value over the other axes, one map per pair and
figure, chosen from a menu), and the Pareto front of time to train against GPU-hours. Built from the
results file alone (twin.sweep.results), with twin.present.page.
"""

from __future__ import annotations

import html
import itertools

from twin.present.page import Page

# figure column -> (label, best is the larger?)
METRICS = {"train_days": ("days to train", False), "wall_days": ("days to train under failures", False),
           "iteration_s": ("iteration time (s)", False), "percent_of_peak": ("% of peak", True),
           "gpu_hours": ("GPU-hours", False), "goodput": ("goodput", True)}
SHOWN = ("grid", "status", "iteration_s", "percent_of_peak", "memory_gib", "tokens_per_s", "train_days",
         "gpu_hours", "goodput", "wall_days", "wall_gpu_hours", "error")
MAX_MAPS = 60

TABLE_JS = """
function sweepSort(th){const t=th.closest('table'),i=[...th.parentNode.children].indexOf(th),
 b=t.tBodies[0],rows=[...b.rows],dir=th.dataset.dir==='1'?-1:1;th.dataset.dir=dir===1?'1':'0';
 const v=r=>{const s=r.cells[i].textContent,n=parseFloat(s);return isNaN(n)||!/^[-+0-9.e]+$/i.test(s)?s:n};
 rows.sort((p,q)=>{const a=v(p),c=v(q);return (typeof a===typeof c?(a<c?-1:a>c?1:0):(typeof a==='number'?-1:1))*dir});
 rows.forEach(r=>b.appendChild(r));}
function sweepFilter(box){const f=box.value.toLowerCase();
 for(const r of document.querySelectorAll('#points tbody tr'))r.style.display=r.textContent.toLowerCase().includes(f)?'':'none';}
"""


def _num(v: str) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _fmt(v: str, digits: int = 4) -> str:
    x = _num(v)
    if x is None or v.strip() == "" or v.isdigit():
        return v
    return f"{x:.{digits}g}"


def axis_columns(header: list[str]) -> list[str]:
    """The columns that hold a point's axis values: between `key` and `status`."""
    return header[1:header.index("status")]


def _order(values: list[str]) -> list[str]:
    seen = list(dict.fromkeys(values))
    if all(_num(v) is not None for v in seen):
        return sorted(seen, key=float)
    return seen


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (smaller is better), by x."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def _label(row: dict, axes: list[str]) -> str:
    return ", ".join(f"{a}={_fmt(row[a])}" for a in axes if row.get(a, "") != "")


def pareto_figure(rows: list[dict], axes: list[str]):
    """Time to train against GPU-hours (per 1e9 tokens where the sweep gives no token count), one
    colour per system, the Pareto front drawn through its points."""
    import plotly.graph_objects as go

    ok = [r for r in rows if r["status"] == "ok"]
    if ok and all(_num(r.get("train_days")) is not None for r in ok):
        xs = [float(r["gpu_hours"]) for r in ok]
        ys = [float(r["train_days"]) for r in ok]
        xt, yt = "GPU-hours", "days to train"
    else:
        ys = [1e9 / float(r["tokens_per_s"]) / 3600 for r in ok]  # hours per 1e9 tokens
        xs = [y * int(r["gpus"]) for y, r in zip(ys, ok)]
        xt, yt = "GPU-hours per 1e9 tokens", "hours per 1e9 tokens"
    fig = go.Figure()
    for system in dict.fromkeys(r["system"] for r in ok):
        idx = [i for i, r in enumerate(ok) if r["system"] == system]
        fig.add_trace(go.Scatter(x=[xs[i] for i in idx], y=[ys[i] for i in idx], mode="markers", name=system,
                                 text=[_label(ok[i], axes) + f"<br>grid {ok[i]['grid']}" for i in idx],
                                 hovertemplate="%{text}<br>%{x:.4g} " + xt + "<br>%{y:.4g} " + yt + "<extra></extra>"))
    front = pareto(list(zip(xs, ys)))
    fig.add_trace(go.Scatter(x=[xs[i] for i in front], y=[ys[i] for i in front], mode="lines+markers",
                             name="Pareto front", line=dict(color="black", width=1),
                             marker=dict(symbol="circle-open", size=12, color="black"),
                             text=[_label(ok[i], axes) for i in front], hovertemplate="%{text}<extra>front</extra>"))
    fig.update_layout(title=f"{yt} against {xt} (lower left is better; the front: no point beats one of its "
                            "points on both)", xaxis_title=xt, yaxis_title=yt, height=520, template="plotly_white",
                      xaxis_type="log", yaxis_type="log")
    return fig, [ok[i] for i in front]


def heatmap_figure(rows: list[dict], axes: list[str]):
    """Heat maps over every pair of the varied axes, one per figure (the best over the other axes), one
    shown at a time and chosen from a menu; None when nothing succeeded."""
    import plotly.graph_objects as go

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None
    varied = [a for a in axes if len({r[a] for r in rows}) > 1] or axes[:1]
    pairs = list(itertools.combinations(varied, 2)) if len(varied) > 1 else [(varied[0], None)]
    metrics = [m for m in METRICS if all(_num(r.get(m)) is not None for r in ok)]
    fig, buttons = go.Figure(), []
    combos = list(itertools.product(metrics, pairs))[:MAX_MAPS]
    for n, (metric, (a, b)) in enumerate(combos):
        label, larger = METRICS[metric]
        xs = _order([r[a] for r in rows])
        ys = _order([r[b] for r in rows]) if b else ["all"]
        best: dict = {}
        for r in ok:
            cell = (r[a], r[b] if b else "all")
            v = float(r[metric])
            if cell not in best or (v > best[cell] if larger else v < best[cell]):
                best[cell] = v
        z = [[best.get((x, y)) for x in xs] for y in ys]
        text = [["" if v is None else f"{v:.3g}" for v in row] for row in z]
        fig.add_trace(go.Heatmap(x=[_fmt(x, 6) for x in xs], y=[_fmt(y, 6) for y in ys], z=z, text=text, texttemplate="%{text}", visible=n == 0,
                                 colorscale="Viridis", reversescale=not larger, colorbar=dict(title=label),
                                 hovertemplate=f"{a}=%{{x}}<br>{b or ''}=%{{y}}<br>{label}: %{{z:.4g}}<extra></extra>",
                                 xgap=1, ygap=1))
        title = f"{label}: best over the other axes, {b or 'all'} against {a}"
        buttons.append(dict(label=f"{label}: {b or 'all'} x {a}", method="update",
                            args=[{"visible": [i == n for i in range(len(combos))]},
                                  {"title.text": title, "xaxis.title.text": a, "yaxis.title.text": b or ""}]))
    first = combos[0]
    fig.update_layout(title=f"{METRICS[first[0]][0]}: best over the other axes, {first[1][1] or 'all'} against "
                            f"{first[1][0]}", xaxis_title=first[1][0], yaxis_title=first[1][1] or "",
                      xaxis_type="category", yaxis_type="category", height=560, template="plotly_white",
                      updatemenus=[dict(buttons=buttons, x=1.0, xanchor="right", y=1.18, yanchor="top")]
                      if len(buttons) > 1 else [])
    return fig


def sweep_page(header: list[str], rows: list[dict], title: str) -> str:
    """The page of a results file's header and rows (twin.sweep.results.read_rows)."""
    axes = axis_columns(header)
    page = Page(f"twin sweep: {title}")
    failed = [r for r in rows if r["status"] != "ok"]
    page.add(f"<h1>Sweep {html.escape(title)}</h1><p class='lead'>{len(rows)} points, {len(rows) - len(failed)} "
             f"predicted, {len(failed)} failed (their one-line errors are in the table). Each point runs the best "
             "grid that grid auto finds (or the grid asked for).</p>")
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        fig, front = pareto_figure(rows, axes)
        page.add("<h2>Time to train against GPU-hours</h2>")
        page.figure("pareto", fig)
        page.add("<p class='note'>On the front: " + html.escape("; ".join(_label(r, axes) for r in front)) + "</p>")
        page.add("<h2>Heat maps</h2><p class='note'>Choose the figure and the two axes from the menu; each cell "
                 "is the best value over the axes not shown.</p>")
        page.figure("heatmap", heatmap_figure(rows, axes))
    cols = [c for c in axes + list(SHOWN) if c in header]
    head = "".join(f"<th onclick='sweepSort(this)' title='sort'>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td{' class=err' if c == 'error' else ''}>{html.escape(_fmt(r.get(c, '')))}</td>"
                                    for c in cols) + "</tr>" for r in rows)
    page.add("<style>td.err{text-align:left;min-width:28em}</style><h2>Every point</h2><p class='note'>Click a column to sort; type to filter. "
             "<input oninput='sweepFilter(this)' placeholder='filter'></p>"
             f"<table id='points'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
             f"<script>{TABLE_JS}</script>")
    return page.html()
