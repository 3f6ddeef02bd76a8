"""`backend run` on CPU: the program executor against the backend before it (autograd layers), in one run.

    python benchmarks/bench_backend.py                   # old = the commit before the executor
    python benchmarks/bench_backend.py --old <git ref> --steps 50 --grids 1x1x1x1,2x2x2x1

For each grid, `backend run --model gpt-tiny --steps N --device cpu` runs from this tree (new) and
from the old commit's tree (exported with `git archive` into a temporary folder), alternating old,
new, old, new so that both see the same load; it prints the median step time of each (steps after
the first) and their ratio. Then, in one process on one rank, the Python overhead per op of each:
(step time - time inside the recorded ops) / recorded ops, i.e. what the host spends around the
kernels (dispatch, waits, bookkeeping; the old backend's autograd included).

Timings on a shared machine are noisy: read the ratio, measured in the same run, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PER_OP = r"""
import json, socket, statistics, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
from backend.runtime.dist import ParallelContext
from backend.models.gpt import GPT
from backend.training.optim import make_optimizer, train_step
from backend.runtime.recorder import Recorder, NULL_RECORDER
from twin.program.grid import Grid
from twin.program.model import load_model
from twin.program.program import Options
spec = load_model("gpt-tiny")
ctx = ParallelContext.build(Grid.parse("1x1x1x1"))
model = GPT(spec, ctx, Options())
opt = make_optimizer(model)
g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, spec.vocab, (spec.global_batch, spec.seq_len + 1), generator=g)
batch = [(tokens[:, :-1], tokens[:, 1:])]
out = []
for step in range(int(sys.argv[1])):
    rec = Recorder() if step >= 2 else NULL_RECORDER
    rec.reset()
    t0 = time.perf_counter()
    train_step(model, opt, batch, recorder=rec)
    total = time.perf_counter() - t0
    if step >= 2:
        spans = rec.spans(0)
        inside = sum(s.duration_s for s in spans)
        out.append(((total - inside) / len(spans), total, len(spans)))
    model.recorder = NULL_RECORDER
per_op = statistics.median(o[0] for o in out)
print(json.dumps({"per_op_s": per_op, "step_s": statistics.median(o[1] for o in out), "ops": out[0][2]}))
"""


def old_commit() -> str:
    """The last commit that had the autograd backend (backend/schedule.py)."""
    sha = subprocess.check_output(["git", "log", "-1", "--format=%H", "--diff-filter=D", "--", "backend/schedule.py"],
                                  cwd=ROOT, text=True).strip()
    if not sha:
        raise SystemExit("cannot find the commit that removed backend/schedule.py: pass --old REF")
    return sha + "^"


def export(ref: str, where: Path) -> None:
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)


def step_times(tree: Path, grid: str, steps: int, out: Path) -> list[float]:
    cmd = [sys.executable, "-m", "backend.cli", "run", "--model", "gpt-tiny", "--grid", grid, "--steps", str(steps),
           "--device", "cpu", "--out", str(out), "--log-every", "1"]
    r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{tree}: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [row["step_time_s"] for row in rows[1:]]


def per_op(tree: Path, steps: int) -> dict:
    r = subprocess.run([sys.executable, "-c", PER_OP, str(steps)], cwd=tree, capture_output=True, text=True,
                       timeout=1800, env={**os.environ, "PYTHONPATH": str(tree)})
    if r.returncode:
        raise SystemExit(f"{tree}: per-op measurement failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="git ref of the old backend (default: the commit before the executor)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--grids", default="1x1x1x1,2x2x2x1")
    ap.add_argument("--repeats", type=int, default=2, help="old/new runs per grid (alternating)")
    args = ap.parse_args()
    ref = args.old or old_commit()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        export(ref, old)
        print(f"old: {subprocess.check_output(['git', 'log', '-1', '--format=%h %s', ref], cwd=ROOT, text=True).strip()}")
        print(f"new: this tree ({ROOT})")
        print(f"{'grid':>9} {'old step (ms)':>14} {'new step (ms)':>14} {'new/old':>8}")
        for grid in args.grids.split(","):
            times = {"old": [], "new": []}
            for i in range(args.repeats):
                for name, tree in (("old", old), ("new", ROOT)):
                    times[name] += step_times(tree, grid, args.steps, Path(tmp) / f"{name}-{grid}-{i}")
            o, n = statistics.median(times["old"]), statistics.median(times["new"])
            print(f"{grid:>9} {o * 1e3:14.2f} {n * 1e3:14.2f} {n / o:8.3f}")
        print("\nPython overhead per op, one rank (1x1x1x1, gpt-tiny, model's batch): "
              "(step time - time inside recorded ops) / recorded ops")
        for name, tree in (("old", old), ("new", ROOT)):
            r = per_op(tree, 12)
            print(f"  {name}: {r['per_op_s'] * 1e6:7.1f} us per op over {r['ops']} recorded ops "
                  f"(step {r['step_s'] * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
