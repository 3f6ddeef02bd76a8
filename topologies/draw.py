"""Pictures of a system with plotly: the dragonfly (groups and their global links) and one node's fabric."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from topologies.network import Network
from topologies.placement import Placement


def _segments(x0, y0, x1, y1) -> tuple[list, list]:
    """Line segments as one trace's coordinates, separated by None."""
    xs, ys = [], []
    for a, b, c, d in zip(x0, y0, x1, y1):
        xs += [a, c, None]
        ys += [b, d, None]
    return xs, ys


def topology_figure(net: Network, placement: Placement | None = None) -> go.Figure:
    """Left: the dragonfly groups on a circle, one line per pair of groups joined by global links
    (hover: cable count and bandwidth); groups holding the job are highlighted. Right: one node's
    GPUs and NICs with every link's bandwidth (GB/s per direction)."""
    s = net.system
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4],
                        subplot_titles=(f"{s.name}: {net.groups} dragonfly groups, "
                                        f"{net.L} global links per pair" if s.dragonfly else f"{s.name}: one node, no network",
                                        f"one node: {s.gpus_per_node} x {s.gpu.name}, {s.nics_per_node} NICs"))
    # dragonfly
    G = net.groups
    ang = 2 * np.pi * np.arange(G) / G
    gx, gy = np.cos(ang), np.sin(ang)
    if G > 1 and net.L:
        lo, hi = np.triu_indices(G, 1)
        xs, ys = _segments(gx[lo], gy[lo], gx[hi], gy[hi])
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(width=0.3, color="rgba(90,90,160,0.35)"),
                                 hoverinfo="skip", name=f"global links ({net.L} x {s.dragonfly.link_bandwidth / 1e9:.0f} GB/s per pair)"),
                      row=1, col=1)
    used = set(placement.groups_used().tolist()) if placement is not None else set()
    npg = s.nodes_per_group
    nodes_in = [min(npg, s.nodes - g * npg) for g in range(G)]
    text = [f"group {g}: {nodes_in[g]} nodes, {net.S} switches" + (" (job)" if g in used else "") for g in range(G)]
    fig.add_trace(go.Scatter(x=gx, y=gy, mode="markers", text=text, hoverinfo="text", name="groups",
                             marker=dict(size=9, color=["crimson" if g in used else "steelblue" for g in range(G)])),
                  row=1, col=1)
    # node fabric: GPUs on an inner circle, NICs outside
    g = s.gpus_per_node
    a = 2 * np.pi * np.arange(g) / g
    px, py = np.cos(a), np.sin(a)
    la, lb = np.triu_indices(g, 1)
    bw = s.node_links[la, lb] / 1e9
    for value in np.unique(bw):
        sel = bw == value
        xs, ys = _segments(px[la[sel]], py[la[sel]], px[lb[sel]], py[lb[sel]])
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"GPU-GPU {value:.0f} GB/s",
                                 line=dict(width=0.5 + 3 * value / bw.max())), row=1, col=2)
    mx, my = (px[la] + px[lb]) / 2, (py[la] + py[lb]) / 2
    fig.add_trace(go.Scatter(x=mx, y=my, mode="markers", marker=dict(size=4, color="gray"), hoverinfo="text",
                             text=[f"GPU {i} - GPU {j}: {v:.0f} GB/s" for i, j, v in zip(la, lb, bw)],
                             showlegend=False), row=1, col=2)
    fig.add_trace(go.Scatter(x=px, y=py, mode="markers+text", text=[f"GPU {i}" for i in range(g)],
                             textposition="middle center", marker=dict(size=28, color="orange"), name="GPUs"),
                  row=1, col=2)
    if s.nics_per_node:
        k = s.nics_per_node
        na = 2 * np.pi * (np.arange(k) + 0.5) / k
        nx_, ny_ = 1.6 * np.cos(na), 1.6 * np.sin(na)
        nic = np.asarray(s.gpu_nic)
        xs, ys = _segments(px, py, nx_[nic], ny_[nic])
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(dash="dot", color="green"),
                                 name=f"GPU-NIC {s.gpu_nic_bandwidth / 1e9:.0f} GB/s"), row=1, col=2)
        fig.add_trace(go.Scatter(x=nx_, y=ny_, mode="markers+text", text=[f"NIC {i}" for i in range(k)],
                                 textposition="top center", marker=dict(size=16, color="green", symbol="square"),
                                 name=f"NICs {s.nic_bandwidth / 1e9:.0f} GB/s to a switch"), row=1, col=2)
    for c in (1, 2):
        fig.update_xaxes(visible=False, scaleanchor=f"y{'' if c == 1 else c}", row=1, col=c)
        fig.update_yaxes(visible=False, row=1, col=c)
    fig.update_layout(title=s.description, height=700, width=1400, template="plotly_white")
    return fig
