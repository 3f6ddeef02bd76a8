"""`twin simulate`, `report`, `search`, `scaling` and `sensitivity`: what an iteration costs, which
grid is best, how it scales and what the prediction hangs on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from twin.cli.common import (AutoGridOpt, FullOpt, GpusOpt, PlacementOpt, ProfileOpt, QuietOpt, SlowdownOpt,
                             StudyModelOpt, SystemOpt, console, handles_errors)
from topologies.common import TwinError, finite_json, write_atomic
from twin.program.flags import (BatchOpt, CacheOpt, ChunksOpt, FrameworkOpt, MicroOpt, ScheduleOpt, OagOpt, OarOpt, OrsOpt, RecomputeOpt, SeqOpt,
                        options_from_flags, output_file, output_folder)
from twin.present.tables import human_bytes, human_flops, table


def _parse_slowdown(text: str | None) -> dict[int, float] | None:
    """'RANK:FACTOR,RANK:FACTOR' -> {rank: factor}."""
    if not text:
        return None
    try:
        return {int(r): float(f) for r, f in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise TwinError(f"--slowdown {text!r} is not of the form RANK:FACTOR[,RANK:FACTOR...], e.g. 3:1.2") from None


def _print_result(r) -> None:
    """A simulation result as tables (seconds, PF/s, GiB)."""
    it = r.iteration_time_s
    gcol = "grid XxYxZxPxD" if r.pipeline else "grid XxYxZxD"
    head = table("system", "model", "GPUs", gcol, "batch x seq", "mode", keep=("system", "model", "GPUs", gcol))
    head.add_row(r.system, r.model, str(r.gpus), r.grid_str, f"{r.global_batch} x {r.seq_len}",
                 f"{r.mode} ({r.simulated_ranks} rank{'s' if r.simulated_ranks > 1 else ''})")
    console.print(head)
    if r.grid_choice != "given":
        console.print(f"grid {r.grid_str} chosen by {r.grid_choice}")
    for line in r.notes:
        console.print(f"note: {line}")
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
    if "bubble" in r.breakdown_s:
        rows.append(("pipeline bubble", r.breakdown_s["bubble"]))
    rows.append(("idle", r.breakdown_s["idle"]))
    for name, v in rows:
        b.add_row(name, f"{v:.4f}", f"{100 * v / it:.1f} %")
    console.print(b)
    if r.pipeline:
        console.print(pipeline_line(r))
    console.print(f"flops per iteration {r.flops_per_iteration:.4g}: {r.flops_convention}")
    if r.checkpoint:
        from twin.predict.ckptcost import describe
        console.print(describe(r.checkpoint, r.system))


def pipeline_line(r) -> str:
    """One line on a pipelined result: the schedule and the bubble against its analytic share."""
    p = r.pipeline
    P, M, V = p["stages"], p["micro_batches"], p["chunks"]
    ideal = (P - 1) / (V * M + P - 1)
    inflight = max(s["micro_batches_in_flight"] for s in p["stages_s"])
    return (f"pipeline: {P} stages, {p['schedule']} schedule" + (f" with {V} chunks per stage" if V > 1 else "")
            + f", {M} micro-batches; bubble {100 * p['bubble_share']:.1f} % of the iteration "
            f"(compute-only ideal (P-1)/(V M+P-1) = {100 * ideal:.1f} %); at most {inflight} "
            f"micro-batch{'es' if inflight > 1 else ''}{' chunks' if V > 1 else ''} in flight on a stage")


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
    schedule: ScheduleOpt = "1f1b",
    chunks: ChunksOpt = 1,
    framework: FrameworkOpt = "axonn",
    gemm_tuning: Annotated[bool, typer.Option("--gemm-tuning/--no-gemm-tuning", help="Run each GEMM in its fastest layout (NN/NT/TN).")] = True,
    profile: ProfileOpt = None,
    moe_imbalance: Annotated[float, typer.Option(help="Mixture of experts: the busiest expert's tokens over a balanced share (1 to experts/top_k); stretches its rank's expert GEMMs and all-to-alls (docs/moe.md).")] = 1.0,
    full: FullOpt = False,
    slowdown: SlowdownOpt = None,
    simulate_top: Annotated[int, typer.Option(help="With --grid auto: look at this many of the analytical best and 16 more; each is simulated unless its lower bound rules it out.")] = 2,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
    program: Annotated[Optional[Path], typer.Option(help="Simulate this program file (`twin program --json-out FILE`); it fixes model, grid, batch and switches.")] = None,
    trace: Annotated[Optional[str], typer.Option(help="Write the iteration's trace to this folder: one Chrome trace per rank (Perfetto, HTA).", callback=output_folder)] = None,
    html: Annotated[Optional[str], typer.Option(help="Write an interactive plotly timeline here.", callback=output_file)] = None,
    quiet: QuietOpt = False,
) -> None:
    """Simulate one training iteration of a model on a system and say where the time goes."""
    from twin.present.progress import Stages, quiet_default
    from twin.predict.simulate import SimulationConfig, simulate

    opts = options_from_flags(oar, ors, oag, cache_layers, recompute, micro_batches, schedule=schedule, chunks=chunks,
                              framework=framework)
    if moe_imbalance != 1.0:  # a mixture-of-experts option (twin/program/moe.py); checked against the model in prepare
        opts = replace(opts, moe_imbalance=moe_imbalance)
    if simulate_top < 1:
        raise TwinError(f"--simulate-top must be at least 1, got {simulate_top}")
    prog = None
    if program is not None:
        if model is not None or grid != "auto" or gpus is not None or batch is not None or seq is not None \
                or opts != options_from_flags():
            raise TwinError("--program fixes the model, grid, GPUs, batch, sequence length and switches: leave those "
                            "flags out")
        from twin.present.progress import load_program_shown
        prog = load_program_shown(program, quiet_default(json_out, quiet))
    plan = ([("ranking grids", 3.0)] if prog is None and grid.strip().lower() == "auto" else []) + [
        ("simulating", 1.0 + 4.0 * full)]  # a given grid is not ranked: the bar is the simulation's alone
    with Stages(plan, quiet_default(json_out, quiet)) as stage:
        config = SimulationConfig(system, model, gpus, grid, batch, seq, opts, placement=placement, profile=profile,
                                  gemm_tuning=gemm_tuning, full=full, slowdown=_parse_slowdown(slowdown),
                                  record=bool(trace or html), simulate_top=simulate_top, program=prog)
        r = simulate(config, progress=stage)
        if trace is not None or html is not None:
            stage("writing the trace and timeline")
    if trace is not None:
        from twin.program.trace import write_trace
        write_trace(trace, r.spans, metadata=r.as_dict(wall_time=False), world_size=r.gpus, waits=r.waits)
    if html is not None:
        from twin.present.plots import timeline_html
        write_atomic(html, timeline_html(r.spans, f"{r.model} on {r.system}, grid {r.grid_str}: "
                                                f"{r.iteration_time_s:.3f} s per iteration", waits=r.waits))
    if json_out:
        typer.echo(r.to_json())
        return
    _print_result(r)
    if slowdown and r.mode == "full":
        slow = list(_parse_slowdown(slowdown).items())
        named = ", ".join(f"rank {k} (compute x{v:g})" for k, v in slow[:8]) + (f" and {len(slow) - 8} more" if len(slow) > 8 else "")
        console.print("stragglers: " + named
                      + f"; every rank waits for them: {r.breakdown_s['idle'] + sum(r.breakdown_s['exposed_comm'].values()):.4f} s "
                      "of the iteration is not compute on the average rank")
    for what, path in (("trace", trace), ("timeline", html)):
        if path is not None:
            console.print(f"wrote {what} {path}")


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
    schedule: ScheduleOpt = "1f1b",
    chunks: ChunksOpt = 1,
    framework: FrameworkOpt = "axonn",
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
    from twin.present.report import build_report, read_scaling_points, write_report

    opts = options_from_flags(oar, ors, oag, cache_layers, recompute, micro_batches, schedule=schedule, chunks=chunks,
                              framework=framework)
    if top < 0 or simulate_top < 0:
        raise TwinError("--top and --simulate-top must be at least 0")
    points = None if scaling is None else read_scaling_points(scaling)
    for r in run or []:
        if not r.is_dir():
            raise TwinError(f"--run {r}: not a folder (give the --out folder of `backend run`)")
    from twin.present.progress import Stages, quiet_default
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
    framework: FrameworkOpt = "axonn",
    json_out: Annotated[bool, typer.Option("--json", help="Print the grids as a JSON list.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Rank the valid 4D grids of a model on a system (analytical model) and simulate the best; then
    the pipelined grids (stages, schedule, micro-batches) that could beat them. With --framework
    megatron: Megatron-LM's configurations (t, p, d, micro-batch, schedule; docs/megatron.md)."""
    from twin.predict.auto import search
    from twin.predict.study import prepare

    if top < 1:
        raise TwinError(f"--top must be at least 1, got {top}")
    opts = options_from_flags(framework=framework)
    study = prepare(system, model, gpus, batch, seq, options=opts, placement=placement)
    if opts.framework.startswith("megatron"):
        return _search_megatron(study, top, 3 if simulate_top < 0 else simulate_top, json_out, quiet)
    from twin.present.progress import Stages, quiet_default
    with Stages([("ranking and simulating grids", 1.0)], quiet_default(json_out, quiet)) as stage:
        stage("ranking and simulating grids")
        cands = search(study, top=top, simulate_top=top if simulate_top < 0 else simulate_top, tick=stage.part)
    if json_out:
        typer.echo(finite_json([{"grid": str(c.grid), "analytical_s": c.analytical_s, "compute_s": c.compute_s,
                                "comm_s": c.comm_s, "exposed_comm_s": c.exposed_s, "memory_per_gpu_bytes": c.memory_bytes,
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
    for line in study.notes:
        console.print(f"note: {line}")
    sims = [c for c in cands if c.simulated_s is not None]
    if sims:
        best = min(sims, key=lambda c: (c.simulated_s, str(c.grid)))
        from twin.predict.auto import BOUND_SLACK
        from twin.predict.pipe_auto import search_pipelines
        best, why = search_pipelines(study, best, BOUND_SLACK)
        console.print(f"use grid {best.grid}: the fastest simulated ({best.simulated_s:.3f} s per iteration); "
                      "the estimate ranks grids, the simulation (overlap, contention) decides" + why)
    if len(cands) > top:
        console.print(f"rows {top + 1}-{len(cands)}: beyond the {top} asked for, simulated because their lower "
                      "bound could beat the fastest simulated grid")
    if len(cands) < top:
        console.print(f"only {len(cands)} grids divide the model and fit in memory on {study.gpus} GPUs")


def _search_megatron(study, top: int, simulate_top: int, json_out: bool, quiet: bool) -> None:
    """`twin search --framework megatron`: the table of twin.predict.megatron_search."""
    from twin.predict.megatron_search import megatron_search
    from twin.present.progress import Stages, quiet_default
    with Stages([("estimating and simulating configurations", 1.0)], quiet_default(json_out, quiet)) as stage:
        stage("estimating and simulating configurations")
        cands = megatron_search(study, simulate_top=simulate_top, tick=stage.part)
    if json_out:
        typer.echo(finite_json([{"grid": str(c.grid), "micro_batch": c.micro_batch,
                                 "micro_batches": c.study.options.micro_batches, "schedule": c.study.options.schedule,
                                 "chunks": c.study.options.chunks, "estimate_s": c.estimate_s,
                                 "simulated_s": c.simulated_s} for c in cands[:top]], indent=1))
        return
    cols = ("#", "grid 1xTx1xPxD", "micro-batch", "M", "schedule", "estimate (s)", "simulated (s)")
    t = table(*cols, title=f"{study.model.name} on {study.gpus} GPUs of {study.system.name}: Megatron-LM configurations",
              keep=("#",), right=cols[2:4] + cols[5:])
    for i, c in enumerate(cands[:top], 1):
        o = c.study.options
        sched = "-" if c.grid.pipe == 1 else o.schedule + (f" x{o.chunks}" if o.chunks > 1 else "")
        t.add_row(str(i), str(c.grid), str(c.micro_batch), str(o.micro_batches), sched, f"{c.estimate_s:.3f}",
                  "-" if c.simulated_s is None else f"{c.simulated_s:.3f}")
    console.print(t)
    best = min((c for c in cands if c.simulated_s is not None), key=lambda c: c.simulated_s)
    o = best.study.options
    console.print(f"use grid {best.grid} with --framework megatron --micro-batches {o.micro_batches}"
                  + (f" --schedule {o.schedule}" if best.grid.pipe > 1 else "")
                  + (f" --chunks {o.chunks}" if o.chunks > 1 else "")
                  + f": the fastest simulated ({best.simulated_s:.3f} s); {len(cands)} configurations estimated")


@handles_errors
def scaling_cmd(
    system: SystemOpt,
    series: Annotated[str, typer.Option(help="weak (AxoNN's model table, ~9.8 M parameters per GPU) or strong (the default model on 1/8..1 of the default GPUs).")] = "weak",
    gpus: Annotated[Optional[str], typer.Option(help="Keep only these GPU counts, e.g. 512,8192,16384.")] = None,
    batch: BatchOpt = None,
    simulate_top: Annotated[int, typer.Option(help="Per point: look at this many of the analytical best grids and 16 more; each is simulated unless its lower bound rules it out.")] = 4,
    json_out: Annotated[bool, typer.Option("--json", help="Print the series as one JSON object.")] = False,
    html: Annotated[Optional[str], typer.Option(help="Write a plotly chart (percent of peak, efficiency) here.", callback=output_file)] = None,
    quiet: QuietOpt = False,
) -> None:
    """Predict a weak or strong scaling series: per point the best grid, time, flop/s, % of peak, efficiency."""
    from twin.predict.scaling import scaling, scaling_html

    if simulate_top < 1:
        raise TwinError(f"--simulate-top must be at least 1, got {simulate_top}")
    try:
        counts = [int(v) for v in gpus.split(",")] if gpus else None
    except ValueError:
        raise TwinError(f"--gpus must be comma-separated GPU counts, e.g. 512,8192; got {gpus!r}") from None
    from twin.present.progress import Steps, quiet_default
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
    moe_imbalance: Annotated[float, typer.Option(help="Mixture of experts: the base routing imbalance (the busiest expert's tokens over balanced), moved by the step as one row.")] = 1.0,
    simulate_top: Annotated[int, typer.Option(help="With --grid auto: look at this many of the analytical best and 16 more; each is simulated unless its lower bound rules it out.")] = 2,
    json_out: Annotated[bool, typer.Option("--json", help="Print the table as one JSON object.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """How the predicted iteration time moves when each system and profile parameter moves by +-10%."""
    from twin.predict.sensitivity import sensitivity

    if simulate_top < 1:
        raise TwinError(f"--simulate-top must be at least 1, got {simulate_top}")
    from twin.present.progress import Steps, quiet_default
    with Steps(quiet_default(json_out, quiet)) as steps:
        r = sensitivity(system, model, gpus, grid, batch, seq, placement=placement, step=step,
                        simulate_top=simulate_top, progress=steps,
                        options=None if moe_imbalance == 1.0 else replace(options_from_flags(), moe_imbalance=moe_imbalance))
    if json_out:
        typer.echo(r.to_json())
        return
    from twin.present.tables import sensitivity_table
    t = sensitivity_table(r)
    console.print(t)
