"""Save and load cost of a checkpoint: torch.distributed.checkpoint (DCP, any grid resumes it) against
the per-rank torch.save files of before (its own grid only), on one model and grid, on this machine.

    python benchmarks/bench_checkpoint.py                       # gpt-small on 1x1x2x2, 5 repetitions
    python benchmarks/bench_checkpoint.py --model gpt-tiny --grid 2x2x2x1 --reps 3 --dir /tmp/ck

Each repetition saves a checkpoint of the same state in each format (the order alternates) and then
loads each one the way `backend run` resumes (checksums checked, the newest good step chosen, tensors
into the model and AdamW), every rank at once with gloo. A time is the slowest rank's, from a barrier
to a barrier. Prints the median, the least and the most of each, and the ratios of the medians
(DCP / per-rank): the machine may be shared, so read the spread before the ratio. Saves include the
fsyncs and the checksums of both formats.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn) -> float:
    """Seconds of fn() on the slowest rank, between two barriers."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from backend.models.build import make_model
    from backend.runtime import checkpoint
    from backend.runtime.dist import ParallelContext
    from backend.training import state as dcp_state
    from backend.training.finetune import make_data
    from backend.training.optim import make_optimizer
    from backend.training.train import TrainConfig
    from twin.program.grid import Grid

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = TrainConfig(model=args.model, grid=args.grid)
    program = cfg.program()
    ctx = ParallelContext.build(Grid.parse(args.grid))
    model = make_model(program.model, ctx, program=program)
    optimizer = make_optimizer(model)
    for p in model.parameters():  # AdamW state as after a step (what a checkpoint holds)
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    loader, _ = make_data(cfg, program.model, program.batch, ctx)
    meta = checkpoint.make_meta(1, ctx.grid, model.spec)
    root = Path(args.dir)
    old_dir, new_dir = root / "per-rank", root / "dcp"

    def save_old():
        st = {"step": 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
              "data": loader.state_dict(), "rng": checkpoint.rng_state()}
        checkpoint.save(old_dir, 1, rank, st, meta, keep=1)

    def save_new():
        checkpoint.save(new_dir, 1, rank, dcp_state.state_dict(model, optimizer, loader, cfg, ctx, 1), meta, keep=1,
                        sharded=True)

    def load_old():
        path = checkpoint.find_resume(old_dir, rank)
        saved = checkpoint.load(path, rank, ctx.grid, model.spec)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["data"])

    def load_new():
        path = checkpoint.find_resume(new_dir, rank)
        dcp_state.load(path, model, optimizer, loader, cfg, ctx)

    times = {k: [] for k in ("save per-rank", "save dcp", "load per-rank", "load dcp")}
    for i in range(args.reps):
        order = [("per-rank", save_old), ("dcp", save_new)]
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            times[f"save {name}"].append(_timed(fn))
        loads = [("per-rank", load_old), ("dcp", load_new)]
        for name, fn in (loads if i % 2 == 0 else loads[::-1]):
            times[f"load {name}"].append(_timed(fn))
    if rank == 0:
        sizes = {name: sum(f.stat().st_size for f in next((root / name).glob("step_*")).iterdir())
                 for name in ("per-rank", "dcp")}
        queue.put((times, sizes))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--grid", default="1x1x2x2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed after)")
    args = ap.parse_args()
    import multiprocessing as mp

    from twin.program.grid import Grid

    world = Grid.parse(args.grid).size
    tmp = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench-ckpt-")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    times, sizes = queue.get(timeout=3600)
    for p in procs:
        p.join()
    if tmp:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"{args.model} on grid {args.grid}, {args.reps} repetitions; checkpoint bytes: per-rank "
          f"{sizes['per-rank'] / 1e6:.1f} MB, dcp {sizes['dcp'] / 1e6:.1f} MB")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:14s} median {med[k]:7.3f} s   least {min(v):7.3f} s   most {max(v):7.3f} s")
    for what in ("save", "load"):
        print(f"{what}: dcp / per-rank = {med[f'{what} dcp'] / med[f'{what} per-rank']:.2f} (medians)")


if __name__ == "__main__":
    main()
