"""Where a CPU rank's wall time goes while more ranks than cores share a node: inside its compute ops
and in the host gaps between them, each split into its own CPU time, waiting on the run queue
(runnable but descheduled) and sleeping (blocked, as in a wait for a collective).

    python benchmarks/cpu_sched_split.py 1x1x1x8 1x1x4x2 2x2x2x1 --steps 5   # gpt-small, ~30 s a grid

Each grid runs 2 warm-up and STEPS recorded training steps of the model (every rank at once, as
`backend bench` records them). Around every compute op the recorder's clocks are read (wall:
perf_counter; CPU: thread_time, as the trace's cpu_us) together with the thread's run-queue delay
(the second field of /proc/thread-self/schedstat, Linux: accounted when the thread gets a core back,
so exact at the reads, which the thread makes while running). Sleeping is what is left: wall - CPU -
run queue. Printed per grid, per rank and step (mean):
- `op stretch`: the ops' wall over their CPU time (what `twin validate` compares a compute op by);
- `runnable stretch`: ops and gaps together, (CPU + run queue) over CPU: how many times its own
  work a rank is runnable, the quantity a processor-sharing model of the cores describes;
- `rq in gaps`: the share of the run-queue wait that falls in the host gaps, beside the share of the
  rank's CPU time the gaps hold;
- `--plain` leaves the schedstat reads out (the recorder's clocks only), to see what they cost.

Measured (2026-12-02, 19:30 UTC, the 2-core development VM, an Intel Xeon, at load 4-8, gpt-small,
5 recorded steps a grid, one pass; `python benchmarks/cpu_sched_split.py 1x1x1x8 1x1x4x2 1x1x8x1 1x2x4x1 2x2x2x1
4x2x1x1 8x1x1x1 1x4x2x1`, then `--plain` on four of them and `--control 8`). The waits land at the
op boundaries:

| grid | op stretch | runnable stretch | gaps' share of CPU | of run-queue wait | sleeping, share of wall |
|---|---|---|---|---|---|
| 1x1x4x2 | 2.91 | 4.73 | 0.29 | 0.65 | 0.11 |
| 1x1x8x1 | 3.17 | 4.85 | 0.27 | 0.60 | 0.17 |
| 1x2x4x1 | 2.88 | 4.31 | 0.30 | 0.61 | 0.19 |
| 1x1x1x8 | 2.34 | 3.91 | 0.23 | 0.65 | 0.20 |
| 2x2x2x1 | 3.00 | 3.83 | 0.32 | 0.53 | 0.29 |
| 1x4x2x1 | 2.76 | 3.89 | 0.30 | 0.58 | 0.31 |
| 4x2x1x1 | 2.72 | 3.36 | 0.22 | 0.44 | 0.45 |
| 8x1x1x1 | 2.87 | 3.41 | 0.14 | 0.34 | 0.54 |

- The host gaps hold 14-32 % of a rank's CPU time but 34-65 % of its run-queue wait. On 1x1x1x8 (no
  collective before the step's end) each long gap of the forward and backward (3-10 ms) is run-queue
  wait on 0.2-0.6 ms of host work, no sleep; its GEMMs run at their on-CPU time (median wall over CPU
  1.01 in the trace of cpu-2026-12-02i).
- The control, a loop of GEMMs in 8 processes with 0.3 ms of Python and a 4 MiB allocation between
  them: gaps 0.19 of the CPU and 0.28 of the run-queue wait. Host work as such does not draw the
  waits; what a training step does between its ops does.
- The share of the waits in the gaps falls as the rank sleeps more (blocked on its collectives): 0.65
  at a tenth of the wall asleep, 0.34 at a half; least squares over these 8 grids, 0.75 - 0.70 x the
  sleeping share (within 0.05 on each; correlation -0.96).
- `--plain` (no schedstat reads): op stretch 2.23, 2.96, 3.04, 2.72 on 1x1x1x8, 1x1x4x2, 2x2x2x1,
  8x1x1x1 against 2.34, 2.91, 3.00, 2.87 with them: the reads move it within the pass-to-pass noise.

What it means for twin.host.cores: an op's measured stretch is the sharing of the cores less what the
scheduler moves to the gaps, and that share is grid by grid. The twin charges one host time per rank
count (bench's mean gap, its waits included) and fits one load to the ops' stretch; on the grids
that hardly sleep (z split, x and y not: 1x1x4x2, 1x2x4x1) the waits the gaps take leave the ops'
stretch lower than the fluid formula gives, which is where its stretch runs high. Not yet in the
twin (bench does not record the run-queue split): a runnable stretch for ops and host work together,
split between them by the sleeping share of the twin's own timeline.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEDSTAT = "/proc/thread-self/schedstat"


def run_delay() -> float:
    """Seconds this thread has waited on a run queue since it started (Linux schedstat)."""
    with open(SCHEDSTAT) as f:
        return int(f.read().split()[1]) / 1e9


def mark(what: str, delay=run_delay) -> tuple[str, float, float, float]:
    """(what, wall s, CPU s, run-queue s). The run-queue delay is read first: reading it is a system
    call, where the scheduler may take the core, and the wait then lands in both clocks read after."""
    rq = delay()
    return what, time.perf_counter(), time.thread_time(), rq


def _rank(rank: int, world: int, grid_s: str, model: str, steps: int, plain: bool, out: str, port: int) -> None:
    from cpu_step_spread import training_rank
    step_once = training_rank(rank, world, grid_s, model, port)
    import torch.distributed as dist
    from backend.runtime.dist import destroy
    from backend.runtime.recorder import NULL_RECORDER, Recorder

    marks: list[tuple] = []  # ("b" or "e", wall s, CPU s, run-queue s) around each compute op
    delay = (lambda: 0.0) if plain else run_delay

    class SchedRecorder(Recorder):
        def _start_cpu(self, rec) -> None:
            super()._start_cpu(rec)
            if rec.stream == "compute":
                marks.append(mark("b", delay))

        def end(self, rec) -> None:
            if rec is not None and rec.stream == "compute" and rec._cpu is not None:
                marks.append(mark("e", delay))
            super().end(rec)

    res = []
    for step in range(2 + steps):
        marks.clear()
        step_once(SchedRecorder() if step >= 2 else NULL_RECORDER)
        if step >= 2:
            res.append(split(marks))
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(gathered))
    destroy()


def _control(rank: int, ops: int, out: str) -> None:
    """The same marks around a plain loop of GEMMs (256 x 768 x 768, about the model's), with host work
    between them as a training step's gaps hold it (0.3 ms of Python, a 4 MiB tensor allocated and
    filled): whether the scheduler's waits land in the gaps by themselves."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(256, 768), torch.randn(768, 768)
    marks = []
    for _ in range(ops):
        marks.append(mark("b"))
        torch.nn.functional.gelu(a @ b)
        marks.append(mark("e"))
        start = time.perf_counter()
        while time.perf_counter() - start < 3e-4:
            pass
        torch.empty(1 << 20).fill_(1.0)
    Path(out).write_bytes(pickle.dumps([split(marks)]))


def split(marks: list[tuple]) -> dict[str, float]:
    """Seconds of one step: ops' and gaps' wall, CPU and run-queue wait, from the marks around each op."""
    t = dict.fromkeys(("op_wall", "op_cpu", "op_rq", "gap_wall", "gap_cpu", "gap_rq"), 0.0)
    begin = last_end = None
    for m in marks:
        if m[0] == "b":
            if last_end is not None:
                for k, i in (("gap_wall", 1), ("gap_cpu", 2), ("gap_rq", 3)):
                    t[k] += m[i] - last_end[i]
            begin = m
        elif begin is not None:
            for k, i in (("op_wall", 1), ("op_cpu", 2), ("op_rq", 3)):
                t[k] += m[i] - begin[i]
            last_end = m
    return t


def report(grid: str, steps: list[list[dict]], plain: bool) -> str:
    """One line for a grid from every rank's steps."""
    each = [s for rank in steps for s in rank]
    t = {k: statistics.fmean(s[k] for s in each) for k in each[0]}
    ms = {k: v * 1e3 for k, v in t.items()}
    line = f"{grid} op stretch {t['op_wall'] / t['op_cpu']:.2f}; wall per rank-step (ms): ops {ms['op_wall']:.0f}, gaps {ms['gap_wall']:.0f}"
    if plain:
        return line + f"; CPU ops {ms['op_cpu']:.0f}, gaps {ms['gap_cpu']:.0f}"
    cpu, rq = t["op_cpu"] + t["gap_cpu"], t["op_rq"] + t["gap_rq"]
    sleep = t["gap_wall"] - t["gap_cpu"] - t["gap_rq"]
    return (line + f"; runnable stretch {(cpu + rq) / cpu:.2f}; rq in gaps {t['gap_rq'] / rq if rq else 0.0:.2f} "
            f"(their CPU share {t['gap_cpu'] / cpu:.2f}); ops = CPU {ms['op_cpu']:.0f} + rq {ms['op_rq']:.0f}; "
            f"gaps = CPU {ms['gap_cpu']:.0f} + rq {ms['gap_rq']:.0f} + sleeping {sleep * 1e3:.0f}")


def main() -> int:
    import torch.multiprocessing as mp
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grids", nargs="*")
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--steps", type=int, default=5, help="recorded steps after 2 warm-up ones")
    ap.add_argument("--plain", action="store_true", help="leave the schedstat reads out")
    ap.add_argument("--control", type=int, metavar="RANKS", help="instead: a plain loop of GEMMs in RANKS processes")
    a = ap.parse_args()
    if not a.plain and not Path(SCHEDSTAT).exists():
        print(f"error: {SCHEDSTAT} is missing (Linux with schedstats only); --plain runs without it", file=sys.stderr)
        return 2
    if not a.grids and not a.control:
        print("error: name at least one grid (e.g. 1x1x4x2), or --control RANKS", file=sys.stderr)
        return 2
    if a.control:
        with tempfile.TemporaryDirectory() as d:
            outs = [str(Path(d) / f"r{r}.pkl") for r in range(a.control)]
            procs = [mp.get_context("spawn").Process(target=_control, args=(r, 300, outs[r])) for r in range(a.control)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            print(report(f"GEMM loop, {a.control} processes", [pickle.loads(Path(o).read_bytes()) for o in outs], False))
        return 0
    from twin.program.grid import Grid
    print(f"{a.model}, {a.steps} recorded steps a grid; load average at the start {os.getloadavg()}", flush=True)
    for grid in a.grids:
        world = Grid.parse(grid).size
        with tempfile.TemporaryDirectory() as d:
            out = str(Path(d) / "steps.pkl")
            mp.spawn(_rank, args=(world, grid, a.model, a.steps, a.plain, out, 29500 + os.getpid() % 2000),
                     nprocs=world)
            print(report(grid, pickle.loads(Path(out).read_bytes()), a.plain), flush=True)
    print(f"load average at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
