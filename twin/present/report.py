"""`twin report`: one self-contained HTML page that answers "where does the time go, and why".

    from twin.present.report import build_report
    rep = build_report("frontier")            # the system's default study, grid auto
    Path("report.html").write_text(rep.html)

The page holds, for one simulated iteration:
- a summary in words (iteration time, flop/s, the largest exposed communication, the hottest links);
- the breakdown (compute, exposed communication per axis, idle);
- the timeline of the streams, opened on one layer's backward pass, with the compute stream's waits
  (exposed communication, per axis) and the critical path marked; a full run draws a few ranks and
  summarises every rank in a second chart (a browser cannot draw thousands of rows);
- the network under the job: the traffic each axis sends between dragonfly groups as heat maps (% of
  the global links' capacity over the iteration) and the job's rings on one node's fabric, with the
  bus bandwidth each axis gets;
- the grid search (analytical estimate and simulation of the best grids);
- the scaling curve and the twin-vs-backend scatter when they are given (`scaling=`, `runs=`).
"""

from __future__ import annotations

import html
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from twin.program.grid import AXES, Grid
from twin.present.page import Page, html_table
from twin.program.program import Options, Program, build_program
from twin.predict.result import SimulationResult
from twin.predict.study import Study, prepare
from twin.program.trace import Span


@dataclass
class Report:
    """What `build_report` computed, and the page (`html`)."""

    result: SimulationResult
    candidates: list = field(default_factory=list)
    critical: set = field(default_factory=set)       # (rank, op name) on the critical path
    window: tuple[float, float] | None = None         # the timeline's opening x range (s)
    window_label: str = ""
    group_load: dict = field(default_factory=dict)    # axis -> (groups x groups) % of global link capacity
    groups: list = field(default_factory=list)         # the job's dragonfly groups
    crossing: dict = field(default_factory=dict)       # axis -> share of its ring bytes that leaves its group
    bandwidth: dict = field(default_factory=dict)      # axis -> bus bandwidth (bytes/s), all groups at once
    hops: dict = field(default_factory=dict)           # axis -> ring hops on node 0
    summary: list = field(default_factory=list)        # sentences of the page's summary
    html: str = ""
    seconds: dict = field(default_factory=dict)        # wall time of each stage
    left_out: list = field(default_factory=list)       # sentences: what the page could not draw, and why


def critical_path(spans: list[Span], program: Program, rank: int) -> set[tuple[int, str]]:
    """The ops of `rank` on the critical path: from the op that ends last, step back each time to
    the predecessor (a dependency or the previous op on its stream) that ended last; (rank, name)."""
    mine = {s.args.get("index"): s for s in spans if s.rank == rank}
    if not mine:
        return set()
    prev: dict[int, int] = {}
    last: dict[str, int] = {}
    for op in program.ops:
        if op.stream in last:
            prev[op.index] = last[op.stream]
        last[op.stream] = op.index
    i = max(mine, key=lambda k: mine[k].start_s + mine[k].duration_s)
    out = set()
    while i is not None:
        out.add((rank, mine[i].name))
        preds = [j for j in (*program.ops[i].deps, prev.get(i)) if j is not None and j in mine]
        i = max(preds, key=lambda j: mine[j].start_s + mine[j].duration_s) if preds else None
    return out


def layer_window(spans: list[Span], program: Program, rank: int) -> tuple[tuple[float, float] | None, str]:
    """The x range of one layer's backward pass on `rank` (the middle block), and its label."""
    layers = program.model.layers
    mid = layers // 2
    pat = re.compile(rf"^(mb0\.)?L{mid}\.[a-z_0-9]+\.bwd\.")
    sel = [s for s in spans if s.rank == rank and pat.match(s.name)]
    if not sel:
        return None, ""
    a = min(s.start_s for s in sel)
    b = max(s.start_s + s.duration_s for s in sel)
    pad = 0.05 * (b - a)
    return (a - pad, b + pad), f"layer L{mid}'s backward pass"


def group_traffic(study: Study, grid: Grid, program: Program, placement, iteration_s: float):
    """Per axis, the bytes its rings send between dragonfly groups in one iteration, as the mean load
    of the global links between each ordered pair of the job's groups (% of their capacity), and the
    share of the axis' ring bytes that leaves a group. Minimal routes: adaptive routing spreads the
    load of a hot pair over other groups' links."""
    s = study.system
    groups = sorted(set(placement.groups_used().tolist()))
    wire = program.comm_bytes()
    load, crossing = {}, {}
    if not s.dragonfly:
        return load, crossing, groups
    cap = s.dragonfly.global_links_per_pair * s.dragonfly.link_bandwidth * iteration_s  # bytes per pair
    group_of_rank = placement.group
    remap = np.full(int(group_of_rank.max()) + 1, -1)
    remap[groups] = np.arange(len(groups))
    for axis in AXES:
        p = grid.axis_size(axis)
        if p == 1 or wire[axis] <= 0:
            continue
        r = np.arange(grid.size).reshape(grid.data, grid.z, grid.y, grid.x)
        r = np.moveaxis(r, 3 - AXES.index(axis), -1).reshape(-1, p)
        src = remap[group_of_rank[r]]
        dst = np.roll(src, -1, axis=1)
        m = np.zeros((len(groups), len(groups)))
        np.add.at(m, (src.ravel(), dst.ravel()), wire[axis])
        total = m.sum()
        off = total - np.trace(m)
        crossing[axis] = off / total if total else 0.0
        if off > 0:
            np.fill_diagonal(m, np.nan)
            load[axis] = 100.0 * m / cap
    return load, crossing, groups


def node_hops(grid: Grid, placement) -> dict[str, list[tuple[int, int | None]]]:
    """Per axis, the ring hops that start on the job's first node: (local GPU, local GPU of the next
    member) inside the node, (local GPU, None) when the next member is on another node."""
    node0 = placement.node[0]
    mine = [r for r in range(min(grid.size, len(placement.node))) if placement.node[r] == node0]
    out = {}
    for axis in AXES:
        if grid.axis_size(axis) == 1:
            continue
        hops = []
        for r in mine:
            members = grid.group(r, axis)
            nxt = members[(members.index(r) + 1) % len(members)]
            hops.append((int(placement.local[r]), int(placement.local[nxt]) if placement.node[nxt] == node0 else None))
        out[axis] = hops
    return out


def _summary(rep: Report, study: Study) -> list[str]:
    r = rep.result
    it = r.iteration_time_s
    b = r.breakdown_s
    out = [f"One iteration of {r.model} ({r.global_batch} x {r.seq_len} tokens) on {r.gpus:,} GPUs of {r.system}, "
           f"grid {r.grid_str} (x fastest), takes {it:.3f} s: {r.flops_per_s / 1e15:.1f} PF/s, "
           f"{r.percent_of_peak:.1f} % of the GPUs' advertised peak; {r.memory_per_gpu_bytes / 2**30:.1f} GiB per GPU."]
    comp = 100 * b["compute"] / it
    exposed = sorted(b["exposed_comm"].items(), key=lambda kv: -kv[1])
    out.append(f"Compute runs {comp:.1f} % of the iteration; the compute stream waits for communication "
               f"{100 * sum(v for _, v in exposed) / it:.1f} % and is idle {100 * b['idle'] / it:.1f} %"
               + (f"; the pipeline bubble is {100 * b['bubble'] / it:.1f} %." if "bubble" in b else "."))
    if exposed and exposed[0][1] > 0:
        a, v = exposed[0]
        bw = rep.bandwidth.get(a)
        out.append(f"The largest exposed communication is the {a} axis (groups of {r.grid[a]} GPUs): "
                   f"{100 * v / it:.1f} % of the iteration" + (f", at {bw / 1e9:.1f} GB/s bus bandwidth per ring"
                                                               if bw else "") + ".")
    hot = [(float(np.nanmax(m)), a) for a, m in rep.group_load.items() if np.isfinite(np.nanmax(m))]
    if hot:
        top, a = max(hot)
        m = rep.group_load[a]
        i, j = np.unravel_index(np.nanargmax(m), m.shape)
        over = (f"{top / 100:.1f} times what they can carry in the iteration: adaptive routing must send most "
                "of it through other groups" if top > 100 else f"{top:.1f} % of their capacity over the iteration")
        out.append(f"The hottest global links are those from group {rep.groups[i]} to group {rep.groups[j]}: on "
                   f"minimal routes the {a} axis' rings load them {over} (the job spans {len(rep.groups)} of "
                   f"{study.system.groups} groups).")
    elif study.system.dragonfly:
        out.append(f"No ring leaves its dragonfly group (the job spans {len(rep.groups)} group"
                   f"{'s' if len(rep.groups) != 1 else ''}): the global links carry nothing.")
    if r.mode == "full":
        out.append(f"Full mode: all {r.simulated_ranks} ranks simulated; the timeline draws a few of them "
                   "(the first, the busiest and those that wait most), the chart below it every rank.")
    return out


def build_report(system: str, model: str | None = None, gpus: int | None = None, grid: str | Grid | None = "auto",
                 batch: int | None = None, seq_len: int | None = None, options: Options | None = None,
                 placement: str = "contiguous", full: bool = False, slowdown: dict[int, float] | None = None,
                 profile: str | None = None, gemm_tuning: bool = True, top: int = 8, simulate_top: int = 2,
                 runs: list[str | Path] | None = None, scaling: list[dict] | None = None,
                 progress=None) -> Report:
    """Simulate the study, rank grids, measure the network under the job and write the page.

    grid "auto" (or None) ranks `top` grids and simulates `simulate_top` of them, as `twin search`;
    a given grid skips the ranking when `top` is 0. `runs`: `backend run` folders to validate the
    twin against (by the validator plugged in, `validator()`; TwinError without one); `scaling`:
    points {"gpus", "flops_per_s", ...} for the scaling curve. `progress(stage: str)` is called as each
    stage starts. Raises TwinError."""
    from topologies.common import TwinError
    from topologies.placement import place
    from twin.predict.auto import search
    from twin.predict.run import simulate_grid
    from twin.predict.study import collective_model

    validate = validator() if runs else None
    if runs and validate is None:
        raise TwinError('--run: no validator is installed to compare the twin with the runs '
                        '(entry-point group "twin.report")')
    say = progress or (lambda stage: None)
    seconds = {}
    t0 = time.perf_counter()
    study = prepare(system, model, gpus, batch, seq_len, options, placement, profile, gemm_tuning)
    auto = grid is None or (isinstance(grid, str) and grid.strip().lower() == "auto")
    cands = []
    if auto or top > 0:
        say("ranking grids")
        cands = search(study, top=max(top, 1), simulate_top=simulate_top, tick=getattr(progress, "part", None))
        seconds["search"] = time.perf_counter() - t0
    if auto:
        sims = [c for c in cands if c.simulated_s is not None] or cands[:1]
        best = min(sims, key=lambda c: (c.simulated_s if c.simulated_s is not None else c.analytical_s, str(c.grid)))
        g, how = best.grid, f"auto: fastest simulated of the analytical top {len(sims)}"
    else:
        g, how = (Grid.parse(grid) if isinstance(grid, str) else grid), "given"
    say(f"simulating grid {g}" + (" (every rank)" if full else ""))
    t1 = time.perf_counter()
    cm = collective_model(study, g)
    program = build_program(study.model, g, study.options, study.batch, study.seq_len)
    from twin.predict.run import MAX_TRACE_SPANS
    events = len(program.ops) * g.size
    left_out = []
    if full and events > MAX_TRACE_SPANS:  # every rank's numbers, one representative rank's timeline
        result = simulate_grid(study, g, full=True, slowdown=slowdown, record=False, collectives=cm, grid_choice=how,
                               tick=getattr(progress, "part", None))  # a --full run moves the bar as it goes
        one = simulate_grid(study, g, record=True, collectives=cm, grid_choice=how)
        result.spans, result.waits = one.spans, one.waits
        left_out.append(f"The timeline shows one representative rank (a symmetric run{', without the stragglers' if slowdown else ''}): "
                        f"the timelines of all {g.size:,} ranks would hold {events:,} events, more than the "
                        f"{MAX_TRACE_SPANS:,} the twin records. The iteration time and the breakdown are the full run's.")
    else:
        result = simulate_grid(study, g, full=full, slowdown=slowdown, record=True, collectives=cm, grid_choice=how,
                               tick=getattr(progress, "part", None))
    seconds["simulate"] = time.perf_counter() - t1
    rep = Report(result=result, candidates=cands, left_out=left_out)
    say("tracing the critical path")
    from twin.present.plots import pick_ranks
    shown = pick_ranks(result.spans)
    for r in shown:  # a pipelined grid: each stage's rank along its own stage's program
        prog = build_program(study.model, g, study.options, study.batch, study.seq_len, stage=g.stage(r)) \
            if g.pipe > 1 else program
        rep.critical |= critical_path(result.spans, prog, r)
    rep.window, rep.window_label = layer_window(result.spans, program, shown[0])
    say("measuring the network under the job")
    t1 = time.perf_counter()
    job = place(study.system, g.size, study.placement)
    rep.group_load, rep.crossing, rep.groups = group_traffic(study, g, program, job, result.iteration_time_s)
    rep.hops = node_hops(g, job)
    rep.bandwidth = {a: cm.effective_bandwidth(a) for a in AXES if g.axis_size(a) > 1}
    seconds["network"] = time.perf_counter() - t1
    validation = None
    if runs:
        say("validating against the runs")
        validation = validate([str(r) for r in runs], study.system.name)
    rep.summary = _summary(rep, study) + rep.left_out
    say("drawing the page")
    rep.html = render(rep, study, validation, scaling)
    seconds["total"] = time.perf_counter() - t0
    rep.seconds = seconds
    return rep


def validator():
    """The function that compares the twin with `backend run` folders for the page, plugged in through
    the entry-point group "twin.report" (name "validation"; `twin validate`'s package provides it, the
    twin does not import it): (run folders, system name) -> {"runs": [{"grid", "per_op": [{"name",
    "kind", "measured_s", "predicted_s"}, ...]}, ...], "summary": [sentences]}. None when none is installed."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="twin.report", name="validation"):
        return ep.load()
    return None


def render(rep: Report, study: Study, validation: dict | None = None, scaling: list[dict] | None = None) -> str:
    """The page: sections of text, tables and plotly figures (twin.present.page). `validation`: what
    `validator()` returned for the runs."""
    from topologies.draw import group_traffic_figure, node_rings_figure
    from twin.present.plots import (breakdown_figure, breakdown_parts, ranks_figure, scaling_figure, search_figure,
                            timeline_figure, validation_figure)

    r = rep.result
    page = Page(f"{r.model} on {r.system}: twin report")

    it = r.iteration_time_s
    page.add(f"<h1>{html.escape(r.model)} on {html.escape(r.system)}: where one iteration's time goes</h1>")
    page.add('<p class="lead">' + "<br>".join(html.escape(s) for s in rep.summary) + "</p>")
    page.add("<h2>Breakdown</h2>")
    page.add('<p class="note">Compute: the compute stream runs an op. Exposed communication: the compute stream '
             "waits for a collective of that axis (communication that overlaps compute costs nothing here). "
             "Idle: nothing runs. The parts add up to the iteration.</p>")
    page.figure("breakdown", breakdown_figure(r.breakdown_s, it))
    page.add(html_table(["where the time goes", "seconds", "share"],
                        [[k, f"{v:.4f}", f"{100 * v / it:.1f} %"] for k, v in breakdown_parts(r.breakdown_s)]
                        + [["iteration", f"{it:.4f}", "100 %"]]))
    page.add("<h2>Timeline</h2>")
    window = f"It opens on {rep.window_label}; double-click the plot to see the whole iteration. " if rep.window else ""
    page.add(f'<p class="note">{window}Each rank has one row per stream (compute, then the communication stream of '
             "each axis) and a row <b>waits</b>: one colour per axis where the compute stream waits for a "
             "collective of that axis (exposed communication, the very stretches the breakdown adds up), grey "
             "where it is idle. The black line follows the critical "
             "path: the chain of ops, each waiting on the previous, whose durations make up the iteration. "
             "Click a legend entry to hide a kind.</p>")
    page.figure("timeline", timeline_figure(r.spans, f"{r.model}, grid {r.grid_str}: {it:.3f} s per iteration",
                                             critical=rep.critical, window=rep.window, waits=r.waits))
    if r.mode == "full" and r.simulated_ranks > 1 and not rep.left_out:
        page.figure("ranks", ranks_figure(r.spans, it, r.waits))
    page.add("<h2>The network under the job</h2>")
    if rep.bandwidth:
        rows = []
        for a in AXES:
            if a in rep.bandwidth:
                rows.append([a, str(r.grid[a]), f"{rep.bandwidth[a] / 1e9:.1f}",
                             f"{100 * rep.crossing.get(a, 0.0):.0f} %",
                             f"{r.breakdown_s['exposed_comm'][a]:.4f} s"])
        page.add(html_table(["axis", "group size", "bus bandwidth per ring (GB/s)", "ring bytes leaving a dragonfly group",
                             "exposed per iteration"], rows))
    crossing = [a for a, m in rep.group_load.items() if np.nansum(m) > 0]  # the axes the heat map draws
    if crossing:
        page.add('<p class="note">Each cell: the mean load, over one iteration, of the global links from one of '
                 "the job's dragonfly groups to another, as a share of their capacity, from the bytes the axis' "
                 "rings send (minimal routes; Slingshot's adaptive routing spreads a hot pair over other groups). "
                 + ("Pick the axis with the buttons above the map.</p>" if len(crossing) > 1 else
                    f"Only the {crossing[0]} axis' rings leave a group.</p>"))
        page.figure("groups", group_traffic_figure(
            rep.group_load, rep.groups, note=f"{len(rep.groups)} of {study.system.groups} groups hold the job"))
    elif study.system.dragonfly:
        page.add(f'<p class="note">No ring leaves its dragonfly group (the job uses {len(rep.groups)} group'
                 f'{"s" if len(rep.groups) != 1 else ""}), so the global links carry none of its traffic.</p>')
    if rep.hops:
        page.add('<p class="note">The rings each axis lays on the job\'s first node: an arrow from a GPU to the '
                 "next member of its ring, or to the GPU's NIC when the next member is on another node.</p>")
        page.figure("node", node_rings_figure(study.system, rep.hops, rep.bandwidth))
    page.add("<h2>Grid search</h2>")
    if rep.candidates:
        page.add('<p class="note">Every valid grid ranked by the analytical model: compute plus the communication '
                 "it cannot hide (stacked; the bar's top is the estimate). Communication hidden behind compute "
                 "(overlapped, so it adds nothing) is drawn hatched inside the compute bar, one thin bar per axis. The best few are "
                 "simulated (diamonds); the simulated time decides, and the star marks the grid this page "
                 "simulates.</p>")
        page.figure("search", search_figure(rep.candidates, chosen=r.grid_str))
        page.add(html_table(["rank", "grid XxYxZxD", "compute (s)", "exposed comm (s)", "analytical (s)",
                             "simulated (s)", "memory (GiB)"],
                            [[str(i) + (" (chosen)" if str(c.grid) == r.grid_str else ""), str(c.grid),
                              f"{c.compute_s:.3f}", f"{c.analytical_s - c.compute_s:.3f}", f"{c.analytical_s:.3f}",
                              "-" if c.simulated_s is None else f"{c.simulated_s:.3f}",
                              f"{c.memory_bytes / 2**30:.1f}"] for i, c in enumerate(rep.candidates, 1)]))
    else:
        page.add('<p class="missing">Not ranked (a grid was given with --top 0).</p>')
    page.add("<h2>Scaling</h2>")
    if scaling:
        page.figure("scaling", scaling_figure(scaling))
    else:
        page.add('<p class="missing">No scaling study given (pass one with --scaling FILE).</p>')
    page.add("<h2>Twin against backend</h2>")
    if validation and any(run.get("per_op") for run in validation.get("runs", [])):
        page.add('<p class="lead">' + "<br>".join(html.escape(s) for s in validation.get("summary", [])) + "</p>")
        page.add('<p class="note">`twin validate RUN... --html FILE` writes the whole comparison: per grid, '
                 "per kind of op, and how to read it.</p>")
        ops = [o | {"grid": run["grid"]} for run in validation["runs"] for o in run["per_op"]]
        page.figure("validation", validation_figure(ops))
    else:
        page.add('<p class="missing">No measured run given (pass `backend run` folders with --run DIR).</p>')
    page.add(f'<p class="note">twin report; {r.simulated_ops:,} simulated ops; profile {html.escape(r.profile)}; '
             f"options {html.escape(json.dumps(r.options))}; flops: {html.escape(r.flops_convention)}.</p>")

    return page.html()


def read_scaling_points(path: str | Path) -> list[dict]:
    """The scaling points of `twin report --scaling FILE`: a JSON list of {"gpus": N, "flops_per_s": F,
    ...} objects, or an object holding that list under "points" (raises TwinError, one line)."""
    from topologies.common import TwinError

    try:
        points = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise TwinError(f"--scaling {path}: not JSON ({e})") from None
    if isinstance(points, dict):
        points = points.get("points", [])
    if not isinstance(points, list) or any(not isinstance(p, dict) or "gpus" not in p or "flops_per_s" not in p
                                           for p in points):
        raise TwinError(f"--scaling {path}: expected a list of {{\"gpus\": N, \"flops_per_s\": F}} objects")
    return points


def write_report(path: str | Path, rep: Report) -> None:
    """Write the page (atomically)."""
    from topologies.common import write_atomic
    write_atomic(path, rep.html)
