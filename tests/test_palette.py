"""Pictures that read right: waits (one colour per axis) never share a colour with an op kind, idle,
the critical path or each other; the dragonfly heat map names the axis it shows and offers buttons
exactly when there are axes to pick; a node's GPU numbers sit on top of their markers, with the
ring arrows ending outside them."""

from __future__ import annotations

import itertools
import math

import numpy as np

from topologies.draw import AXIS_COLOURS, GPU_R, group_traffic_figure, node_rings_figure
from topologies.system import load_system
from twin.present.plots import IDLE_COLOUR, KIND_COLOURS

MIN_DELTA_E = 30.0  # CIE76 distance in Lab: two colours this far apart are told apart at a glance


def lab(colour: str) -> tuple[float, float, float]:
    """sRGB '#rrggbb' to CIE Lab (D65)."""
    def linear(c):
        return ((c + 0.055) / 1.055) ** 2.4 if c > 0.04045 else c / 12.92
    r, g, b = (linear(int(colour[i:i + 2], 16) / 255) for i in (1, 3, 5))
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(v):
        return v ** (1 / 3) if v > 0.008856 else 7.787 * v + 16 / 116
    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def test_waits_never_share_a_colour_with_op_kinds_or_each_other():
    others = {**KIND_COLOURS, "idle": IDLE_COLOUR, "critical path": "#000000", "background": "#ffffff"}
    for axis, colour in AXIS_COLOURS.items():
        for name, other in others.items():
            d = math.dist(lab(colour), lab(other))
            assert d >= MIN_DELTA_E, f"exposed {axis} ({colour}) is {d:.0f} from {name} ({other})"
    for (a, ca), (b, cb) in itertools.combinations(AXIS_COLOURS.items(), 2):
        assert math.dist(lab(ca), lab(cb)) >= MIN_DELTA_E, (a, b)


def test_the_old_palette_would_fail():
    assert math.dist(lab("#e41a1c"), lab(KIND_COLOURS["all_reduce"])) < MIN_DELTA_E  # the example


def test_the_heat_map_names_its_axis_and_has_buttons_only_to_pick_one():
    m = np.array([[np.nan, 5.0], [3.0, np.nan]])
    one = group_traffic_figure({"data": m, "x": np.full((2, 2), np.nan)}, [0, 1])
    assert "data axis" in one.layout.title.text and not one.layout.updatemenus
    two = group_traffic_figure({"z": m, "data": m}, [0, 1])
    buttons = two.layout.updatemenus[0].buttons
    assert [b.label for b in buttons] == ["axis z", "axis data"]
    assert [b.args[1]["title"]["text"].split(":")[1].split("'")[0].strip() for b in buttons] == ["the z axis", "the data axis"]


def test_gpu_numbers_are_drawn_on_top_and_arrows_end_outside_the_markers():
    s = load_system("frontier")
    hops = {"x": [(0, 1), (1, 0)], "y": [(0, 2), (2, 4), (4, 0)], "data": [(a, None) for a in range(8)]}
    fig = node_rings_figure(s, hops, {"x": 1e11})
    assert fig.data[-1].name.startswith("GPUs")  # drawn last: no arrow covers a number
    gpus = fig.data[-1]
    for t in fig.data:
        if t.name.split()[0] in hops:
            ends = [(x, y) for x, y, size in zip(t.x, t.y, t.marker.size) if x is not None and size > 0]
            assert ends
            for x, y in ends:
                d = min(math.hypot(x - gx, y - gy) for gx, gy in zip(gpus.x, gpus.y))
                assert d >= GPU_R * 0.6, (t.name, x, y)  # the arrowhead sits outside a GPU's marker
