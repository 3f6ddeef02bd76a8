"""`twin sweep SWEEP.toml`: a design-space sweep (the library is twin.sweep; this only parses and prints)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from topologies.common import TwinError, check_output, write_atomic
from twin.cli.common import QuietOpt, console, handles_errors
from twin.present.tables import table
from twin.program.flags import output_file


def _text(v: str) -> str:
    """An axis value as printed: numbers in a short form (2.5e+10 rather than 25000000000.0)."""
    try:
        return v if v.isdigit() else f"{float(v):g}"
    except ValueError:
        return v


def _best(rows: list[dict], top: int) -> list[dict]:
    ok = [r for r in rows if r["status"] == "ok"]
    if ok and all(r.get("train_days") for r in ok):
        return sorted(ok, key=lambda r: float(r.get("wall_days") or r["train_days"]))[:top]
    return sorted(ok, key=lambda r: -float(r["percent_of_peak"]))[:top]


@handles_errors
def sweep_cmd(
    sweep_file: Annotated[Path, typer.Argument(help="The sweep file (.toml): lists of systems, models, GPU counts, overrides... (docs/sweeps.md).", show_default=False)],
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Results CSV, appended as points finish (default: the sweep file's name with .csv, here).", callback=output_file)] = None,
    workers: Annotated[Optional[int], typer.Option(help="Dask worker processes (default: one per core), or Slurm worker jobs with --slurm.")] = None,
    scheduler: Annotated[Optional[str], typer.Option(help="Run on this running Dask scheduler, e.g. tcp://host:8786.")] = None,
    slurm: Annotated[bool, typer.Option("--slurm", help="Start Dask workers as Slurm jobs (dask-jobqueue and its configuration).")] = False,
    serial: Annotated[bool, typer.Option("--serial", help="Run the points one by one in this process, without Dask.")] = False,
    html: Annotated[Optional[str], typer.Option(help="Write the sweep's page here: table, heat maps, Pareto front.", callback=output_file)] = None,
    top: Annotated[int, typer.Option(help="Points to print, best first.")] = 10,
    quiet: QuietOpt = False,
) -> None:
    """Predict every point of a sweep (the product of its axes) on Dask; rows go to a CSV as they finish,
    a rerun skips the finished points, Ctrl-C keeps them."""
    from twin.present.progress import Steps, quiet_default
    from twin.sweep.run import run_sweep
    from twin.sweep.results import read_rows
    from twin.sweep.spec import load_sweep

    if sum([serial, scheduler is not None, slurm]) > 1:
        raise TwinError("--serial, --scheduler and --slurm are three ways to run: choose one")
    if workers is not None and workers < 1:
        raise TwinError(f"--workers must be at least 1, got {workers}")
    sweep = load_sweep(sweep_file)
    out = out or str(check_output(Path(sweep_file).with_suffix(".csv").name, "--out"))
    with Steps(quiet_default(False, quiet)) as steps:
        run = run_sweep(sweep, out, serial=serial, workers=workers, scheduler=scheduler, slurm=slurm,
                        progress=steps, say=lambda line: typer.echo(line, err=True))
    if run.interrupted:
        typer.echo(f"interrupted: {run.skipped + run.computed} of {run.total} points are in {out}; run the same "
                   "command to go on", err=True)
        raise typer.Exit(130)
    header, rows = read_rows(out)
    if html is not None:
        from twin.sweep.page import sweep_page
        write_atomic(html, sweep_page(header, rows, sweep.name))
    keys = {p.key for p in sweep.points()}
    rows = [r for r in rows if r["key"] in keys]
    failed = sum(r["status"] != "ok" for r in rows)
    varied = sweep.varied()
    cols = [*varied, "grid", "iteration (s)", "% of peak"]
    with_days = sweep.train is not None
    if with_days:
        cols += ["days", "GPU-hours"]
        if any(r.get("wall_days") for r in rows):
            cols += ["goodput", "days w/ failures"]
    best = _best(rows, top)
    if best:
        t = table(*cols, title=f"{sweep.name}: the best {len(best)} of {len(rows) - failed} predicted points",
                  right=tuple(cols[len(varied) + 1:]))
        for r in best:
            cells = [_text(r[c]) for c in varied] + [r["grid"], f"{float(r['iteration_s']):.3f}",
                                              f"{float(r['percent_of_peak']):.1f}"]
            if with_days:
                cells += [f"{float(r['train_days']):.1f}", f"{float(r['gpu_hours']):,.0f}"]
                if "goodput" in cols:
                    cells += [f"{float(r['goodput']):.3f}" if r.get("goodput") else "-",
                              f"{float(r['wall_days']):.1f}" if r.get("wall_days") else "-"]
            t.add_row(*cells)
        console.print(t)
    now = f"{run.computed} computed now ({run.engine}, {run.wall_s:.1f} s)" if run.computed else "none computed now"
    console.print(f"{run.total} points: {run.total - failed} predicted, {failed} failed; {now}, {run.skipped} "
                  f"already in {out}")
    for r in [r for r in rows if r["status"] != "ok"][:3]:
        console.print(f"failed: {', '.join(f'{c}={_text(r[c])}' for c in varied) or r['key']}: {r['error']}")
    if html is not None:
        console.print(f"wrote {html}")
