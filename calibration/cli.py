"""`twin calibrate` and `twin validate`: fit a kernel profile to `backend bench` measurements, and check the
twin against what `backend run` measured.

The twin does not import this package: these two commands plug into the `twin` app through the
entry-point group "twin.commands" (pyproject.toml), which twin.cli.main reads. They keep their heavy
imports (the fit, the validation) inside the functions, so that listing them costs nothing.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from topologies.common import finite_json, write_atomic
from twin.cli.common import ProfileOpt, QuietOpt, SystemOpt, console, handles_errors
from twin.present.tables import table
from twin.program.flags import output_file


@handles_errors
def calibrate_cmd(
    measurements: Annotated[Optional[list[str]], typer.Argument(help="Measurement files of `backend bench` (JSON); none with --run.")] = None,
    out: Annotated[Optional[str], typer.Option(help="Profile to write: twin/profiles/NAME.toml.", callback=output_file)] = None,
    base: Annotated[Optional[str], typer.Option(help="Profile (name or .toml) for what bench does not measure (default: calibration/base/cpu.toml).")] = None,
    run: Annotated[bool, typer.Option("--run", help="The whole loop: bench what --grids (or --ranks) need, fit --out, run every grid --repeats times, validate, write WORK/report.html.")] = False,
    model: Annotated[str, typer.Option(help="With --run: the model to bench, run and validate.")] = "gpt-small",
    grids: Annotated[Optional[str], typer.Option(help="With --run: the grids to run and validate, comma-separated (default: every grid of --ranks).")] = None,
    ranks: Annotated[Optional[str], typer.Option(help="With --run: rank counts whose every valid grid is run, comma-separated (default 1,2,4,8).")] = None,
    work: Annotated[Optional[str], typer.Option(help="With --run: folder for the bench files, runs and report (default: next to --out, NAME-loop/).")] = None,
    steps: Annotated[int, typer.Option(help="With --run: training steps per run (the first two are left out).")] = 6,
    repeats: Annotated[int, typer.Option(help="With --run: runs per grid, in interleaved passes (their median counts).")] = 3,
    bench_passes: Annotated[int, typer.Option(help="With --run: bench passes, spread among the run passes.")] = 1,
    min_time: Annotated[float, typer.Option(help="With --run: seconds per benchmark entry.")] = 0.1,
    train_steps: Annotated[int, typer.Option(help="With --run: recorded training steps per benched grid.")] = 4,
    device: Annotated[str, typer.Option(help="With --run: cpu (gloo) or cuda (NCCL).")] = "cpu",
    system: SystemOpt = "cpu",
) -> None:
    """Fit a kernel profile to `backend bench` measurements and print the fit's residuals; with --run,
    the whole loop (bench, fit, run, validate) in one command."""
    from topologies.common import TwinError
    if run:
        if measurements:
            raise TwinError("--run benches its own measurements: leave out the measurement files")
        if out is None:
            raise TwinError("--run needs --out NAME.toml (the profile it fits)")
        from pathlib import Path
        from calibration.loop import LoopConfig, figures_line, issue_line, kinds_line, run_loop, summary_line
        cfg = LoopConfig(model=model, out=out, work=work or str(Path(out).with_suffix("")) + "-loop", grids=grids,
                         ranks=ranks, steps=steps, repeats=repeats, bench_passes=bench_passes, min_time=min_time,
                         train_steps=train_steps, device=device, system=system, base=base)
        rep = run_loop(cfg, say=lambda line: typer.echo(line))
        print_validation(rep)
        for line in (summary_line("all grids", rep["runs"]), kinds_line(rep["runs"]), issue_line(rep["runs"]),
                     figures_line(rep)):
            typer.echo(line)
        console.print(f"wrote {cfg.out}, {cfg.work}/report.json and {cfg.work}/report.html")
        return
    if not measurements or out is None:
        raise TwinError("twin calibrate needs measurement files and --out NAME.toml (or --run for the whole loop)")
    given = {k for k, v in (("--model", model != "gpt-small"), ("--grids", grids), ("--ranks", ranks), ("--work", work),
                            ("--steps", steps != 6), ("--repeats", repeats != 3), ("--bench-passes", bench_passes != 1),
                            ("--min-time", min_time != 0.1), ("--train-steps", train_steps != 4),
                            ("--device", device != "cpu")) if v}
    if given:
        raise TwinError(f"{', '.join(sorted(given))} go with --run (the whole loop)")
    from calibration.fit import calibrate
    fit = calibrate([str(m) for m in measurements], out, base)
    t = table("fit", "points", "median |residual|", "worst |residual|", right=("points", "median |residual|", "worst |residual|"),
              title=f"residuals of the fits (rank counts {', '.join(map(str, fit.ranks))})")
    for r in fit.residuals:
        t.add_row(r.what, str(r.points), f"{100 * r.median:.1f} %", f"{100 * r.worst:.1f} %")
    console.print(t)
    console.print(f"wrote {out}")


@handles_errors
def validate_cmd(
    run_dirs: Annotated[list[str], typer.Argument(help="Directories written by `backend run --out DIR`.")],
    system: SystemOpt = "cpu",
    profile: ProfileOpt = None,
    json_print: Annotated[bool, typer.Option("--json", help="Print the whole report (every op) as JSON instead of the table.")] = False,
    json_out: Annotated[Optional[str], typer.Option("--json-out", help="Write the whole report (every op) as JSON to this file.", callback=output_file)] = None,
    html: Annotated[Optional[str], typer.Option(help="Write the report as one page here: summary, tables per grid and per kind, scatters per grid and per op.", callback=output_file)] = None,
    quiet: QuietOpt = False,
) -> None:
    """Simulate what `backend run` ran and compare: iteration, per op by kind, memory, grid ranking."""

    from calibration.validate import validate_runs
    from calibration.validate_page import validation_html
    from twin.present.progress import Steps, quiet_default
    with Steps(quiet_default(json_print, quiet)) as steps:
        rep = validate_runs([str(d) for d in run_dirs], system, profile, progress=steps)
    if json_print:
        if json_out is not None:
            write_atomic(json_out, finite_json(rep, indent=1))
        if html is not None:
            write_atomic(html, validation_html(rep))
        typer.echo(finite_json(rep, indent=1))
        return
    print_validation(rep)
    if json_out is not None:
        write_atomic(json_out, finite_json(rep, indent=1))
        console.print(f"wrote {json_out}")
    if html is not None:
        write_atomic(html, validation_html(rep))
        console.print(f"wrote {html}")


def print_validation(rep: dict) -> None:
    """The table of a validation report, its grid ranking, the runs' noise and its notes."""
    cols = ("grid", "iteration measured (s)", "predicted (s)", "error", "spread (runs)", "per-op median |err|",
            "compute |err|", "memory (MiB)", "predicted (MiB)")
    t = table(*cols, title="twin vs backend (a grid's runs: their median, spread max/min - 1)",
              keep=("grid",), right=cols[1:])
    for r in rep["runs"]:
        it, ops, mem = r["iteration"], r["ops"], r["memory"]
        pct = (lambda v: "-" if v is None else f"{100 * v:.0f} %")  # noqa: E731
        t.add_row(r["grid"], f"{it['measured_s']:.4f}", f"{it['predicted_s']:.4f}", f"{100 * it['error']:+.0f} %",
                  f"{pct(it['spread'])} ({r['repeats']})" if r["repeats"] > 1 else "- (1)",
                  pct(ops["median_abs_error"]), pct(ops["compute_median_abs_error"]),
                  "-" if mem["measured_bytes"] is None else f"{mem['measured_bytes'] / 2**20:.1f}",
                  f"{mem['predicted_bytes'] / 2**20:.1f}")
    console.print(t)
    if rep["spearman"] is not None:
        console.print(f"grid ranking: Spearman {rep['spearman']:.2f} over {len(rep['runs'])} grids ({rep['repeats']} runs)")
    if rep["noise"] is not None:
        from calibration.noise import noise_line
        console.print(noise_line(rep["noise"]))
    for line in rep.get("notes", []):
        console.print(f"note: {line}")
