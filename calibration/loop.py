"""`twin calibrate --run`: the whole calibration loop in one command, for any model and rank counts.

    twin calibrate --run --model gpt-small --grids 1x1x1x1,2x1x1x1,... --out mycpu.toml

1. bench and run passes, interleaved (`loop_plan`: R1 B1 R2 R3 with 3 repeats and 1 bench pass):
   - a bench pass: `backend bench --for-twin` on the study's grids (backend.bench.plan: every rank count
     and axis they need), into WORK/bench/p<k>/;
   - a run pass: `backend run` of every grid of the study (STEPS steps) into WORK/runs/<grid>/r<k>/,
     each pass in another order (`pass_orders`), so that a drift of the machine spreads over the grids;
   the bench passes sit among the run passes so that the profile comes from the same stretch of the
   machine's time as the runs (docs/calibration.md: a profile benched before the runs carried the
   machine's drift into every grid's error);
2. `twin calibrate` of every bench file into the profile (--out), printing the fit's residuals;
3. `twin validate` of every run against it, a grid's repeats pooled (their median): the table, the
   runs' own noise, and the four figures the targets read (iteration within 15 %, per-op median within
   20 %, Spearman, memory), into WORK/report.json and the page WORK/report.html.

The backend runs in subprocesses of the `backend` command (`python -m backend.cli`), never imported
here: the twin's command stays free of torch. The loop says up front how long it should take (the
bench plan's estimate and the runs' steps) and prints a line per bench grid and per run with the time
left. The helpers for summary lines are shared with benchmarks/bench_validate.py, the developers' loop.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from topologies.common import TwinError, finite_json, write_atomic


@dataclass
class LoopConfig:
    """What `twin calibrate --run` runs: the study (model, grids or rank counts), the profile to write,
    the work folder, and the loop's sizes."""

    model: str
    out: str                      # the profile to write (.toml)
    work: str                     # bench files, runs, report.json, report.html
    grids: str | None = None      # comma-separated; else every valid grid of `ranks`
    ranks: str | None = None      # comma-separated rank counts
    steps: int = 6                # training steps per run (the first two are left out)
    repeats: int = 3              # runs per grid, in interleaved passes
    bench_passes: int = 1
    min_time: float = 0.1         # seconds per benchmark entry
    train_steps: int = 4          # recorded training steps per bench grid
    device: str = "cpu"
    system: str = "cpu"
    base: str | None = None       # base profile for what bench does not measure


def loop_plan(repeats: int, bench_passes: int) -> list[str]:
    """The order of the loop's passes: bench passes "B1".."Bn" spread evenly among the run passes
    "R1".."Rm", each bench pass at the middle of its share of them (R1 B1 R2 R3 B2 R4 for 4 and 2;
    R1 B1 R2 R3 for 3 and 1), so that the profile is fitted from the same stretch of the machine's time
    as the runs it is validated against: the development VM's speed drifts by 10-30 % over tens of
    minutes, and a profile benched before the runs carried that drift into every grid's error (loops
    01g-01i: mean error -1 %, -2 %, -7 %)."""
    plan = [f"R{k + 1}" for k in range(repeats)]
    for j in reversed(range(bench_passes)):
        plan.insert(min(repeats, int((j + 0.5) * repeats / bench_passes)), f"B{j + 1}")
    return plan


def pass_orders(grids: list[str], repeats: int) -> list[list[str]]:
    """The order of the grids in each of `repeats` passes: rotated by an equal share of the grids from
    pass to pass and every other pass reversed, so that no grid always runs early, late, or after the
    same neighbour (a drift of the machine during the loop spreads over the grids)."""
    orders = []
    for k in range(repeats):
        shift = (k * len(grids)) // repeats
        order = grids[shift:] + grids[:shift]
        orders.append(order[::-1] if k % 2 else order)
    return orders


def summary_line(label: str, runs: list[dict]) -> str:
    """The targets' measures over some runs: iteration |error| (median, count within 15 %), per-op
    median error (median over the runs, count within 20 %), worst memory error."""
    its = [abs(r["iteration"]["error"]) for r in runs]
    ops = [r["ops"]["median_abs_error"] for r in runs]
    mem = [abs(r["memory"]["error"]) for r in runs if r["memory"]["error"] is not None]
    spread = [r["iteration"].get("spread", 0.0) for r in runs]
    repeats = sum(r.get("repeats", 1) for r in runs)
    return (f"{label}, {len(runs)} grids ({repeats} runs): iteration median |error| {100 * statistics.median(its):.1f} %, "
            f"{sum(e <= 0.15 for e in its)} within 15 % (spread of the repeats: median {100 * statistics.median(spread):.0f} %, "
            f"worst {100 * max(spread):.0f} %); per-op median {100 * statistics.median(ops):.0f} %, "
            f"{sum(o <= 0.2 for o in ops)} within 20 %; memory worst {100 * max(mem) if mem else float('nan'):.1f} %")


def kinds_line(runs: list[dict]) -> str:
    """Which op kinds carry the per-op error: per kind, the median over runs of the kind's median
    signed error (+: the twin slower) and of its median |error|; for collectives, the share of their
    measured spans spent waiting for the group's last member, the median |error| from the last
    member's arrival, and the largest share of its collectives that completed with the one issued
    before them on their stream (two in flight at once; calibration/validate.py)."""
    kinds = sorted({k for r in runs for k in r["ops"]["by_kind"]})
    parts = []
    for k in kinds:
        rows = [r["ops"]["by_kind"][k] for r in runs if k in r["ops"]["by_kind"]]
        part = (f"{k} {100 * statistics.median(x.get('median_error', float('nan')) for x in rows):+.0f} % "
                f"(|{100 * statistics.median(x['median_abs_error'] for x in rows):.0f} %|")
        waits = [x["peer_wait_share"] for x in rows if "peer_wait_share" in x]
        after = [x["median_abs_error_from_last_arrival"] for x in rows if "median_abs_error_from_last_arrival" in x]
        along = [x["completed_with_previous_share"] for x in rows if "completed_with_previous_share" in x]
        parts.append(part + (f", {100 * statistics.median(waits):.0f} % peer wait" if waits else "")
                     + (f", |{100 * statistics.median(after):.0f} %| from the last arrival" if after else "")
                     + (f", up to {100 * max(along):.0f} % completed with the one before" if along else "") + ")")
    return "per kind: " + "; ".join(parts)


def issue_line(runs: list[dict]) -> str:
    """The host's wall time per collective issue (the trace's issue_us: preparing the buffers and the
    asynchronous call), per rank count: the median over the grids of each grid's mean over its
    collectives (repeats pooled), beside what the twin charges (the profile's host_issue_s, to the
    compute op after the issue)."""
    by: dict[int, tuple[list[float], list[float]]] = {}
    for r in runs:
        issued = [o["issue_s"] for o in r.get("per_op", []) if "issue_s" in o]
        if issued:
            m, c = by.setdefault(r["ranks"], ([], []))
            m.append(statistics.fmean(issued))
            c.append(r["iteration"].get("host_issue_predicted_s", 0.0))
    if not by:
        return "host time per collective issue: not recorded (traces before issue_us)"
    return "host time per collective issue, measured (the twin charges): " + ", ".join(
        f"{n} ranks {1e3 * statistics.median(m):.2f} ms ({1e3 * statistics.median(c):.2f})"
        for n, (m, c) in sorted(by.items()))


def figures_line(rep: dict) -> str:
    """The four figures against the targets: grids within 15 % on the iteration, grids whose per-op
    median is within 20 %, the grid ranking's Spearman, the worst memory error."""
    runs = rep["runs"]
    its = [abs(r["iteration"]["error"]) for r in runs]
    ops = [r["ops"]["median_abs_error"] for r in runs]
    mem = [abs(r["memory"]["error"]) for r in runs if r["memory"]["error"] is not None]
    sp = rep.get("spearman")
    return (f"targets: iteration within 15 % on {sum(e <= 0.15 for e in its)} of {len(runs)} grids (worst "
            f"{100 * max(its):.0f} %), per-op median within 20 % on {sum(o <= 0.2 for o in ops)} (worst "
            f"{100 * max(ops):.0f} %), Spearman {'-' if sp is None else f'{sp:.2f}'} (target 0.9), memory worst "
            f"{'-' if not mem else f'{100 * max(mem):.1f} %'} (target 10 %)")


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def _backend(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "backend.cli", *args]


def _env() -> dict:
    return {**os.environ, "COLUMNS": os.environ.get("COLUMNS", "160")}  # tables unwrapped


def _fail(cmd: list[str], code: int, lines: list[str]) -> TwinError:
    tail = "; ".join(ln.strip() for ln in lines[-3:] if ln.strip())
    return TwinError(f"`backend {' '.join(cmd[3:5])}` failed (exit {code}): {tail}")


class Clock:
    """The loop's time: its estimate, scaled as it goes by how the work done compared with its share."""

    def __init__(self, estimate_s: float):
        self.t0, self.total, self.done = time.perf_counter(), estimate_s, 0.0

    def step(self, estimate_s: float) -> str:
        self.done += estimate_s
        spent = time.perf_counter() - self.t0
        left = max(self.total - self.done, 0.0) * spent / max(self.done, 1e-9)
        return f"{_minutes(spent)} so far, about {_minutes(left)} left"


def run_loop(cfg: LoopConfig, say=print) -> dict:
    """The loop (module docstring); returns the validation report (calibration.validate.validate_runs)."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("backend") is None:
        raise TwinError("twin calibrate --run runs the backend, which needs PyTorch and the backend package: "
                        "pip install torch, and install this project with its backend (pip install -e .)")
    if cfg.repeats < 1 or cfg.bench_passes < 1 or cfg.steps < 3:
        raise TwinError(f"--repeats and --bench-passes must be at least 1 and --steps at least 3, got "
                        f"{cfg.repeats}, {cfg.bench_passes} and {cfg.steps}")
    if Path(cfg.out).suffix != ".toml":
        raise TwinError(f"--out {cfg.out} must be a .toml file (the profile the loop fits)")
    work = Path(cfg.work)
    study = ["--model", cfg.model] + (["--grids", cfg.grids] if cfg.grids else ["--ranks", cfg.ranks or "1,2,4,8"])
    bench_opts = ["--min-time", str(cfg.min_time), "--train-steps", str(cfg.train_steps), "--device", cfg.device]
    # the plan first (a few seconds, no ranks): the grids, what bench will take, a step's rough time
    r = subprocess.run(_backend(["bench", "--for-twin", *study, *bench_opts, "--plan-only", "--json"]),
                       capture_output=True, text=True, env=_env())
    if r.returncode:
        raise TwinError((r.stderr.strip().splitlines() or [f"backend bench failed (exit {r.returncode})"])[-1]
                        .removeprefix("error: "))
    plan = json.loads(r.stdout.strip().splitlines()[-1])
    grids = _study_grids(cfg)
    ranks_of = {g: _size(g) for g in grids}
    run_est = {g: plan["launch_s"] * (1 + n / plan["cores"]) + (cfg.steps + 1) * plan["step_s"] * max(1, n / plan["cores"])
               for g, n in ranks_of.items()}
    passes = loop_plan(cfg.repeats, cfg.bench_passes)
    total = cfg.bench_passes * plan["estimate_s"] + cfg.repeats * sum(run_est.values())
    say(f"calibration loop: {cfg.model}, {len(grids)} grid(s) x {cfg.repeats} run(s), {len(plan['benched'])} "
        f"benched grid(s) x {cfg.bench_passes} pass(es), in the order {' '.join(passes)}; estimated "
        f"{_minutes(total)} ({plan['cores']} cores; a loaded machine takes longer)")
    clock, files, runs = Clock(total), [], []
    orders = pass_orders(grids, cfg.repeats)
    n_runs, k_run = cfg.repeats * len(grids), 0
    for step in passes:
        k = int(step[1:])
        if step[0] == "B":
            folder = work / "bench" / f"p{k}"
            say(f"bench pass {k} of {cfg.bench_passes} -> {folder}")
            cmd = _backend(["bench", "--for-twin", *study, *bench_opts, "--out", str(folder)])
            lines = _stream(cmd, say)
            if lines[0]:
                raise _fail(cmd, lines[0], lines[1])
            files += sorted(folder.glob("bench-*.json"))
            say(f"bench pass {k}: {clock.step(plan['estimate_s'])}")
            continue
        for g in orders[k - 1]:
            k_run += 1
            d = work / "runs" / g / f"r{k}"
            cmd = _backend(["run", "--model", cfg.model, "--grid", g, "--steps", str(cfg.steps), "--warmup", "1",
                            "--device", cfg.device, "--out", str(d)])
            t1 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, env=_env())
            if r.returncode:
                raise _fail(cmd, r.returncode, (r.stdout + r.stderr).splitlines())
            runs.append(d)
            say(f"[run {k_run}/{n_runs}] {g} (pass {k}): {time.perf_counter() - t1:.0f} s; {clock.step(run_est[g])}")
    say(f"twin calibrate: {len(files)} measurement file(s) -> {cfg.out}")
    from calibration.fit import calibrate
    fit = calibrate([str(f) for f in files], cfg.out, cfg.base)
    if fit.residuals:
        say(f"  {len(fit.residuals)} fits over {sum(r.points for r in fit.residuals)} points: median |residual| "
            f"{100 * statistics.median(r.median for r in fit.residuals):.1f} %, worst {100 * max(r.worst for r in fit.residuals):.0f} % "
            f"(each fit's: twin calibrate {work}/bench/p*/bench-*.json --out {cfg.out})")
    say(f"wrote {cfg.out} (rank counts {', '.join(map(str, fit.ranks))})")
    say(f"twin validate: {len(runs)} run(s) against {cfg.out}")
    from calibration.validate import validate_runs
    from calibration.validate_page import validation_html
    rep = validate_runs([str(d) for d in runs], cfg.system, cfg.out)
    write_atomic(work / "report.json", finite_json(rep, indent=1))
    write_atomic(work / "report.html", validation_html(rep))
    return rep


def _stream(cmd: list[str], say) -> tuple[int, list[str]]:
    """Run `cmd`, passing its lines on indented as they come; (exit code, its lines)."""
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()) as p:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line.rstrip("\n"))
            say("  " + lines[-1])
    return p.returncode, lines


def _size(grid: str) -> int:
    from twin.program.grid import Grid
    return Grid.parse(grid).size


def _study_grids(cfg: LoopConfig) -> list[str]:
    """The study's grids as strings: --grids, or every grid of each of --ranks that runs the model (the
    twin's own check: twin.program.grid.Grid.validate)."""
    from twin.predict.search import grids_that_run
    from twin.program.grid import Grid
    from twin.program.model import load_model
    spec = load_model(cfg.model)
    if cfg.grids:
        return list(dict.fromkeys(str(Grid.parse(g.strip())) for g in cfg.grids.split(",") if g.strip()))
    counts = dict.fromkeys(int(x) for x in (cfg.ranks or "1,2,4,8").split(",") if x.strip())
    return [str(g) for r in counts for g in grids_that_run(spec, r)]
