"""Running a sweep's points: serially in this process, or as Dask tasks on local worker processes (the
default when Dask is installed), on a running Dask scheduler (`scheduler="tcp://host:8786"`) or on
Slurm through dask-jobqueue (`slurm=True`: workers start as batch jobs, configured by dask-jobqueue's
own configuration, ~/.config/dask/jobqueue.yaml). Each worker is a long-lived process, so the twin's
memos (routes, rates, programs, simulations) carry over from point to point.

Rows go to the results file (twin.sweep.results) as points finish; points the file already holds are
skipped; Ctrl-C stops the run with every finished row kept.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from topologies.common import InputError
from twin.sweep.point import FIGURES, one_line, run_point
from twin.sweep.results import Results
from twin.sweep.spec import Sweep

NO_DASK = "Dask is not installed (pip install \".[sweep]\"): running the points one by one in this process"


@dataclass
class SweepRun:
    """What a run did: points in the sweep, skipped (already in the file), computed now, failed among
    those, whether Ctrl-C stopped it, the engine it ran on and the results file."""

    total: int
    skipped: int
    computed: int
    failed: int
    interrupted: bool
    engine: str
    path: str
    wall_s: float = 0.0


def have_dask() -> bool:
    try:
        import distributed  # noqa: F401
    except ImportError:
        return False
    return True


def columns(sweep: Sweep) -> list[str]:
    return ["key", *sweep.axis_columns(), *FIGURES]


# Dask's defaults, made for long data-parallel tasks, cost a sweep's short CPU-bound points dearly:
# - workers start with MALLOC_TRIM_THRESHOLD_=65536 (to hand memory back sooner), which also fixes
#   glibc's mmap threshold, so every numpy array the twin makes is mapped and unmapped afresh: 26% more
#   CPU on a 24-point sweep serially (7.0 s to 8.8 s, measured);
# - the statistical profiler samples every worker's task thread every 10 ms, the event loops tick every
#   20 ms, the system and memory monitors poll every 0.5 and 0.1 s: an idle LocalCluster of 2 workers
#   used 0.127 CPU seconds per second (measured); with the profiler off and the rest slowed, 0.015.
# Local clusters start with these settings instead.
LEAN = {"distributed.worker.profile.enabled": False, "distributed.admin.tick.interval": "1s",
        "distributed.admin.system-monitor.interval": "5s", "distributed.worker.memory.monitor-interval": "1s"}


def _lean_environ() -> dict:
    import dask
    env = dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {}
    return {k: v for k, v in env.items() if k != "MALLOC_TRIM_THRESHOLD_"}


def _client(workers: int | None, scheduler: str | None, slurm: bool):
    """(a distributed.Client, what to close after, a description of the engine)."""
    import logging

    from distributed import Client, LocalCluster

    logging.getLogger("distributed").setLevel(logging.ERROR)
    if scheduler:
        try:
            client = Client(scheduler, timeout="10s")
        except (OSError, TimeoutError) as e:
            raise InputError(f"--scheduler {scheduler}: cannot reach a Dask scheduler there ({e})") from None
        return client, [client], f"the Dask scheduler at {scheduler}"
    if slurm:
        try:
            from dask_jobqueue import SLURMCluster
        except ImportError:
            raise InputError("--slurm needs dask-jobqueue (pip install \".[sweep]\")") from None
        import shutil
        if shutil.which("sbatch") is None:
            raise InputError("--slurm: no sbatch here (run twin sweep --slurm on a Slurm login node)")
        cluster = SLURMCluster(**({} if _configured("slurm") else {"cores": 1, "processes": 1, "memory": "4GB"}))
        cluster.scale(jobs=workers or 1)
        client = Client(cluster)
        return client, [client, cluster], f"Slurm through dask-jobqueue ({workers or 1} worker jobs)"
    import dask

    n = workers or os.cpu_count() or 1
    with dask.config.set({**LEAN, "distributed.nanny.pre-spawn-environ": _lean_environ()}):
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
                               silence_logs=logging.ERROR)
    client = Client(cluster)
    return client, [client, cluster], f"Dask, {n} local worker process{'es' if n > 1 else ''}"


def _submit(client, todo: list) -> list:
    """One Dask task per point. Where the workers are known, each is given a contiguous block of the
    points (neighbours in the sweep share systems, models and GPU counts, so its memos serve them),
    which the scheduler may still move to an idle worker (allow_other_workers: work stealing)."""
    workers = sorted(client.scheduler_info().get("workers", {}))
    if len(workers) < 2:
        return client.map(run_point, todo, pure=False)
    size = -(-len(todo) // len(workers))
    futures = []
    for i, addr in enumerate(workers):
        block = todo[i * size:(i + 1) * size]
        if block:
            futures += client.map(run_point, block, pure=False, workers=[addr], allow_other_workers=True)
    return futures


def _configured(kind: str) -> bool:
    """Whether dask-jobqueue's configuration says how big a job of `kind` is."""
    import dask
    return dask.config.get(f"jobqueue.{kind}.cores", None) is not None


def run_sweep(sweep: Sweep, out: str | Path, *, serial: bool = False, workers: int | None = None,
              scheduler: str | None = None, slurm: bool = False,
              progress: Callable[[str, int, int], None] | None = None, say: Callable[[str], None] | None = None,
              on_row: Callable[[dict], None] | None = None) -> SweepRun:
    """Run the points of `sweep` that the results file `out` does not hold yet, appending each row as
    it finishes (see the module docstring). progress(what, done, total): after each point; say(line):
    what the run tells the user (the engine); on_row(row): after each row is written."""
    t0 = time.perf_counter()
    say = say or (lambda line: None)
    results = Results(out, columns(sweep))
    points = sweep.points()
    todo = [p for p in points if p.key not in results.done]
    total, skipped = len(points), len(points) - len(todo)
    failed = sum(1 for p in points if results.done.get(p.key, {}).get("status") == "error")
    state = {"computed": 0, "failed": failed}

    def finished(row: dict) -> None:
        results.append(row)
        state["computed"] += 1
        state["failed"] += row["status"] == "error"
        if progress is not None:
            done = skipped + state["computed"]
            progress(f"sweep: {done - state['failed']} done, {state['failed']} failed", done, total)
        if on_row is not None:
            on_row(row)

    use_dask = not serial and todo and (have_dask() or scheduler or slurm)
    if not serial and todo and not use_dask:
        say(NO_DASK)
    engine = "this process"
    interrupted = False
    closers = []
    if progress is not None:
        progress(f"sweep: {skipped - failed} done, {failed} failed", skipped, total)
    try:
        if use_dask:
            if not have_dask():
                raise InputError("--scheduler and --slurm need Dask (pip install \".[sweep]\")")
            from distributed import as_completed
            client, closers, engine = _client(workers, scheduler, slurm)
            say(f"running {len(todo)} of {total} points on {engine}")
            futures = _submit(client, todo)
            point_of = dict(zip(futures, todo))
            for future in as_completed(futures):
                try:
                    row = future.result()
                except Exception as e:  # noqa: BLE001 - a worker lost (killed, out of memory): the point's error
                    p = point_of[future]
                    row = {"key": p.key, **p.columns(), "status": "error", "error": one_line(e)}
                finished(row)
        else:
            if todo:
                say(f"running {len(todo)} of {total} points in this process")
            for p in todo:
                finished(run_point(p))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for c in closers:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a cluster that is going down anyway
                pass
        if not interrupted and all(p.key in results.done for p in points):
            results.rewrite_in_order([p.key for p in points])
        else:
            results.close()
    return SweepRun(total, skipped, state["computed"], state["failed"], interrupted, engine, str(out),
                    time.perf_counter() - t0)
