"""The 4D model of a spec's architecture: the one place that picks the class, so that
backend.models.llama builds on backend.models.gpt and nothing imports back up."""

from __future__ import annotations

from backend.models.gpt import GPT
from backend.models.llama import Llama
from backend.runtime.dist import ParallelContext
from twin.program.model import ModelSpec


def make_model(spec: ModelSpec, ctx: ParallelContext, **kw) -> GPT:
    """The 4D model of `spec`'s architecture on this rank: a GPT, or a Llama (same interface; keyword
    arguments as GPT's)."""
    if spec.is_llama:
        return Llama(spec, ctx, **kw)
    return GPT(spec, ctx, **kw)
