"""`backend export`, `generate` and `memorization`: what is done with a trained checkpoint (write it
for Hugging Face, decode from it, measure what it memorized)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from backend.cli.common import handles_errors
from topologies.common import TwinError, check_output, finite_json


@handles_errors
def export_cmd(
    checkpoint: Annotated[str, typer.Option(help="A checkpoint directory of `backend run`/`finetune` (its latest step) or one step_* directory, of a Llama, any grid.")],
    out: Annotated[str, typer.Option(help="The Hugging Face directory to write (config.json, *.safetensors).")],
    dtype: Annotated[str, typer.Option(help="Weights' precision in the files: fp32, bf16 or fp16.")] = "fp32",
    max_shard_gb: Annotated[float, typer.Option(help="Largest safetensors file (GB); larger models are sharded with an index.")] = 5.0,
) -> int:
    """Write a Llama checkpoint as a Hugging Face directory that transformers loads (vocabulary unpadded)."""
    from backend.hf.export import export

    if not 0 < max_shard_gb < 1e6:
        raise TwinError(f"--max-shard-gb must be a positive size in GB, got {max_shard_gb}")
    files = export(checkpoint, out, dtype, int(max_shard_gb * 1e9))
    typer.echo(f"wrote {out}/: " + ", ".join(f.name for f in files))
    return 0


@handles_errors
def generate_cmd(
    checkpoint: Annotated[str, typer.Option(help="A checkpoint directory of `backend run` (its latest step) or one step_* directory, of any grid.")],
    prompt: Annotated[Optional[str], typer.Option(help="Prompt text (byte-level models: its UTF-8 bytes).")] = None,
    prompt_ids: Annotated[Optional[str], typer.Option(help="Prompt as comma-separated token ids (any vocabulary).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Number of tokens to generate.")] = 32,
    temperature: Annotated[float, typer.Option(help="0: greedy; > 0: sample from softmax(logits / T).")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample only among the K most likely tokens (0: all).")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the sampler.")] = 0,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Check that the checkpoint is of this model.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON (ids and text) instead of the text.")] = False,
) -> int:
    """Decode from a checkpoint (gathered into full weights; KV cache): greedy or sampled."""

    import torch

    from backend.models.generate import decode, encode, generate, load_weights

    if (prompt is None) == (prompt_ids is None):
        raise TwinError("give exactly one of --prompt (text) and --prompt-ids (comma-separated token ids)")
    weights = load_weights(checkpoint, model)
    if prompt is not None:
        ids = encode(prompt, weights.spec)
    else:
        try:
            ids = [int(t) for t in prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise TwinError("--prompt-ids takes comma-separated integers, e.g. 10,20,30") from None
    out = generate(weights, torch.tensor(ids), tokens, temperature, top_k, seed).tolist()
    text = decode(out, weights.spec)
    if json_out:
        typer.echo(finite_json({"model": weights.spec.name, "grid": weights.grid, "step": weights.step,
                               "prompt_ids": ids, "ids": out, "text": text}))
    else:
        typer.echo((decode(ids, weights.spec) + text) if text is not None else " ".join(map(str, ids + out)))
    return 0


@handles_errors
def memorization_cmd(
    checkpoint: Annotated[str, typer.Option(help="A checkpoint directory of `backend run` (its latest step) or one step_* directory.")],
    data: Annotated[str, typer.Option(help="Sequences: a .npy of token ids [N, L], or a .bin/byte file cut into --seq-len tokens each.")],
    prefix: Annotated[int, typer.Option(help="Prompt with each sequence's first P tokens.")] = 32,
    suffix: Annotated[Optional[int], typer.Option(help="Decode S tokens greedily and score them (default: the rest of the sequence).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Sequence length for .bin/byte files (default: the model's).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Check that the checkpoint is of this model.")] = None,
    out: Annotated[Optional[str], typer.Option(help="Write the report (per sequence and overall) as JSON here.")] = None,
) -> int:
    """Exact-match rate and ROUGE-L of greedy continuations of training sequences' prefixes."""

    from backend.models.generate import load_weights
    from backend.studies.memorization import check_lengths, load_sequences, measure
    from topologies.common import write_atomic

    if out:
        check_output(out, "--out")
    weights = load_weights(checkpoint, model)
    seqs = load_sequences(data, seq_len or weights.spec.seq_len, weights.spec.vocab)
    check_lengths(seqs.shape[1], prefix, suffix)
    report = measure(weights, seqs, prefix, suffix)
    typer.echo(report.table())
    if out:
        write_atomic(out, finite_json(report.to_dict(), indent=1))
        typer.echo(f"wrote {out}")
    return 0
