"""The Llama 3.1 405B fine-tuning study on Frontier: the smallest allocation that fits, and the best
grid's time per iteration, at sequence lengths 2,048 and 8,192.

    python benchmarks/llama_405b.py [--tokens 4194304] [--seqs 2048,8192] [--scale 1,2,4]

For each sequence length (global batch: `--tokens` per iteration, 4M by default, as 2,048 x 2,048):
1. the smallest GCD count (a multiple of 8, whole nodes) for which some valid 4D grid fits in a
   GCD's 64 GB with some number of micro-batches (twin.predict.memory, every grid of every count checked);
2. `twin search` (analytical ranking, best grids simulated) at that count and at `--scale` times it,
   each with the fewest micro-batches that let some grid fit, printing each best grid's iteration
   time, flop/s and memory breakdown.
Every figure is the twin's prediction (Frontier system and MI250X profile as shipped); nothing here
is measured. The equivalent single commands are printed with the results.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from topologies.common import TwinError  # noqa: E402
from twin.predict.memory import GIB, memory_per_gpu  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from twin.program.program import Options  # noqa: E402
from twin.predict.search import candidate_grids  # noqa: E402
from twin.predict.auto import search  # noqa: E402
from twin.predict.study import prepare  # noqa: E402
from topologies.system import load_system  # noqa: E402


def fewest_micro_batches(model, seq: int, batch: int, hbm: float, gpus: int):
    """(micro_batches, grid, memory) of the grid of `gpus` GCDs that fits with the fewest micro-batches
    (then the least memory); None if no grid fits with any micro-batch count."""
    best = None
    for grid in candidate_grids(gpus):
        mb = 1
        while best is None or mb <= best[0]:
            try:
                grid.validate(model, batch=batch, micro_batches=mb, seq_len=seq)
            except TwinError:
                break
            mem = memory_per_gpu(model, grid, Options(micro_batches=mb), batch, seq)
            if mem.total <= hbm:
                if best is None or (mb, mem.total) < (best[0], best[2].total):
                    best = (mb, grid, mem)
                break
            mb *= 2
    return best


def smallest_fit(model, seq: int, batch: int, hbm: float, max_gpus: int):
    """(gpus, micro_batches, grid, memory) of the smallest whole-node allocation that fits."""
    for gpus in range(8, max_gpus + 1, 8):
        fit = fewest_micro_batches(model, seq, batch, hbm, gpus)
        if fit is not None:
            return (gpus, *fit)
    return None


def breakdown(mem) -> str:
    d = mem.as_dict()
    return ", ".join(f"{k} {v / GIB:.1f}" for k, v in d.items()) + " GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048 * 2048, help="global batch in tokens")
    ap.add_argument("--seqs", default="2048,8192")
    ap.add_argument("--scale", default="1,2,4", help="also search at these multiples of the smallest count")
    ap.add_argument("--max-gpus", type=int, default=4096)
    args = ap.parse_args()
    model = load_model("llama-405b")
    system = load_system("frontier")
    hbm = system.gpu.hbm_bytes
    print(f"{model.name}: {model.parameters(model.vocab) / 1e9:.1f} B parameters; frontier GCD {hbm / GIB:.1f} GiB")
    for seq in (int(s) for s in args.seqs.split(",")):
        batch = args.tokens // seq
        t0 = time.perf_counter()
        fit = smallest_fit(model, seq, batch, hbm, args.max_gpus)
        if fit is None:
            print(f"seq {seq}: nothing fits up to {args.max_gpus} GCDs")
            continue
        gpus, mb, grid, mem = fit
        print(f"\nseq {seq}, global batch {batch} sequences ({batch * seq:,} tokens)")
        print(f"  smallest allocation that fits: {gpus} GCDs ({gpus // 8} nodes), grid {grid}, "
              f"{mb} micro-batch(es): {breakdown(mem)}  [{time.perf_counter() - t0:.1f} s]")
        for k in (int(s) for s in args.scale.split(",")):
            n = gpus * k
            mb = fewest_micro_batches(model, seq, batch, hbm, n)[0]
            study = prepare("frontier", model, n, batch, seq, Options(micro_batches=mb))
            try:
                cands = search(study, top=4, simulate_top=2)
            except TwinError as e:
                print(f"  {n} GCDs: {e}")
                continue
            sims = [c for c in cands if c.simulated_s is not None]
            best = min(sims, key=lambda c: c.simulated_s)
            r = best.result
            m = memory_per_gpu(model, best.grid, Options(micro_batches=mb), batch, seq)
            print(f"  {n} GCDs, {mb} micro-batch(es): best grid {best.grid}: {r.iteration_time_s:.2f} s per iteration, "
                  f"{r.flops_per_s / 1e15:.1f} PF/s ({r.percent_of_peak:.1f} % of peak); {breakdown(m)}")
            b = r.breakdown_s
            print(f"      compute {b['compute']:.2f} s, exposed comm " +
                  ", ".join(f"{a} {v:.2f}" for a, v in b["exposed_comm"].items()) + f", idle {b['idle']:.2f} s")
            print(f"      twin simulate --system frontier --model llama-405b --gpus {n} --grid {best.grid} "
                  f"--batch {batch} --seq {seq} --micro-batches {mb}")


if __name__ == "__main__":
    main()
