"""The `twin` command: parses, calls the library, prints. Bad input exits 2 with one line."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Optional

import typer

from twin.common import TwinError, finite_json, write_atomic
from twin.grid import Grid
from twin.memory import GIB, check_fits, memory_per_gpu
from twin.model import list_models, load_model
from twin.flags import (BatchOpt, CacheOpt, GridOpt, MicroOpt, ModelOpt, OagOpt, OarOpt, OneLineErrors, OrsOpt,
                         RecomputeOpt, SeqOpt, options_from_flags, output_file, output_folder)
from twin.program import build_program
from twin.programfile import load_program, save_program
from twin.tables import human_bytes, human_flops, table

app = typer.Typer(cls=OneLineErrors, no_args_is_help=True, add_completion=False,
                  help="A digital twin of 4D-parallel LLM training: simulate, search, inspect.")


class _Console:
    """rich's Console, made on first use: `--json` output never needs rich (about 0.03 s to import)."""

    def __getattr__(self, name: str):
        global console
        from rich.console import Console
        console = Console()
        return getattr(console, name)


console = _Console()


def handles_errors(fn):
    """Turn a TwinError (or a missing/unreadable file) into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (TwinError, OSError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None

    return wrapper


QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar on stderr.")]
SystemOpt = Annotated[str, typer.Option("--system", "-s", help="System name (see `twin systems`) or a system .toml file.")]
StudyModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Model name or .toml file (default: the system's default study).")]
GpusOpt = Annotated[Optional[int], typer.Option(help="GPU count (default: the system's default study).")]
PlacementOpt = Annotated[str, typer.Option(help="Rank placement: contiguous or scattered nodes.")]
AutoGridOpt = Annotated[str, typer.Option("--grid", "-g", help="4D grid XxYxZxD, or auto (analytical ranking, best few simulated).")]
ProfileOpt = Annotated[Optional[str], typer.Option(help="Kernel profile name or .toml (default: by the system's GPU).")]
FullOpt = Annotated[bool, typer.Option("--full", help="Simulate every rank (default: one representative).")]
SlowdownOpt = Annotated[Optional[str], typer.Option(help="Stragglers for --full: RANK:FACTOR[,...] on compute times.")]


def _count(n: float) -> str:
    """A parameter count in B or M (gpt-tiny has 0.1 M, not "0.00 B")."""
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


@app.command("models")
@handles_errors
def models_cmd() -> None:
    """List the models that ship with the twin."""
    cols = ("model", "layers", "hidden", "heads", "vocab", "seq", "batch", "parameters")
    t = table(*cols, keep=cols, right=cols[1:])
    for name in list_models():
        m = load_model(name)
        t.add_row(name, str(m.layers), str(m.hidden), str(m.heads), str(m.vocab), str(m.seq_len),
                      str(m.global_batch), _count(m.parameters()))
    console.print(t)


@app.command("program")
@handles_errors
def program_cmd(
    model: ModelOpt = "gpt-5b",
    grid: GridOpt = "2x2x2x64",
    gpus: Annotated[Optional[int], typer.Option(help="GPU count; must equal the grid's product.")] = None,
    batch: BatchOpt = None,
    seq: SeqOpt = None,
    oar: OarOpt = True,
    ors: OrsOpt = True,
    oag: OagOpt = True,
    cache_layers: CacheOpt = 0,
    recompute: RecomputeOpt = True,
    micro_batches: MicroOpt = 1,
    hbm_gib: Annotated[Optional[float], typer.Option(help="GPU memory (GiB) to check the fit against; off by default.")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the whole program (every op) as JSON here.", callback=output_file)] = None,
) -> None:
    """Build the schedule of one iteration for one rank and print its summary."""
    spec = load_model(model)
    g = Grid.parse(grid)
    opts = options_from_flags(oar, ors, oag, cache_layers, recompute, micro_batches)
    g.validate(spec, gpus=gpus, batch=batch, micro_batches=micro_batches, seq_len=seq)
    mem = memory_per_gpu(spec, g, opts, batch, seq)
    if hbm_gib is not None:
        if not 0 < hbm_gib < 1e9:  # also refuses nan and inf
            raise TwinError(f"--hbm-gib must be a positive number of GiB, got {hbm_gib}")
        check_fits(mem, hbm_gib * GIB, f"{spec.name} on grid {g} ")
    prog = build_program(spec, g, opts, batch, seq)
    if json_out is not None:
        save_program(prog, json_out)
    s = prog.summary()
    console.print(f"[bold]{spec.name}[/] on grid {g} ({g.size} GPUs), batch {s['global_batch']} x "
                  f"{s['seq_len']} tokens, padded vocabulary {s['padded_vocab']}")
    kinds = table("kind", "ops", title="ops by kind", right=("ops",))
    for k, n in s["ops_by_kind"].items():
        kinds.add_row(k, str(n))
    console.print(kinds)
    axes = table("axis", "group size", "payload", "on the wire per rank", title="communication per rank (ring volumes)",
                 right=("group size", "payload", "on the wire per rank"))
    for a, v in s["wire_bytes_per_axis"].items():
        axes.add_row(a, str(g.axis_size(a)), human_bytes(s['payload_bytes_per_axis'][a]), human_bytes(v))
    console.print(axes)
    console.print(f"flops per rank {s['flops_per_rank']:.4g}; model flops {s['model_flops']:.4g} "
                  f"(GEMM+attention {s['matmul_flops']:.4g}, reference formula {s['reference_flops']:.4g})")
    console.print(f"memory per GPU {human_bytes(mem.total)}: " + ", ".join(
        f"{k} {human_bytes(v)}" for k, v in mem.as_dict().items() if k != "total"))
    if json_out is not None:
        console.print(f"wrote {json_out}")


def _parse_slowdown(text: str | None) -> dict[int, float] | None:
    """'RANK:FACTOR,RANK:FACTOR' -> {rank: factor}."""
    if not text:
        return None
    try:
        return {int(r): float(f) for r, f in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise TwinError(f"--slowdown {text!r} is not of the form RANK:FACTOR[,RANK:FACTOR...], e.g. 3:1.2") from None


def _print_result(r) -> None:
    """A simulation result as rich tables (seconds, PF/s, GiB)."""
    it = r.iteration_time_s
    head = table("system", "model", "GPUs", "grid XxYxZxD", "batch x seq", "mode",
                 keep=("system", "model", "GPUs", "grid XxYxZxD"))
    head.add_row(r.system, r.model, str(r.gpus), r.grid_str, f"{r.global_batch} x {r.seq_len}",
                 f"{r.mode} ({r.simulated_ranks} rank{'s' if r.simulated_ranks > 1 else ''})")
    console.print(head)
    if r.grid_choice != "given":
        console.print(f"grid {r.grid_str} chosen by {r.grid_choice}")
    t = table("", "value", title="one iteration", keep=("", "value"))
    t.add_row("iteration time", f"{it:.4f} s")
    t.add_row("flop/s (all GPUs)", human_flops(r.flops_per_s))
    t.add_row("flop/s per GPU", human_flops(r.flops_per_s_per_gpu))
    t.add_row("of advertised peak", f"{r.percent_of_peak:.1f} %")
    t.add_row("memory per GPU", human_bytes(r.memory_per_gpu_bytes))
    t.add_row("simulated ops", f"{r.simulated_ops:,}")
    t.add_row("wall time", f"{r.wall_time_s:.2f} s")
    console.print(t)
    b = table("where the time goes", "seconds", "share", title="breakdown (adds up to the iteration)",
              keep=("where the time goes", "seconds", "share"), right=("seconds", "share"))
    rows = [("compute", r.breakdown_s["compute"])]
    rows += [(f"exposed comm {a}", v) for a, v in r.breakdown_s["exposed_comm"].items()]
    rows.append(("idle", r.breakdown_s["idle"]))
    for name, v in rows:
        b.add_row(name, f"{v:.4f}", f"{100 * v / it:.1f} %")
    console.print(b)
    console.print(f"flops per iteration {r.flops_per_iteration:.4g}: {r.flops_convention}")


@app.command("simulate")
@handles_errors
def simulate_cmd(
    system: SystemOpt,
    model: StudyModelOpt = None,
    gpus: GpusOpt = None,
    grid: AutoGridOpt = "auto",
    batch: BatchOpt = None,
    seq: SeqOpt = None,
    placement: PlacementOpt = "contiguous",
    oar: OarOpt = True,
    ors: OrsOpt = True,
    oag: OagOpt = True,
    cache_layers: CacheOpt = 0,
    recompute: RecomputeOpt = True,
    micro_batches: MicroOpt = 1,
    gemm_tuning: Annotated[bool, typer.Option("--gemm-tuning/--no-gemm-tuning", help="Run each GEMM in its fastest layout (NN/NT/TN).")] = True,
    profile: ProfileOpt = None,
    full: FullOpt = False,
    slowdown: SlowdownOpt = None,
    simulate_top: Annotated[int, typer.Option(help="With --grid auto: simulate this many of the analytical best.")] = 2,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
    program: Annotated[Optional[Path], typer.Option(help="Simulate this program file (`twin program --json`); it fixes model, grid, batch and switches.")] = None,
    trace: Annotated[Optional[str], typer.Option(help="Write the iteration's trace to this folder: one Chrome trace per rank (Perfetto, HTA).", callback=output_folder)] = None,
    html: Annotated[Optional[str], typer.Option(help="Write an interactive plotly timeline here.", callback=output_file)] = None,
    quiet: QuietOpt = False,
) -> None:
    """Simulate one training iteration of a model on a system and say where the time goes."""
    from twin.progress import Stages, quiet_default
    from twin.simulate import simulate

    opts = options_from_flags(oar, ors, oag, cache_layers, recompute, micro_batches)
    if simulate_top < 1:
        raise TwinError(f"--simulate-top must be at least 1, got {simulate_top}")
    prog = None
    if program is not None:
        if model is not None or grid != "auto" or gpus is not None or batch is not None or seq is not None:
            raise TwinError("--program fixes the model, grid, GPUs, batch and sequence length: leave those flags out")
        prog = load_program(program)
    with Stages([("ranking grids", 3.0), ("simulating", 1.0 + 4.0 * full)], quiet_default(json_out, quiet)) as stage:
        r = simulate(system, model, gpus, grid, batch, seq, opts, placement=placement, full=full,
                     slowdown=_parse_slowdown(slowdown), gemm_tuning=gemm_tuning, profile=profile,
                     record=bool(trace or html), simulate_top=simulate_top, program=prog, progress=stage)
        if trace is not None or html is not None:
            stage("writing the trace and timeline")
    if trace is not None:
        from twin.trace import write_trace
        write_trace(trace, r.spans, metadata=r.as_dict(wall_time=False), world_size=r.gpus)
    if html is not None:
        from twin.plots import timeline_html
        write_atomic(html, timeline_html(r.spans, f"{r.model} on {r.system}, grid {r.grid_str}: "
                                                f"{r.iteration_time_s:.3f} s per iteration"))
    if json_out:
        typer.echo(r.to_json())
        return
    _print_result(r)
    if slowdown and r.mode == "full":
        console.print("stragglers: " + ", ".join(f"rank {k} (compute x{v:g})" for k, v in _parse_slowdown(slowdown).items())
                      + f"; every rank waits for them: {r.breakdown_s['idle'] + sum(r.breakdown_s['exposed_comm'].values()):.4f} s "
                      "of the iteration is not compute on the average rank")
    for what, path in (("trace", trace), ("timeline", html)):
        if path is not None:
            console.print(f"wrote {what} {path}")


@app.command("report")
@handles_errors
def report_cmd(
    system: SystemOpt,
    model: StudyModelOpt = None,
    gpus: GpusOpt = None,
    grid: AutoGridOpt = "auto",
    batch: BatchOpt = None,
    seq: SeqOpt = None,
    placement: PlacementOpt = "contiguous",
    oar: OarOpt = True,
    ors: OrsOpt = True,
    oag: OagOpt = True,
    cache_layers: CacheOpt = 0,
    recompute: RecomputeOpt = True,
    micro_batches: MicroOpt = 1,
    profile: ProfileOpt = None,
    full: FullOpt = False,
    slowdown: SlowdownOpt = None,
    top: Annotated[int, typer.Option(help="Grids to rank for the search section (0 with a given grid: skip it).")] = 8,
    simulate_top: Annotated[int, typer.Option(help="How many of the ranked grids to simulate.")] = 2,
    run: Annotated[Optional[list[Path]], typer.Option(help="A `backend run --out` folder to validate the twin against (repeatable).")] = None,
    scaling: Annotated[Optional[Path], typer.Option(help="A JSON list of scaling points {gpus, flops_per_s, ...} to draw.")] = None,
    out: Annotated[str, typer.Option("--out", "-o", help="The HTML page to write.", callback=output_file)] = "report.html",
    quiet: QuietOpt = False,
) -> None:
    """One self-contained page: where an iteration's time goes and why (breakdown, timeline with
    exposed communication and the critical path, traffic between dragonfly groups, the job's rings,
    the grid search, scaling and validation when given)."""
    import json

    from twin.report import build_report, write_report

    opts = options_from_flags(oar, ors, oag, cache_layers, recompute, micro_batches)
    if top < 0 or simulate_top < 0:
        raise TwinError("--top and --simulate-top must be at least 0")
    points = None
    if scaling is not None:
        try:
            points = json.loads(scaling.read_text())
        except json.JSONDecodeError as e:
            raise TwinError(f"--scaling {scaling}: not JSON ({e})") from None
        if isinstance(points, dict):
            points = points.get("points", [])
        if not isinstance(points, list) or any(not isinstance(p, dict) or "gpus" not in p or "flops_per_s" not in p
                                               for p in points):
            raise TwinError(f"--scaling {scaling}: expected a list of {{\"gpus\": N, \"flops_per_s\": F}} objects")
    for r in run or []:
        if not r.is_dir():
            raise TwinError(f"--run {r}: not a folder (give the --out folder of `backend run`)")
    from twin.progress import Stages, quiet_default
    plan = [("ranking grids", 3.0), ("simulating", 1.0 + 4.0 * full), ("tracing", 0.2), ("measuring", 0.5),
            ("validating", 1.0), ("drawing", 0.3)]
    with Stages(plan, quiet_default(False, quiet)) as stage:
        rep = build_report(system, model, gpus, grid, batch, seq, opts, placement=placement, full=full,
                           slowdown=_parse_slowdown(slowdown), profile=profile, top=top, simulate_top=simulate_top,
                           runs=run, scaling=points, progress=stage)
    write_report(out, rep)
    for line in rep.summary:
        console.print(line)
    console.print(f"wrote {out}")


@app.command("search")
@handles_errors
def search_cmd(
    system: SystemOpt,
    model: StudyModelOpt = None,
    gpus: GpusOpt = None,
    top: Annotated[int, typer.Option(help="How many grids to print.")] = 10,
    simulate_top: Annotated[int, typer.Option(help="How many of the best to simulate (default: all printed).")] = -1,
    batch: BatchOpt = None,
    seq: SeqOpt = None,
    placement: PlacementOpt = "contiguous",
    json_out: Annotated[bool, typer.Option("--json", help="Print the grids as a JSON list.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Rank the valid 4D grids of a model on a system (analytical model) and simulate the best."""
    from twin.simulate import search
    from twin.study import prepare

    if top < 1:
        raise TwinError(f"--top must be at least 1, got {top}")
    study = prepare(system, model, gpus, batch, seq, placement=placement)
    from twin.progress import Stages, quiet_default
    with Stages([("ranking and simulating grids", 1.0)], quiet_default(json_out, quiet)) as stage:
        stage("ranking and simulating grids")
        cands = search(study, top=top, simulate_top=top if simulate_top < 0 else simulate_top)
    if json_out:
        typer.echo(finite_json([{"grid": str(c.grid), "analytical_s": c.analytical_s, "compute_s": c.compute_s,
                                "comm_s": c.comm_s, "memory_per_gpu_bytes": c.memory_bytes,
                                "simulated_s": c.simulated_s} for c in cands], indent=1))
        return
    cols = ("#", "grid XxYxZxD", "estimate (s)", "compute (s)", "comm x/y/z/data (s)", "simulated (s)", "memory")
    t = table(*cols, title=f"{study.model.name} on {study.gpus} GPUs of {study.system.name}: best grids",
              keep=("#", "memory"), right=cols[2:])
    for i, c in enumerate(cands, 1):
        if i == top + 1:
            t.add_section()  # the rows below are beyond --top (see the line after the table)
        t.add_row(str(i), str(c.grid), f"{c.analytical_s:.3f}", f"{c.compute_s:.3f}",
                  "/".join(f"{c.comm_s[a]:.2f}" for a in ("x", "y", "z", "data")),
                  "-" if c.simulated_s is None else f"{c.simulated_s:.3f}", human_bytes(c.memory_bytes))
    console.print(t)
    sims = [c for c in cands if c.simulated_s is not None]
    if sims:
        best = min(sims, key=lambda c: (c.simulated_s, str(c.grid)))
        console.print(f"use grid {best.grid}: the fastest simulated ({best.simulated_s:.3f} s per iteration); "
                      "the estimate ranks grids, the simulation (overlap, contention) decides")
    if len(cands) > top:
        console.print(f"rows {top + 1}-{len(cands)}: beyond the {top} asked for, simulated because their lower "
                      "bound could beat the fastest simulated grid")
    if len(cands) < top:
        console.print(f"only {len(cands)} grids divide the model and fit in memory on {study.gpus} GPUs")


@app.command("systems")
@handles_errors
def systems_cmd() -> None:
    """List the systems with their key figures."""
    from topologies.system import list_systems, load_system
    t = table("system", "GPU", "bf16 TF/s", "HBM GiB", "nodes x GPUs", "NICs x GB/s", "groups x links", "default study",
              title="systems (per GPU; GB/s per direction; groups x global links per group pair)",
              keep=("system", "bf16 TF/s", "HBM GiB", "nodes x GPUs", "NICs x GB/s", "groups x links"),
              right=("bf16 TF/s", "HBM GiB"))
    for name in list_systems():
        s = load_system(name)
        df = s.dragonfly
        t.add_row(name, s.gpu.name, f"{s.gpu.peak_flops / 1e12:.4g}", f"{s.gpu.hbm_bytes / 2**30:.3g}",
                  f"{s.nodes} x {s.gpus_per_node}", f"{s.nics_per_node} x {s.nic_bandwidth / 1e9:.0f}",
                  f"{df.groups} x {df.global_links_per_pair}" if df else "-",
                  f"{s.default_model} on {s.default_gpus}")
    console.print(t)


@app.command("topology")
@handles_errors
def topology_cmd(
    system: SystemOpt = "frontier",
    html: Annotated[Optional[str], typer.Option("--html", help="Write the dragonfly and node fabric as one HTML file here.", callback=output_file)] = None,
    gpus: Annotated[Optional[int], typer.Option(help="Place a job of this many GPUs (default: the system's default study).")] = None,
    placement: PlacementOpt = "contiguous",
    seed: Annotated[int, typer.Option(help="Seed of the scattered placement.")] = 0,
    grid: Annotated[Optional[str], typer.Option("--grid", "-g", help="Also print the ring bandwidth each axis of this 4D grid gets (all its groups at once).")] = None,
) -> None:
    """Build a system's network, place a job on it, print a summary and optionally draw it."""
    import time

    from topologies.network import build_network
    from topologies.placement import place
    from topologies.system import load_system
    s = load_system(system)
    g = Grid.parse(grid) if grid is not None else None
    if g is not None and gpus is not None and g.size != gpus:
        raise TwinError(f"grid {g} has {g.size} GPUs but --gpus is {gpus}: make G_x*G_y*G_z*G_data equal the GPU count")
    job = place(s, g.size if g is not None else s.default_gpus if gpus is None else gpus, placement, seed)
    t0 = time.perf_counter()
    net = build_network(s)
    dt = time.perf_counter() - t0
    info = net.summary()
    console.print(f"[bold]{s.name}[/]: {s.description}")
    console.print(f"network built in {dt:.3f} s: {info['groups']} groups, {info['nodes']} nodes, {info['gpus']} GPUs, "
                  f"{info['nics']} NICs, {info['switches']} switches, {info['links']} directed links")
    links = table("link kind", "links", "GB/s per direction", keep=("link kind", "links"), right=("links",))
    for kind, n in info["links_by_kind"].items():
        if n:
            cap = net.capacity[net.kind == list(info["links_by_kind"]).index(kind)]
            links.add_row(kind, str(n), f"{cap.min() / 1e9:.0f}" + ("" if cap.min() == cap.max() else f"-{cap.max() / 1e9:.0f}"))
    console.print(links)
    console.print(f"job of {job.ranks} GPUs ({placement}): {len(job.nodes)} nodes in "
                  f"{len(job.groups_used())} of {s.groups} groups")
    if g is not None:
        from twin.collectives import CollectiveModel
        cm = CollectiveModel(s, g, placement=placement, seed=seed)
        cols = ("axis", "group size", "rank stride", "bus GB/s", "GB/s with all axes at once")
        axes = table(*cols, title=f"ring bandwidth per axis of grid {g} (every group of the axis at once)",
                     right=cols[1:])
        others = frozenset(a for a in ("x", "y", "z", "data") if g.axis_size(a) > 1)
        for a in ("x", "y", "z", "data"):
            if g.axis_size(a) > 1:
                axes.add_row(a, str(g.axis_size(a)), str(g.stride(a)), f"{cm.effective_bandwidth(a) / 1e9:.1f}",
                             f"{cm.effective_bandwidth(a, others - {a}) / 1e9:.1f}")
        console.print(axes)
    if html is not None:
        from topologies.draw import topology_figure
        write_atomic(html, topology_figure(net, job).to_html(include_plotlyjs=True))
        console.print(f"wrote {html}")


@app.command("calibrate")
@handles_errors
def calibrate_cmd(
    measurements: Annotated[list[str], typer.Argument(help="Measurement files of `backend bench` (JSON).")],
    out: Annotated[str, typer.Option(help="Profile to write: calibration/profiles/NAME.toml.", callback=output_file)],
    base: Annotated[Optional[str], typer.Option(help="Profile (name or .toml) for what bench does not measure (default: calibration/base/cpu.toml).")] = None,
) -> None:
    """Fit a kernel profile to `backend bench` measurements and print the fit's residuals."""
    from calibration.fit import calibrate
    fit = calibrate([str(m) for m in measurements], out, base)
    t = table("fit", "points", "median |residual|", "worst |residual|", right=("points", "median |residual|", "worst |residual|"),
              title=f"residuals of the fits (rank counts {', '.join(map(str, fit.ranks))})")
    for r in fit.residuals:
        t.add_row(r.what, str(r.points), f"{100 * r.median:.1f} %", f"{100 * r.worst:.1f} %")
    console.print(t)
    console.print(f"wrote {out}")


@app.command("validate")
@handles_errors
def validate_cmd(
    run_dirs: Annotated[list[str], typer.Argument(help="Directories written by `backend run --out DIR`.")],
    system: SystemOpt = "cpu",
    profile: ProfileOpt = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the whole report (every op) as JSON here.", callback=output_file)] = None,
    html: Annotated[Optional[str], typer.Option(help="Write a plotly scatter of predicted vs measured per op here.", callback=output_file)] = None,
    quiet: QuietOpt = False,
) -> None:
    """Simulate what `backend run` ran and compare: iteration, per op by kind, memory, grid ranking."""
    import json

    from calibration.validate import scatter_html, validate_runs
    from twin.progress import Steps, quiet_default
    with Steps(quiet_default(False, quiet)) as steps:
        rep = validate_runs([str(d) for d in run_dirs], system, profile, progress=steps)
    cols = ("grid", "iteration measured (s)", "predicted (s)", "error", "per-op median |err|", "compute ops |err|",
            "memory measured (MiB)", "predicted (MiB)")
    t = table(*cols, title="twin vs backend", keep=("grid",), right=cols[1:])
    for r in rep["runs"]:
        it, ops, mem = r["iteration"], r["ops"], r["memory"]
        pct = (lambda v: "-" if v is None else f"{100 * v:.0f} %")  # noqa: E731
        t.add_row(r["grid"], f"{it['measured_s']:.4f}", f"{it['predicted_s']:.4f}", f"{100 * it['error']:+.0f} %",
                  pct(ops["median_abs_error"]), pct(ops["compute_median_abs_error"]),
                  "-" if mem["measured_bytes"] is None else f"{mem['measured_bytes'] / 2**20:.1f}",
                  f"{mem['predicted_bytes'] / 2**20:.1f}")
    console.print(t)
    if rep["spearman"] is not None:
        console.print(f"grid ranking: Spearman {rep['spearman']:.2f} over {len(rep['runs'])} runs")
    if json_out is not None:
        write_atomic(json_out, json.dumps(rep, indent=1))
        console.print(f"wrote {json_out}")
    if html is not None:
        write_atomic(html, scatter_html(rep))
        console.print(f"wrote {html}")


@app.command("scaling")
@handles_errors
def scaling_cmd(
    system: SystemOpt,
    series: Annotated[str, typer.Option(help="weak (AxoNN's model table, ~9.8 M parameters per GPU) or strong (the default model on 1/8..1 of the default GPUs).")] = "weak",
    gpus: Annotated[Optional[str], typer.Option(help="Keep only these GPU counts, e.g. 512,8192,16384.")] = None,
    batch: BatchOpt = None,
    simulate_top: Annotated[int, typer.Option(help="Per point: simulate this many of the analytical best grids.")] = 4,
    json_out: Annotated[bool, typer.Option("--json", help="Print the series as one JSON object.")] = False,
    html: Annotated[Optional[str], typer.Option(help="Write a plotly chart (percent of peak, efficiency) here.", callback=output_file)] = None,
    quiet: QuietOpt = False,
) -> None:
    """Predict a weak or strong scaling series: per point the best grid, time, flop/s, % of peak, efficiency."""
    from twin.scaling import scaling, scaling_html

    if simulate_top < 1:
        raise TwinError(f"--simulate-top must be at least 1, got {simulate_top}")
    try:
        counts = [int(v) for v in gpus.split(",")] if gpus else None
    except ValueError:
        raise TwinError(f"--gpus must be comma-separated GPU counts, e.g. 512,8192; got {gpus!r}") from None
    from twin.progress import Steps, quiet_default
    with Steps(quiet_default(json_out, quiet)) as steps:
        r = scaling(system, series, batch=batch, simulate_top=simulate_top, gpus=counts, progress=steps)
    if html is not None:
        write_atomic(html, scaling_html(r))
    if json_out:
        typer.echo(r.to_json())
        return
    cols = ("model", "GPUs", "batch", "grid", "iteration (s)", "flop/s", "% of peak", "efficiency %")
    t = table(*cols, title=f"{r.series} scaling on {r.system} (efficiency: flop/s per GPU against the first point)",
              keep=("model", "GPUs", "batch", "grid", "flop/s"), right=("GPUs", "batch", "iteration (s)", "flop/s", "% of peak",
                                                              "efficiency %"))
    for p in r.points:
        t.add_row(p.model, str(p.gpus), str(p.batch), p.grid, f"{p.iteration_s:.3f}", human_flops(p.flops_per_s),
                  f"{p.percent_of_peak:.1f}", f"{p.efficiency:.1f}")
    console.print(t)
    for why in r.skipped:
        console.print(f"left out: {why}")
    if html is not None:
        console.print(f"wrote {html}")


@app.command("sensitivity")
@handles_errors
def sensitivity_cmd(
    system: SystemOpt,
    model: StudyModelOpt = None,
    gpus: GpusOpt = None,
    grid: Annotated[str, typer.Option("--grid", "-g", help="4D grid XxYxZxD, or auto (chosen once, then kept).")] = "auto",
    batch: BatchOpt = None,
    seq: SeqOpt = None,
    placement: PlacementOpt = "contiguous",
    step: Annotated[float, typer.Option(help="Relative move of each parameter (0.1 = +-10%).")] = 0.1,
    simulate_top: Annotated[int, typer.Option(help="With --grid auto: simulate this many of the analytical best.")] = 2,
    json_out: Annotated[bool, typer.Option("--json", help="Print the table as one JSON object.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """How the predicted iteration time moves when each system and profile parameter moves by +-10%."""
    from twin.sensitivity import sensitivity

    if simulate_top < 1:
        raise TwinError(f"--simulate-top must be at least 1, got {simulate_top}")
    from twin.progress import Steps, quiet_default
    with Steps(quiet_default(json_out, quiet)) as steps:
        r = sensitivity(system, model, gpus, grid, batch, seq, placement=placement, step=step,
                        simulate_top=simulate_top, progress=steps)
    if json_out:
        typer.echo(r.to_json())
        return
    cols = ("parameter", "value", "low / high", "time at low", "time at high")
    t = table(*cols, title=f"{r.model} on {r.gpus} GPUs of {r.system}, grid {r.grid}, batch {r.batch}: "
                           f"{r.base_s:.3f} s per iteration, and how it changes (profile.*: kernel profile; others: system file)",
              keep=("parameter", "time at low", "time at high"), right=("time at low", "time at high"))
    for row in r.rows:
        t.add_row(row.parameter, row.base, f"{row.low} / {row.high}" if row.high else row.low,
                  "-" if row.low_pct is None else f"{row.low_pct:+.1f} %",
                  "-" if row.high_pct is None else f"{row.high_pct:+.1f} %")
    console.print(t)


if __name__ == "__main__":
    app()
