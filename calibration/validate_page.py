"""`twin validate --html`: the validation report (calibration.validate_runs) as one page that reads
without the code: what was compared, how close the twin came against the project's targets, per grid
and per kind of op, and the two scatters (iteration per grid, every op)."""

from __future__ import annotations

import html
import statistics

from calibration.validate import SKIP_STEPS, validate_runs
from calibration.validate_measured import COLLECTIVES
from calibration.validate_summary import Targets, by_kind, targets_for


def _pct(v: float | None, signed: bool = False, digits: int = 0) -> str:
    if v is None:
        return "-"
    v = 0.0 if round(100 * v, digits) == 0 else v  # no "-0 %"
    return f"{100 * v:{'+' if signed else ''}.{digits}f} %"


def summary_lines(report: dict, t: Targets) -> list[str]:
    """The headline in words: iteration, per op, memory, ranking, and the repeats' own spread."""
    runs = report["runs"]
    n = len(runs)
    worst = max(runs, key=lambda r: abs(r["iteration"]["error"]))
    median = statistics.median(abs(r["iteration"]["error"]) for r in runs)
    lines = [f"Iteration time: median |error| {_pct(median, digits=1)}; "
             f"{sum(abs(r['iteration']['error']) <= t.iteration for r in runs)} of {n} grids within "
             f"{_pct(t.iteration)} (worst {worst['grid']}, {_pct(worst['iteration']['error'], True)})."]
    ops = [r for r in runs if r["ops"]["median_abs_error"] is not None]
    if ops:
        w = max(ops, key=lambda r: r["ops"]["median_abs_error"])
        lines.append(f"Per op (each grid's median |error| over its ops): median over grids "
                     f"{_pct(statistics.median(r['ops']['median_abs_error'] for r in ops), digits=1)}; "
                     f"{sum(r['ops']['median_abs_error'] <= t.per_op for r in ops)} of {len(ops)} within "
                     f"{_pct(t.per_op)} (worst {w['grid']}, {_pct(w['ops']['median_abs_error'])}).")
    mem = [r for r in runs if r["memory"]["error"] is not None]
    if mem:
        w = max(mem, key=lambda r: abs(r["memory"]["error"]))
        lines.append(f"Memory peak per rank: {sum(abs(r['memory']['error']) <= t.memory for r in mem)} of {len(mem)} "
                     f"within {_pct(t.memory)} (worst {w['grid']}, {_pct(w['memory']['error'], True)}).")
    if report.get("spearman") is not None:
        lines.append(f"Grid ranking, fastest to slowest: Spearman {report['spearman']:.2f} over {n} grids "
                     f"(target {t.spearman:g}).")
    spreads = [r["iteration"]["spread"] for r in runs if r.get("repeats", 1) > 1 and r["iteration"].get("spread")]
    if spreads:
        lines.append(f"The same grid's runs differ among themselves by a median of {_pct(statistics.median(spreads))} "
                     f"(max/min - 1; worst {_pct(max(spreads))}): errors of that size can come from the machine alone.")
    noise = report.get("noise")
    if noise:
        lines.append(f"What the runs allow (calibration.noise): their median over the odd runs against the even runs "
                     f"agrees within {_pct(noise['target'])} on {noise['halves_within']} of {noise['halves_grids']} "
                     f"grids; a model exact on every grid's mean would have {noise['exact_model_within']:.1f} of "
                     f"{noise['grids']} within {_pct(noise['target'])} (all of them "
                     f"{_pct(noise['exact_model_all'])} of the time), with the runs' noise of "
                     f"{noise['run_log_sd']:.3f} per run (log sd).")
    return lines


def report_validation(run_dirs: list[str], system: str) -> dict:
    """The validation section of `twin report --run DIR` (plugged in through the entry-point group
    "twin.report"): the report of `validate_runs` with its headline in words under "summary"."""
    report = validate_runs(run_dirs, system=system)
    return report | {"summary": summary_lines(report, targets_for(report))}


def grid_rows(runs: list[dict], t: Targets) -> tuple[list[str], list[list[str]], set[tuple[int, int]]]:
    """(header, rows, cells past their target) of the per-grid table."""
    header = ["grid", "runs", "iteration measured (s)", "predicted (s)", "error", "spread of the runs",
              "per-op median |error|", "compute |error|", "stretch measured", "stretch predicted",
              "memory measured (MiB)", "predicted (MiB)", "memory error"]
    rows, over = [], set()
    for i, r in enumerate(runs):
        it, ops, mem = r["iteration"], r["ops"], r["memory"]
        stretch = ops.get("stretch_predicted") or ops.get("stretch_profile")
        rows.append([r["grid"], str(r.get("repeats", 1)), f"{it['measured_s']:.4f}", f"{it['predicted_s']:.4f}",
                     _pct(it["error"], True), _pct(it.get("spread")) if r.get("repeats", 1) > 1 else "-",
                     _pct(ops["median_abs_error"]), _pct(ops.get("compute_median_abs_error")),
                     "-" if ops.get("stretch") is None else f"{ops['stretch']:.2f}",
                     "-" if stretch is None else f"{stretch:.2f}",
                     "-" if mem["measured_bytes"] is None else f"{mem['measured_bytes'] / 2**20:.1f}",
                     f"{mem['predicted_bytes'] / 2**20:.1f}", _pct(mem["error"], True)])
        over |= {(i, header.index(col)) for col, bad in (
            ("error", abs(it["error"]) > t.iteration), ("per-op median |error|", (ops["median_abs_error"] or 0) > t.per_op),
            ("memory error", mem["error"] is not None and abs(mem["error"]) > t.memory)) if bad}
    return header, rows, over


def kind_rows(runs: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the per-kind table, every run's ops pooled."""
    kinds = by_kind([o for r in runs for o in r["per_op"]], {})
    header = ["kind", "ops", "median error", "median |error|", "90th percentile |error|", "measured (s, summed)",
              "predicted (s, summed)", "waiting for the last member"]
    rows = [[k, str(v["ops"]), _pct(v["median_error"], True), _pct(v["median_abs_error"]), _pct(v["p90_abs_error"]),
             f"{v['measured_s']:.4f}", f"{v['predicted_s']:.4f}",
             _pct(v.get("peer_wait_share")) if k in COLLECTIVES else "-"] for k, v in kinds.items()]
    return header, rows


HOW_TO_READ = [
    f"Measured iteration: the median step time of a run after its first {SKIP_STEPS} steps; for a grid run several "
    "times, the median over its runs. Predicted: `twin simulate` of the same model, grid, batch and switches "
    "with the profile named below. Error = predicted / measured - 1.",
    "Per op: each op of the traced step by name. Where ranks outnumber the cores (a CPU), the scheduler "
    "time-slices them and a descheduled rank's wait lands on whichever op it was running, while the twin "
    "shares the cores evenly; so a compute op's measured time is its on-CPU time times its rank's stretch "
    "(the rank's wall time over its on-CPU time, summed over its compute ops). A collective's is its span "
    "from its issue to its completion, waiting for the group's last member included.",
    "Stretch: how many times its on-CPU time a compute op takes while ranks share the cores, measured and as "
    "the twin predicts it for the grid (twin/host/cores.py). Memory: torch's peak per rank against the twin's.",
    "Shaded cells are past the target. The JSON report (--json) holds every op of every run.",
]


def validation_html(report: dict, targets: Targets | None = None) -> str:
    """The page of a validation report (calibration.validate_runs' result)."""
    from twin.present.page import Page, html_table
    from twin.present.plots import iteration_validation_figure, validation_figure
    runs = report["runs"]
    first = runs[0]
    t = targets or targets_for(report)
    models = ", ".join(sorted({r["model"] for r in runs}))
    page = Page(f"twin vs backend: {models}")
    page.add(f"<h1>The twin against the backend: {html.escape(models)}, {len(runs)} grid"
             f"{'s' if len(runs) != 1 else ''}, {sum(r.get('repeats', 1) for r in runs)} runs</h1>")
    page.add('<p class="lead">' + "<br>".join(html.escape(s) for s in summary_lines(report, t)) + "</p>")
    page.add(f'<p class="note">System {html.escape(str(first.get("system")))}, profile '
             f'{html.escape(str(first.get("profile")))}; targets: iteration within {_pct(t.iteration)}, per-op '
             f"median within {_pct(t.per_op)}, memory within {_pct(t.memory)}, Spearman at least {t.spearman:g}.</p>")
    page.add("<h2>How to read it</h2><ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in HOW_TO_READ) + "</ul>")
    page.add("<h2>Iteration time per grid</h2>")
    page.figure("iteration", iteration_validation_figure(runs, t.iteration))
    header, rows, over = grid_rows(runs, t)
    page.add(html_table(header, rows, over))
    page.add("<h2>Per kind of op</h2>")
    page.add(html_table(*kind_rows(runs)))
    page.add("<h2>Every op</h2>")
    page.figure("ops", validation_figure([o | {"grid": r["grid"]} for r in runs for o in r["per_op"]]))
    return page.html()
