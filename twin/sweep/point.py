"""One point of a sweep predicted into one row of results: what each Dask task (or the serial loop) runs.

`run_point(point)` resolves the study (the system with its overrides, the model, GPUs, batch,
sequence length, switches), picks the best grid (grid auto, as `twin simulate`) or takes the given
one, and returns the row: the point's axis values, then status "ok" and the prediction, or status
"error" and its one-line error. The twin's memos (routes, rates, programs, simulations) live in the
process, so a worker that runs many points reuses them; systems with their overrides are kept too.
"""

from __future__ import annotations

import dataclasses as dc
import functools
import math
import time

from topologies import caches
from topologies.common import TwinError
from topologies.system import load_system
from twin.sweep.goodput import under_failures
from twin.sweep.overrides import apply_profile, apply_system
from twin.sweep.spec import Point

AXES4 = ("x", "y", "z", "data")
# the figures of a row after the point's axis values, in order (blank on an error)
FIGURES = ("status", "error", "grid", "global_batch", "seq", "iteration_s", "tokens_per_s", "flops_per_s",
           "flops_per_gpu", "percent_of_peak", "memory_gib", "compute_s", *(f"exposed_{a}_s" for a in AXES4),
           "idle_s", "train_days", "gpu_hours", "node_mtbf_h", "job_mtbf_h", "goodput", "failures", "wall_days",
           "wall_gpu_hours", "checkpoint_write_s", "seconds")


@functools.lru_cache(maxsize=64)  # registered below: (system, overrides) -> its spec
def _system(name: str, overrides: tuple) -> object:
    return apply_system(load_system(name), overrides)


caches.register("twin.sweep.point.systems", _system)


def _study(p: Point):
    from twin.costs.kernels import KernelModel
    from twin.predict.study import prepare
    from twin.program.flags import options_from_flags

    sw = dict(p.switches)
    placement = sw.pop("placement", "contiguous")
    opts = options_from_flags(**sw)
    study = prepare(_system(p.system, p.overrides), p.model, p.gpus, p.batch, p.seq_len, opts, placement)
    if any(path.startswith("profile.") for path, _ in p.overrides):
        q = apply_profile(study.profile, p.overrides)
        study = dc.replace(study, profile=q, kernels=KernelModel(q, tuning=study.kernels.tuning))
    return study


def predict(p: Point):
    """(the study, the SimulationResult of its best or given grid). Raises TwinError."""
    from twin.predict.auto import choose_grid
    from twin.predict.run import simulate_grid
    from twin.program.grid import Grid

    study = _study(p)
    if p.grid.strip().lower() == "auto":
        best, how = choose_grid(study, simulate_top=p.simulate_top)
        result = best.result or simulate_grid(study, best.grid, grid_choice=how)
    else:
        result = simulate_grid(study, Grid.parse(p.grid))
    return study, result


def figures(study, r, p: Point) -> dict:
    """The row's figures of a prediction: the iteration, then time to train and goodput (with [train])."""
    tokens_per_s = r.global_batch * r.seq_len / r.iteration_time_s
    b = r.breakdown_s
    out = {"status": "ok", "error": "", "grid": r.grid_str, "global_batch": r.global_batch, "seq": r.seq_len,
           "iteration_s": r.iteration_time_s, "tokens_per_s": tokens_per_s, "flops_per_s": r.flops_per_s,
           "flops_per_gpu": r.flops_per_s_per_gpu, "percent_of_peak": r.percent_of_peak,
           "memory_gib": r.memory_per_gpu_bytes / 2**30, "compute_s": b["compute"],
           **{f"exposed_{a}_s": b["exposed_comm"].get(a, 0.0) for a in AXES4}, "idle_s": b["idle"]}
    t = p.train
    if t is None:
        return out
    work = t.tokens / tokens_per_s
    out.update(train_days=work / 86400, gpu_hours=r.gpus * work / 3600)
    mtbf = study.system.node_mtbf_h
    out["node_mtbf_h"] = mtbf or ""
    if t.failures and mtbf > 0:
        nodes = math.ceil(r.gpus / study.system.gpus_per_node)
        if t.checkpoint_write_min is not None:
            write_s = 60 * t.checkpoint_write_min
        else:  # twin simulate's time on the system's [filesystem] (0 without one)
            from twin.predict.ckptcost import checkpoint_cost
            write_s = checkpoint_cost(study.system, study.model, r.gpus, r.grid.get("y", 1)).write_s or 0.0
        out["checkpoint_write_s"] = write_s
        g = under_failures(work, nodes, mtbf, 60 * t.checkpoint_every_min, write_s, 60 * t.restart_min)
        out.update(job_mtbf_h=g.job_mtbf_h, goodput=g.goodput, failures=g.failures, wall_days=g.wall_s / 86400,
                   wall_gpu_hours=r.gpus * g.wall_s / 3600)
    return out


def one_line(e: BaseException) -> str:
    """An error as one line (a TwinError's message; another exception's type and message)."""
    text = str(e) if isinstance(e, TwinError) else f"{type(e).__name__}: {e}"
    return " ".join(text.split()) or type(e).__name__


def run_point(p: Point) -> dict:
    """The point's row: its key and axis values, then its figures or its one-line error (never raises
    but for KeyboardInterrupt and the like). `seconds`: the wall time of this point here."""
    t0 = time.perf_counter()
    row = {"key": p.key, **p.columns()}
    try:
        study, r = predict(p)
        row.update(figures(study, r, p))
    except Exception as e:  # noqa: BLE001 - a bad point records its error and the sweep goes on
        row.update(status="error", error=one_line(e))
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row
