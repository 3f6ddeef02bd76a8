"""How much a recorded training step's ops vary from step to step on CPU, and what that does to the
statistic `backend bench` takes of them.

    python benchmarks/cpu_step_spread.py 2x2x2x1 --steps 30      # gpt-small, 8 ranks, about 2 min

Runs STEPS recorded training steps of the model on GRID (after 2 warm-up steps, every rank at once,
as `backend bench` records them), every other one started by a barrier (as `backend run` starts the
step it traces; bench's steps start as the previous one left the ranks), and prints per kind of op
(compute; each collective kind and axis), summed over the program's ops:
- in windows of 4 steps (bench records 4): the upper median of a rank's 4 spans (what bench took
  before it took the mean, `backend.bench.steps.per_step`), and the median of 4, over the mean of the 4;
- the steps started by a barrier against the free ones, pair by pair (median and quartiles of the
  ratio): whether aligned ranks change what ops cost, in span and (`compute on-CPU`) in the compute
  ops' on-CPU time;
- the spread of the step time (standard deviation of its log).
Ratios within one run: the machine's load moves both sides of each alike; say the load with them.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def training_rank(rank: int, world: int, grid_s: str, model: str, port: int):
    """Join a gloo group of `world` ranks on localhost as `rank` and build `model` on grid `grid_s`, as
    `backend bench` records its training steps (one thread per core share, as backend.launch.launcher sets
    OMP_NUM_THREADS). Returns step(recorder): one training step on fresh random tokens."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from backend.runtime.dist import ParallelContext
    from backend.models.gpt import make_model
    from backend.training.optim import make_optimizer, train_step
    from twin.program.grid import Grid
    from twin.program.model import load_model
    from twin.program.program import Options, build_program
    grid = Grid.parse(grid_s)
    ctx = ParallelContext.from_env(grid, backend="gloo")
    spec = load_model(model)
    program = build_program(spec, grid, Options())
    net = make_model(spec, ctx, program=program)
    opt = make_optimizer(net)
    seqs = program.batch // ctx.batch_shards
    gen = torch.Generator().manual_seed(rank)

    def step(recorder) -> None:
        tokens = torch.randint(0, spec.vocab, (seqs, program.seq_len + 1), generator=gen)
        train_step(net, opt, [(tokens[:, :-1], tokens[:, 1:])], recorder=recorder)
    return step


def _rank(rank: int, world: int, grid_s: str, model: str, steps: int, out: str, port: int) -> None:
    step_once = training_rank(rank, world, grid_s, model, port)
    import torch.distributed as dist
    from backend.runtime.dist import destroy
    from backend.runtime.recorder import NULL_RECORDER, Recorder
    res = []
    for step in range(2 + steps):
        aligned = step % 2 == 0
        if step >= 2 and aligned:
            dist.barrier()
        rec = Recorder(device="cpu") if step >= 2 else NULL_RECORDER
        t0 = time.perf_counter()
        step_once(rec)
        seconds = time.perf_counter() - t0
        if step >= 2:
            res.append((aligned, seconds, [(s.name, s.kind, s.args.get("axis"), s.duration_s, s.args.get("cpu_us", 0.0) / 1e6)
                                           for s in rec.spans(rank)]))
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(gathered))
    destroy()


def _key(kind: str, axis) -> str:
    return f"{kind}/{axis}" if kind in COLLECTIVES else "compute"


def report(steps: list) -> list[str]:
    """The printed lines, from every rank's steps [(aligned, seconds, [(name, kind, axis, span, on-CPU s)])]."""
    world, n = len(steps), len(steps[0])
    lines = []
    stat: dict[str, list[float]] = {}  # kind -> [upper median, median, mean] summed
    for w0 in range(0, n - 3, 4):
        per: dict[tuple, dict[int, list[float]]] = {}
        for r in range(world):
            for i in range(w0, w0 + 4):
                for name, kind, axis, d, _ in steps[r][i][2]:
                    per.setdefault((name, _key(kind, axis)), {}).setdefault(r, []).append(d)
        for (_, k), by_rank in per.items():
            s = stat.setdefault(k, [0.0, 0.0, 0.0])
            s[0] += statistics.fmean(sorted(v)[len(v) // 2] for v in by_rank.values())
            s[1] += statistics.fmean(statistics.median(v) for v in by_rank.values())
            s[2] += statistics.fmean(x for v in by_rank.values() for x in v)
    lines.append("windows of 4 steps, summed over each kind's ops: upper median / mean, median / mean")
    lines += [f"  {k:20s} {u / m:5.2f} {md / m:5.2f}" for k, (u, md, m) in sorted(stat.items())]
    totals = []
    for i in range(n):
        agg: dict[str, float] = {}
        for r in range(world):
            for _, kind, axis, d, cpu in steps[r][i][2]:
                agg[_key(kind, axis)] = agg.get(_key(kind, axis), 0.0) + d / world
                if cpu:
                    agg["compute on-CPU"] = agg.get("compute on-CPU", 0.0) + cpu / world
        agg["step"] = statistics.fmean(steps[r][i][1] for r in range(world))
        totals.append((steps[0][i][0], agg))
    pairs = [(totals[i][1], totals[i + 1][1]) for i in range(0, n - 1, 2) if totals[i][0] and not totals[i + 1][0]]
    lines.append(f"free over barrier-started steps, {len(pairs)} pairs: median (quartiles)")
    for k in sorted(totals[0][1]):
        ratio = sorted(f[k] / a[k] for a, f in pairs if a.get(k) and k in f)
        if len(ratio) >= 2:
            q = statistics.quantiles(ratio, n=4) if len(ratio) >= 4 else [ratio[0], 0, ratio[-1]]
            lines.append(f"  {k:20s} {statistics.median(ratio):5.2f} ({q[0]:.2f}-{q[2]:.2f})")
    logs = [math.log(a["step"]) for _, a in totals]
    lines.append(f"step time: median {math.exp(statistics.median(logs)):.3f} s, sd of its log {statistics.stdev(logs):.3f}")
    return lines


def main() -> int:
    import torch.multiprocessing as mp
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grid")
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--steps", type=int, default=30, help="recorded steps (even; 4-step windows and pairs)")
    a = ap.parse_args()
    from twin.program.grid import Grid
    world = Grid.parse(a.grid).size
    print(f"{a.model} on {a.grid}, {a.steps} recorded steps; load average at the start {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "steps.pkl")
        mp.spawn(_rank, args=(world, a.grid, a.model, a.steps, out, 29500 + os.getpid() % 2000), nprocs=world)
        steps = pickle.loads(Path(out).read_bytes())
    print("\n".join(report(steps)))
    print(f"load average at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
