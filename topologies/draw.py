"""Pictures of a system with plotly: the dragonfly groups and a job's place on them, one node's fabric
(with the rings a job lays on it), and the traffic a job sends between dragonfly groups.

Every pair of dragonfly groups is joined by global links, so drawing them all paints a solid disk
(Frontier: 2,701 pairs); the group picture draws only the links among the job's groups, and the
traffic between groups is a heat map (`group_traffic_figure`), not lines.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from topologies.network import Network
from topologies.placement import Placement
from topologies.system import SystemSpec

# One colour per axis, for its rings here and its exposed communication in the twin's charts; none near
# an op kind's colour (twin.present.plots.KIND_COLOURS) or another axis' (tests/test_palette.py)
AXIS_COLOURS = {"x": "#e7298a", "y": "#00008b", "z": "#4d4d00", "data": "#66ff66", "pipe": "#ee00ff"}
MAX_DRAWN_PAIRS = 600  # global-link pairs drawn among the job's groups, at most


def _segments(x0, y0, x1, y1) -> tuple[list, list]:
    """Line segments as one trace's coordinates, separated by None."""
    xs, ys = [], []
    for a, b, c, d in zip(x0, y0, x1, y1):
        xs += [a, c, None]
        ys += [b, d, None]
    return xs, ys


def _node_layout(s: SystemSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """GPU positions on a circle and NIC positions outside it."""
    g = s.gpus_per_node
    a = 2 * np.pi * np.arange(g) / g
    k = max(s.nics_per_node, 1)
    na = 2 * np.pi * (np.arange(k) + 0.5) / k
    return np.cos(a), np.sin(a), 1.6 * np.cos(na), 1.6 * np.sin(na)


GPU_R, NIC_R = 0.13, 0.08  # the GPU and NIC markers' radii in the node picture's units (circle of GPUs: 1)


def _pulled(a: tuple[float, float], b: tuple[float, float], ra: float, rb: float):
    """The segment from a to b shortened by ra at a and rb at b: it runs between the markers' edges."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    n = max(float(np.hypot(dx, dy)), 1e-9)
    return (a[0] + ra * dx / n, a[1] + ra * dy / n), (b[0] - rb * dx / n, b[1] - rb * dy / n)


def outward_positions(px: np.ndarray, py: np.ndarray) -> list[str]:
    """Where each label of points on a circle goes: outward, away from the links and ring arrows that
    run inside the circle."""
    out = []
    for x, y in zip(px, py):
        if y > 0.5:
            out.append("top center")
        elif y < -0.5:
            out.append("bottom center")
        else:
            out.append("middle right" if x > 0 else "middle left")
    return out


def _add_node_fabric(fig: go.Figure, s: SystemSpec, row: int, col: int, gpus: bool = True) -> None:
    """One node's GPUs (unless `gpus` is False: the caller draws them last), NICs and links (GB/s per
    direction) into a subplot."""
    px, py, nx_, ny_ = _node_layout(s)
    g = s.gpus_per_node
    la, lb = np.triu_indices(g, 1)
    bw = s.node_links[la, lb] / 1e9
    top = bw.max() if len(bw) and bw.max() > 0 else 1.0
    for value in np.unique(bw):
        if value <= 0:
            continue
        sel = bw == value
        xs, ys = _segments(px[la[sel]], py[la[sel]], px[lb[sel]], py[lb[sel]])
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"GPU-GPU {value:.0f} GB/s", hoverinfo="skip",
                                 line=dict(width=0.5 + 3 * value / top, color="rgba(120,120,120,0.6)")),
                      row=row, col=col)
    if s.nics_per_node:
        nic = np.asarray(s.gpu_nic)
        xs, ys = _segments(px, py, nx_[nic], ny_[nic])
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(dash="dot", color="green"), hoverinfo="skip",
                                 name=f"GPU-NIC {s.gpu_nic_bandwidth / 1e9:.0f} GB/s"), row=row, col=col)
        fig.add_trace(go.Scatter(x=nx_, y=ny_, mode="markers+text", text=[f"NIC {i}" for i in range(len(nx_))],
                                 textposition=outward_positions(nx_, ny_), marker=dict(size=16, color="green", symbol="square"),
                                 name=f"NICs {s.nic_bandwidth / 1e9:.0f} GB/s to a switch"), row=row, col=col)
    if gpus:
        _add_gpus(fig, s, row, col)


def _add_gpus(fig: go.Figure, s: SystemSpec, row: int, col: int) -> None:
    """One node's GPUs, numbered inside their markers (drawn last, so that nothing covers a number)."""
    px, py, _, _ = _node_layout(s)
    g = s.gpus_per_node
    fig.add_trace(go.Scatter(x=px, y=py, mode="markers+text", text=[str(i) for i in range(g)],
                             textposition="middle center", textfont=dict(color="black", size=13),
                             marker=dict(size=30, color="orange", line=dict(color="white", width=1)),
                             name="GPUs (numbered)", hovertext=[f"GPU {i}: {s.gpu.name}" for i in range(g)],
                             hoverinfo="text"), row=row, col=col)


def topology_figure(net: Network, placement: Placement | None = None) -> go.Figure:
    """Left: the dragonfly groups on a circle, the job's groups in red with the global links among
    them (every pair of groups has `L` links; the others are not drawn). Right: one node's GPUs and
    NICs with every link's bandwidth (GB/s per direction). A fat tree is drawn by fat_tree_figure."""
    if net.fattree is not None:
        return fat_tree_figure(net, placement)
    s = net.system
    G = net.groups
    used = sorted(set(placement.groups_used().tolist())) if placement is not None else []
    left = (f"{s.name}: {G} dragonfly groups, {net.L} global links between every pair"
            if s.dragonfly else f"{s.name}: one node, no network")
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45],
                        subplot_titles=(left, f"one node: {s.gpus_per_node} x {s.gpu.name}, {s.nics_per_node} NICs"))
    ang = 2 * np.pi * np.arange(G) / G
    gx, gy = np.cos(ang), np.sin(ang)
    if len(used) > 1 and net.L:
        u = np.asarray(used)
        lo, hi = np.triu_indices(len(u), 1)
        if len(lo) > MAX_DRAWN_PAIRS:
            keep = np.linspace(0, len(lo) - 1, MAX_DRAWN_PAIRS).astype(int)
            lo, hi = lo[keep], hi[keep]
        xs, ys = _segments(gx[u[lo]], gy[u[lo]], gx[u[hi]], gy[u[hi]])
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(width=0.6, color="rgba(200,30,30,0.35)"),
                                 hoverinfo="skip", name=f"global links among the job's groups "
                                 f"({net.L} x {s.dragonfly.link_bandwidth / 1e9:.0f} GB/s per pair)"), row=1, col=1)
    npg = s.nodes_per_group
    nodes_in = [min(npg, s.nodes - g * npg) for g in range(G)]
    job_nodes = {}
    if placement is not None:
        gs, counts = np.unique(s.group_of_node(placement.nodes), return_counts=True)
        job_nodes = dict(zip(gs.tolist(), counts.tolist()))
    text = [f"group {g}: {nodes_in[g]} nodes, {net.S} switches"
            + (f"; the job uses {job_nodes[g]} nodes" if g in job_nodes else "") for g in range(G)]
    fig.add_trace(go.Scatter(x=gx, y=gy, mode="markers", text=text, hoverinfo="text",
                             name=f"groups ({len(used)} hold the job, in red)" if placement is not None else "groups",
                             marker=dict(size=9 if G > 64 else 14,
                                         color=["crimson" if g in job_nodes else "steelblue" for g in range(G)])),
                  row=1, col=1)
    _add_node_fabric(fig, s, 1, 2)
    for c in (1, 2):
        fig.update_xaxes(visible=False, scaleanchor=f"y{'' if c == 1 else c}", row=1, col=c)
        fig.update_yaxes(visible=False, row=1, col=c)
    fig.update_layout(title=s.description, height=640, template="plotly_white",
                      legend=dict(orientation="h", y=-0.05))
    return fig


def fat_tree_figure(net: Network, placement: Placement | None = None) -> go.Figure:
    """Left: a fat tree by levels (leaf at the bottom), its switches aggregated by pod (the blocks under
    the top level: one marker per pod and level, one for the whole top level), the pods that hold the
    job in red; hovering a marker says its switches and nodes. Right: one node's fabric."""
    s, ft = net.system, net.fattree
    spec = s.fattree
    h, pods = ft.h, ft.pods
    rails = f", rail-optimized: {s.nics_per_node} rails x {ft.pods_per_rail} pods" if spec.rail_optimized else ""
    left = (f"{s.name}: {h}-level fat tree ({', '.join(f'{lv.name} {lv.radix}' for lv in spec.levels)} ports), "
            f"{pods} pods{rails}")
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.03,
                        subplot_titles=(left, f"one node: {s.gpus_per_node} x {s.gpu.name}, {s.nics_per_node} NICs"))
    # which pods the job's NICs are in (every NIC of a job's node: a rail-optimized node is in one pod per rail)
    job = np.zeros(pods, dtype=np.int64)
    if placement is not None:
        nics = (placement.nodes[:, None] * s.nics_per_node + np.arange(s.nics_per_node)).ravel()
        per_node = ft.endpoint(nics).reshape(len(placement.nodes), -1) // ft.pod_size  # (nodes, NICs) pod
        for q in np.unique(per_node).tolist():
            job[q] = int((per_node == q).any(axis=1).sum())
    px = (np.arange(pods) + 0.5) / pods if pods else np.zeros(0)

    def pod_nodes(q: int) -> str:
        if spec.rail_optimized:
            k, j = divmod(q, max(ft.pods_per_rail, 1))
            lo, hi = j * ft.pod_size, min(s.nodes, (j + 1) * ft.pod_size) - 1
            return f"rail {k} (NIC {k}) of nodes {lo}-{hi}"
        lo, hi = q * ft.pod_size // s.nics_per_node, min(s.nodes * s.nics_per_node, (q + 1) * ft.pod_size) - 1
        return f"the NICs of nodes {lo}-{hi // s.nics_per_node}"

    colour = ["crimson" if job[q] else "steelblue" for q in range(pods)]
    for l, lv in enumerate(spec.levels):
        if l == h - 1:  # the top level: one marker, linked to every pod's switches below it
            below = h - 2
            if below >= 0:
                xs, ys = _segments(px, np.full(pods, below), np.full(pods, 0.5), np.full(pods, l))
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=l == 1,
                                         line=dict(width=0.6, color="rgba(120,120,120,0.5)"),
                                         name="links between levels (every pod reaches every top switch)"), row=1, col=1)
            fig.add_trace(go.Scatter(x=[0.5], y=[l], mode="markers+text", text=[f"{ft.switches[l]} x {lv.name}"],
                                     textposition="top center", hoverinfo="text", showlegend=False,
                                     hovertext=[f"{ft.switches[l]} {lv.name} switches of {lv.radix} ports, "
                                                f"{lv.link_bandwidth / 1e9:.0f} GB/s links from below"],
                                     marker=dict(size=22, color="dimgray", symbol="square")), row=1, col=1)
            continue
        per_pod = ft.switches[l] // pods
        if l > 0:
            xs, ys = _segments(px, np.full(pods, l - 1), px, np.full(pods, l))
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=l == 1,
                                     line=dict(width=0.6, color="rgba(120,120,120,0.5)"),
                                     name="links between levels (every pod reaches every top switch)"), row=1, col=1)
        text = [f"pod {q}, {lv.name}: {per_pod} switches of {lv.radix} ports ({lv.down} down, {lv.up} up); "
                f"{pod_nodes(q)}" + (f"; the job uses {job[q]} of its nodes" if job[q] else "") for q in range(pods)]
        label = [f"rail {q // max(ft.pods_per_rail, 1)}" if spec.rail_optimized else f"pod {q}" for q in range(pods)]
        show = l == 0 and pods <= 32   # under the leaves, each pod's rail (or number) where they fit
        fig.add_trace(go.Scatter(x=px, y=np.full(pods, l), mode="markers+text" if show else "markers",
                                 text=label if show else None, hovertext=text, hoverinfo="text",
                                 textposition="bottom center", textfont=dict(size=9),
                                 name=(f"pods ({int((job > 0).sum())} hold the job, in red)" if placement is not None
                                       else "pods") if l == 0 else None, showlegend=l == 0,
                                 marker=dict(size=max(5, min(16, 600 // max(pods, 1))), color=colour, symbol="square")),
                      row=1, col=1)
        fig.add_annotation(x=-0.02, y=l, text=f"{lv.name}<br>{per_pod} per pod", showarrow=False, xanchor="right",
                           row=1, col=1)
    _add_node_fabric(fig, s, 1, 2)
    fig.update_xaxes(visible=False, range=[-0.15, 1.02], row=1, col=1)
    fig.update_yaxes(visible=False, range=[-0.5, h - 0.4], row=1, col=1)
    fig.update_xaxes(visible=False, scaleanchor="y2", row=1, col=2)
    fig.update_yaxes(visible=False, row=1, col=2)
    fig.update_layout(title=s.description, height=640, template="plotly_white", legend=dict(orientation="h", y=-0.05))
    return fig


def node_rings_figure(s: SystemSpec, hops: dict[str, list[tuple[int, int | None]]],
                      bandwidth: dict[str, float] | None = None) -> go.Figure:
    """One node's fabric with the job's rings on it: for each axis, its ring hops from a GPU of this
    node to the next member (`(gpu, gpu)` inside the node, `(gpu, None)` when the hop leaves the node
    through the GPU's NIC). `bandwidth[axis]`: the bus bandwidth the axis gets (bytes/s), for the legend."""
    fig = make_subplots(rows=1, cols=1)
    _add_node_fabric(fig, s, 1, 1, gpus=False)
    px, py, nx_, ny_ = _node_layout(s)
    nic = np.asarray(s.gpu_nic) if s.nics_per_node else None
    for i, (axis, hs) in enumerate(hops.items()):
        if not hs:
            continue
        shift = 0.05 * (i - 1.5)
        xs, ys, sizes = [], [], []
        for a, b in hs:
            if b is None:
                if nic is None:
                    continue
                end, pull = (nx_[nic[a]], ny_[nic[a]]), NIC_R
            elif a != b:
                end, pull = (px[b], py[b]), GPU_R
            else:
                continue
            (x0, y0), (x1, y1) = _pulled((px[a], py[a]), end, GPU_R, pull)
            xs += [x0 + shift, x1 + shift, None]
            ys += [y0 + shift, y1 + shift, None]
            sizes += [0, 12, 0]  # an arrowhead at the end only, outside the marker it points to
        bw = f", {bandwidth[axis] / 1e9:.1f} GB/s bus bandwidth" if bandwidth and axis in bandwidth else ""
        leaves = sum(1 for _, b in hs if b is None)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=f"{axis} rings{bw}"
                                 + (f" ({leaves} of {len(hs)} hops leave the node)" if leaves else ""),
                                 line=dict(color=AXIS_COLOURS.get(axis, "black"), width=3),
                                 marker=dict(symbol="arrow", angleref="previous", size=sizes), hoverinfo="name"))
    _add_gpus(fig, s, 1, 1)  # on top of the ring arrows
    fig.update_xaxes(visible=False, scaleanchor="y")
    fig.update_yaxes(visible=False)
    fig.update_layout(title=f"the job's rings on one node ({s.gpus_per_node} x {s.gpu.name})", height=560,
                      template="plotly_white", legend=dict(orientation="v", x=1.02, y=1))
    return fig


def group_traffic_figure(load: dict[str, np.ndarray], groups: list[int], note: str = "") -> go.Figure:
    """Heat maps of the traffic between the job's dragonfly groups, one per axis that crosses groups
    (a dropdown picks the axis): `load[axis][i, j]` is the mean load of the global links from group
    groups[i] to group groups[j] over one iteration, in % of their capacity. The title names the axis
    shown; buttons switch axes where there are several."""
    axes = [a for a, m in load.items() if np.nansum(m) > 0]
    fig = go.Figure()
    labels = [f"g{g}" for g in groups]

    def title(a: str) -> dict:
        return dict(text=f"traffic between dragonfly groups: the {a} axis' rings" + (f"<br><sup>{note}</sup>" if note else ""),
                    y=0.97)

    for i, a in enumerate(axes):
        m = load[a]
        fig.add_trace(go.Heatmap(z=m, x=labels, y=labels, colorscale="Reds", zmin=0,
                                 zmax=max(float(np.nanmax(m)), 1e-9), visible=i == 0, name=a,
                                 colorbar=dict(title="% of the<br>global links"),
                                 hovertemplate="group %{y} -> %{x}: %{z:.2f} % of the links' capacity<extra>axis " + a + "</extra>"))
    if len(axes) > 1:
        fig.update_layout(updatemenus=[dict(type="buttons", direction="right", x=0, y=1.12, xanchor="left", buttons=[
            dict(label=f"axis {a}", method="update",
                 args=[{"visible": [j == i for j in range(len(axes))]}, {"title": title(a)}]) for i, a in enumerate(axes)])])
    fig.update_layout(title=title(axes[0]) if axes else dict(text="traffic between dragonfly groups", y=0.97),
                      xaxis_title="to group", yaxis_title="from group",
                      yaxis=dict(autorange="reversed", scaleanchor="x"), height=560, template="plotly_white",
                      margin=dict(t=120))
    return fig
