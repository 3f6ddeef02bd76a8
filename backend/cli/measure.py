"""`backend replay` and `bench`: execute the twin's program op by op, and time GEMMs, collectives and
training ops for calibration."""

from __future__ import annotations

import datetime
import socket
from dataclasses import asdict
from typing import Annotated, Optional

import typer

from backend.cli.common import (DeviceOpt, DtypeOpt, ProgramOpt, check_launcher_world, handles_errors, program_grid,
                                refuse_fixed)
from topologies.common import TwinError, check_output
from twin.program.flags import BatchOpt, CacheOpt, GridOpt, MicroOpt, ModelOpt, OagOpt, OarOpt, OrsOpt, RecomputeOpt
from twin.program.grid import Grid
from twin.program.model import load_model


@handles_errors
def replay_cmd(
    model: ModelOpt = "gpt-tiny",
    grid: GridOpt = "1x1x1x1",
    steps: Annotated[int, typer.Option(help="Iterations to replay (the last one is traced).")] = 2,
    batch: BatchOpt = None,
    micro_batches: MicroOpt = 1,
    oar: OarOpt = True, ors: OrsOpt = True, oag: OagOpt = True,
    cache_layers: CacheOpt = 0, recompute: RecomputeOpt = True,
    out: Annotated[str, typer.Option(help="Trace folder (one Chrome trace per rank; Perfetto and HTA read it).")] = "runs/replay-trace",
    device: DeviceOpt = "cpu",
    dtype: Annotated[str, typer.Option(help="auto (bf16 on cuda, fp32 on cpu), fp32 or bf16.")] = "auto",
    program: ProgramOpt = None,
    ctx: typer.Context = None,
) -> int:
    """Execute the twin's program op by op with random tensors (GEMMs and collectives) and trace it."""
    from backend.launch.launcher import launch
    from backend.bench.replay import ReplayConfig, validate

    refuse_fixed(ctx, program)
    cfg = ReplayConfig(model=model, steps=steps, batch=batch, micro_batches=micro_batches,
                       oar=oar, ors=ors, oag=oag, cache_layers=cache_layers, recompute=recompute,
                       out=out, device=device, dtype=dtype, program_file=program,
                       grid=program_grid(program, grid))
    g = Grid.parse(cfg.grid)
    check_launcher_world(g)
    validate(cfg)
    check_output(out, "--out", folder=True)
    return launch("replay", asdict(cfg), g.size)


def default_bench_out(device: str) -> str:
    day = datetime.date.today().isoformat()
    return f"bench-{socket.gethostname()}-{device}-{day}.json"


@handles_errors
def bench_cmd(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Also time this model's local GEMM shapes on --grid.")] = "gpt-tiny",
    grid: GridOpt = "1x1x1x1",
    squares: Annotated[str, typer.Option(help="Comma-separated sizes of square GEMMs to time.")] = "1024",
    sizes_mib: Annotated[str, typer.Option(help="Comma-separated collective payloads in MiB.")] = "0.0625,1,16",
    gemm: Annotated[bool, typer.Option(help="Time GEMMs (every rank at once).")] = True,
    comm: Annotated[bool, typer.Option(help="Time collectives over each axis of size > 1.")] = True,
    ops: Annotated[bool, typer.Option(help="Time small eager ops (per-op overhead, memory bandwidth).")] = True,
    overlap: Annotated[bool, typer.Option(help="Time a GEMM while an all-reduce runs on each axis.")] = True,
    train_steps: Annotated[int, typer.Option(help="Record this many training steps of --model on --grid: every op's cost inside training (0: none).")] = 4,
    layouts: Annotated[str, typer.Option(help="Model GEMMs in: all (NN, NT, TN) or program (the program's layout).")] = "all",
    all_grids: Annotated[bool, typer.Option(help="Model GEMM shapes of every valid grid with this many ranks.")] = False,
    batch: BatchOpt = None,
    min_time: Annotated[float, typer.Option(help="Seconds to spend timing each entry.")] = 0.2,
    out: Annotated[Optional[str], typer.Option(help="JSON table to write (default: bench-<host>-<device>-<date>.json in this folder).")] = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "fp32",
    for_twin: Annotated[bool, typer.Option("--for-twin", help="Bench what the twin needs for a study: every rank count and axis of --ranks or --grids, one file per benched grid in the folder --out (says the plan and its estimate first).")] = False,
    ranks: Annotated[Optional[str], typer.Option(help="With --for-twin: the study's rank counts, comma-separated (every valid grid of each).")] = None,
    grids: Annotated[Optional[str], typer.Option(help="With --for-twin: the study's grids, comma-separated (instead of every grid of --ranks).")] = None,
    plan_only: Annotated[bool, typer.Option("--plan-only", help="With --for-twin: print the plan and its estimate, bench nothing (--json: as JSON).")] = False,
    json_print: Annotated[bool, typer.Option("--json", help="With --plan-only: print the plan as one JSON object.")] = False,
    ctx: typer.Context = None,
) -> int:
    """Microbenchmarks: GEMM flop/s by shape and layout; collective bandwidth by size per axis."""
    from backend.launch.launcher import launch

    if for_twin or ranks or grids or plan_only or json_print:
        return _bench_for_twin(ctx, for_twin, ranks, grids)

    g = Grid.parse(grid)
    if model:
        load_model(model)
    if device not in ("cpu", "cuda") or dtype not in ("fp32", "bf16", "fp16") or layouts not in ("all", "program"):
        raise TwinError("--device must be cpu or cuda, --dtype fp32, bf16 or fp16, --layouts all or program")
    if not 0 <= train_steps <= 100:
        raise TwinError(f"--train-steps must be in 0..100, got {train_steps}")
    if min_time <= 0 or (batch is not None and batch < 1):
        raise TwinError("--min-time must be positive and --batch at least 1")
    try:
        sq = [int(s) for s in squares.split(",") if s.strip()]
        sizes = [float(s) for s in sizes_mib.split(",") if s.strip()]
    except ValueError:
        raise TwinError("--squares takes integers and --sizes-mib numbers, comma-separated") from None
    if not all(0 < n <= 65536 for n in sq) or not all(0 < m <= 65536 for m in sizes):  # also refuses nan, inf
        raise TwinError("--squares must be sizes in 1..65536 and --sizes-mib payloads in (0, 65536] MiB")
    if not min_time < 3600:
        raise TwinError(f"--min-time must be under an hour per entry, got {min_time}")
    check_launcher_world(g)
    if model:
        g.validate(load_model(model), batch=batch)
    cfg = {"model": model, "grid": grid, "squares": sq, "sizes_mib": sizes, "gemm": gemm, "comm": comm,
           "ops": ops, "overlap": overlap, "steps": train_steps if model else 0, "layouts": layouts, "all_grids": all_grids, "batch": batch,
           "min_time_s": min_time, "out": out or default_bench_out(device), "device": device, "dtype": dtype}
    check_output(cfg["out"], "--out")  # before the work, not after it
    return launch("bench", cfg, g.size)


def study_grids(model: str, ranks: str | None, grids: str | None, batch: int | None = None) -> list[Grid]:
    """The grids of a study: --grids as given, else every valid grid of each of --ranks (TwinError on bad input)."""
    from backend.bench.shapes import grids_of
    if grids:
        out = [Grid.parse(g.strip()) for g in grids.split(",") if g.strip()]
        spec = load_model(model)
        for g in out:
            g.validate(spec, gpus=g.size, batch=batch)
    else:
        try:
            counts = [int(r) for r in (ranks or "").split(",") if r.strip()]
        except ValueError:
            raise TwinError(f"--ranks takes rank counts, comma-separated (1,2,4,8), got {ranks!r}") from None
        if not counts or not all(1 <= r <= 4096 for r in counts):
            raise TwinError(f"--ranks takes rank counts in 1..4096, comma-separated (1,2,4,8), got {ranks!r}")
        out = [g for r in dict.fromkeys(counts) for g in grids_of(model, r, batch)]
    if not out:
        raise TwinError("the study has no grid: give --ranks or --grids (with a grid that runs the model)")
    return out


def _bench_for_twin(ctx, for_twin: bool, ranks: str | None, grids: str | None) -> int:
    """`backend bench --for-twin`: the study's grids, the loops' defaults where the command line left
    bench's own, then backend.bench.plan."""
    from backend.bench.plan import FOR_TWIN_DEFAULTS, bench_for_twin
    p = dict(ctx.params)
    if not for_twin:
        raise TwinError("--ranks, --grids, --plan-only and --json go with --for-twin (bench what the twin needs for a study)")
    if p["json_print"] and not p["plan_only"]:
        raise TwinError("--json goes with --plan-only (the plan as JSON)")
    if not p.get("model"):
        raise TwinError("--for-twin needs --model (the model the study trains)")
    given = {k for k in p if getattr(ctx.get_parameter_source(k), "name", "") in ("COMMANDLINE", "ENVIRONMENT")}
    if "grid" in given:
        raise TwinError("--for-twin benches the grids it plans from --ranks or --grids: leave out --grid")
    for k, v in FOR_TWIN_DEFAULTS.items():
        if k not in given:
            p[k] = v
    if not p.get("out") and not p["plan_only"]:
        raise TwinError("--for-twin writes one file per benched grid: give the folder with --out DIR")
    load_model(p["model"])
    if p["device"] not in ("cpu", "cuda") or p["dtype"] not in ("fp32", "bf16", "fp16") or p["layouts"] not in ("all", "program"):
        raise TwinError("--device must be cpu or cuda, --dtype fp32, bf16 or fp16, --layouts all or program")
    if not 0 <= p["train_steps"] <= 100 or not 0 < p["min_time"] < 3600:
        raise TwinError("--train-steps must be in 0..100 and --min-time positive, under an hour")
    try:
        sq = [int(s) for s in str(p["squares"]).split(",") if s.strip()]
        sizes = [float(s) for s in str(p["sizes_mib"]).split(",") if s.strip()]
    except ValueError:
        raise TwinError("--squares takes integers and --sizes-mib numbers, comma-separated") from None
    if not all(0 < n <= 65536 for n in sq) or not sizes or not all(0 < m <= 65536 for m in sizes):
        raise TwinError("--squares must be sizes in 1..65536 and --sizes-mib payloads in (0, 65536] MiB")
    study = study_grids(p["model"], ranks or (None if grids else "1,2,4,8"), grids, p["batch"])
    if not p["plan_only"]:
        check_output(p["out"], "--out", folder=True)
    cfg = {"model": p["model"], "squares": sq, "sizes_mib": sizes, "gemm": p["gemm"], "comm": p["comm"],
           "ops": p["ops"], "overlap": p["overlap"], "steps": p["train_steps"], "layouts": p["layouts"],
           "batch": p["batch"], "min_time_s": p["min_time"], "device": p["device"], "dtype": p["dtype"]}
    return bench_for_twin(cfg, study, p["out"] or ".", say=lambda line: typer.echo(line), plan_only=p["plan_only"],
                          as_json=p["json_print"])
