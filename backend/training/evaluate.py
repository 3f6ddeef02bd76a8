"""Held-out evaluation during training: the mean loss of a fixed set of held-out windows.

`HeldOut(spec, ...)` draws `batches` global batches of windows from the held-out source once (the
same windows at every evaluation, shard by shard as training batches are split), and `loss(model)`
runs the forward pass on them without gradients: the mean cross-entropy over all their tokens (the
goldfish mask is never applied to held-out data), the same value on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from topologies.common import TwinError
from twin.program.model import ModelSpec

if TYPE_CHECKING:
    from backend.runtime.dist import ParallelContext
    from backend.models.gpt import GPT

EVAL_SEED = 0xE7A1  # seed of the held-out windows' offsets (not the run's: the same windows for every run)


def check_eval(spec_str: str, every: int, batches: int, model: ModelSpec) -> None:
    """Raise TwinError with one clear line when the held-out flags cannot work."""
    from backend.training.data import open_source

    if every < 0 or batches < 1:
        raise TwinError(f"--eval-every must be >= 0 and --eval-batches >= 1, got {every} and {batches}")
    source = open_source(spec_str, model.vocab, 0)
    if len(source) < model.seq_len + 2:
        raise TwinError(f"held-out data {source.name} has {len(source)} tokens, fewer than one sequence "
                        f"of {model.seq_len}+1 tokens of {model.name}")


class HeldOut:
    """The held-out windows of this rank and the loss of a model on them."""

    def __init__(self, spec_str: str, model: ModelSpec, global_batch: int, ctx: ParallelContext,
                 batches: int = 4, seed: int = 0):
        from backend.training.data import ShardedLoader, open_source

        source = open_source(spec_str, model.vocab, seed)
        loader = ShardedLoader(source, global_batch, model.seq_len, ctx.batch_shard, ctx.batch_shards, 1,
                               EVAL_SEED)
        self.batches = [b for step in range(batches) for b in loader.batches(step, ctx.device)]

    @staticmethod
    def due(step: int, every: int, last: int) -> bool:
        """Evaluate after `step`? Every `every` steps (0: never in between) and after the last one."""
        return step == last or (every > 0 and step % every == 0)

    def loss(self, model: GPT) -> float:
        """Mean loss over the held-out tokens (a collective: every rank calls it)."""
        return held_out_loss(model, [(b.inputs, b.targets) for b in self.batches])


def held_out_loss(model: GPT, batches: list) -> float:
    """Mean loss of `model` over this rank's (tokens, targets) batches, averaged over the global batch.

    Each batch must hold the same number of tokens on every rank (true of ShardedLoader batches)."""
    import torch

    from backend.runtime.recorder import NULL_RECORDER

    saved, model.recorder = model.recorder, NULL_RECORDER
    total = 0.0
    try:
        with torch.no_grad():
            for tokens, targets in batches:
                total += float(model(tokens, targets))
    finally:
        model.recorder = saved
    return total / max(len(batches), 1)
