"""The twin's memory per rank (twin/predict/memory.py) against the backend's measured peak, Llama next to GPT.

    python benchmarks/llama_memory.py

llama-small and gpt-small on a few CPU grids (gloo ranks, fp32): the peak bytes torch's memory tracker
sees during a training step (parameters, gradients, AdamW state, activations, gathered weights), and
the twin's prediction with activation_bytes = 4. Prints the error of the prediction per grid.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from backend_helpers import run_on_grid  # noqa: E402
from backend.runtime.memory import peak_memory  # noqa: E402
from backend.models.build import make_model  # noqa: E402
from backend.training.optim import local_batch, make_optimizer, micro_batches, train_step  # noqa: E402
from twin.program.grid import Grid  # noqa: E402
from twin.predict.memory import memory_per_gpu  # noqa: E402
from twin.program.model import load_model  # noqa: E402
from twin.program.program import Options  # noqa: E402

GRIDS = [("1x1x1x1", Options()), ("2x2x1x1", Options()), ("1x2x2x1", Options()), ("1x1x2x1", Options(recompute=False))]


def measure(ctx, name: str, options: Options, batch: int) -> int:
    """Peak bytes of this rank during its second training step (the first warms up)."""
    spec = load_model(name)
    model = make_model(spec, ctx, options=options)
    opt = make_optimizer(model)
    tokens = torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=torch.Generator().manual_seed(0))
    mine = local_batch(tokens, model)
    mbs = micro_batches(mine, mine, options.micro_batches)
    train_step(model, opt, mbs)
    _, peak = peak_memory(lambda: train_step(model, opt, mbs), model, opt)
    return peak


def main() -> None:
    for name in ("llama-small", "gpt-small"):
        spec = load_model(name)
        for grid, opts in GRIDS:
            peak = max(run_on_grid(grid, measure, name, opts, 16))
            pred = memory_per_gpu(spec, Grid.parse(grid), opts, 16, spec.seq_len, activation_bytes=4).total
            print(f"{name} {grid} recompute={opts.recompute}: measured {peak / 2**20:.2f} MiB, "
                  f"twin {pred / 2**20:.2f} MiB, error {100 * (pred / peak - 1):+.1f} %")


if __name__ == "__main__":
    main()
