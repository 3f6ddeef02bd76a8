"""The `backend` command: real training, replay and microbenchmarks with PyTorch.

Each command checks its input here, in the launching process, then starts the ranks (backend.launch):
on one machine it spawns them itself; under torchrun or srun this process is one rank. Bad input
ends with one line on stderr and exit code 2, on every rank, without a traceback.
"""

from __future__ import annotations

import datetime
import functools
import socket
import sys
from dataclasses import asdict
from typing import Annotated, Optional

import typer

from twin.common import TwinError, check_output
from twin.flags import (BatchOpt, CacheOpt, GridOpt, MicroOpt, ModelOpt, OagOpt, OarOpt, OneLineErrors, OrsOpt,
                        RecomputeOpt)
from twin.grid import Grid
from twin.model import load_model

app = typer.Typer(cls=OneLineErrors, no_args_is_help=True, add_completion=False,
                  help="Train for real with PyTorch, running the same schedule the twin simulates.")


@app.callback()
def _needs_torch() -> None:
    """Every backend command needs PyTorch: say in one line how to install it."""
    try:
        import torch  # noqa: F401
    except ImportError:
        typer.echo("error: the backend needs PyTorch, which is not installed: pip install torch "
                   "(CPU only: pip install torch --index-url https://download.pytorch.org/whl/cpu)", err=True)
        raise typer.Exit(2) from None


CPU_RANKS_PER_HOST = 8  # calibration/profiles/cpu.toml: "2 cores x 2.6 GHz x 32 fp32 flop/cycle shared by 8 ranks"


def summary_line(out: str) -> str | None:
    """One line after `backend run`: where the outputs are, tokens/s, achieved flop/s and % of peak
    (the GPUs' advertised peak, when known; on CPU the peak of the hosts in the cpu profile, whatever
    the rank count). None when the run wrote no summary."""
    import json
    from pathlib import Path

    path = Path(out) / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    ranks = Grid.parse(s["grid"]).size
    peak = None
    try:
        from twin.profile import load_profile
        name = "cpu" if s.get("device", "cpu").startswith("cpu") else None
        if name is None:
            import torch
            gpu = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else ""
            name = next((k for k in ("h200", "gh200", "a100", "mi250x") if k in gpu), None)
            name = {"mi250x": "mi250x-gcd"}.get(name, name)
        if name == "cpu":  # the cpu profile's rank is 1/8 of a host: the hosts' peak, for any rank count
            peak = load_profile(name).peak_flops * CPU_RANKS_PER_HOST * -(-ranks // CPU_RANKS_PER_HOST)
        else:
            peak = load_profile(name).peak_flops * ranks if name else None
    except Exception:  # noqa: BLE001 - the line is still useful without the peak
        peak = None
    from backend.train import format_flops
    pct = f" ({100 * s['flops_per_s'] / peak:.1f} % of peak)" if peak else ""
    return (f"done: {s['steps']} steps, final loss {s['final_loss']:.4f}; {s['tokens_per_s']:,.0f} tokens/s, "
            f"{format_flops(s['flops_per_s'])}{pct}; outputs in {out}/ (log.jsonl, summary.json, trace/)")


def handles_errors(fn):
    """Turn bad input (TwinError, a missing file) into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            code = fn(*args, **kwargs)
        except (TwinError, OSError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        if code:
            raise typer.Exit(code if code > 0 else 1)

    return wrapper


def check_launcher_world(grid: Grid) -> None:
    from backend.launch import check_world_size
    check_world_size(grid.size, str(grid))


DeviceOpt = Annotated[str, typer.Option(help="cpu (gloo) or cuda (NCCL/RCCL).")]
ProgramOpt = Annotated[Optional[str], typer.Option(help="Run this program file (`twin program --json`): it fixes the model, grid, batch and switches.")]


def program_grid(program_file: str | None, grid: str) -> str:
    """The grid to launch: the program file's (validated here, before any rank starts) or --grid."""
    if not program_file:
        return grid
    from twin.programfile import load_program
    return str(load_program(program_file).grid)
DtypeOpt = Annotated[str, typer.Option(help="GEMM precision: fp32, bf16 or fp16.")]
InitFromOpt = Annotated[Optional[str], typer.Option(help="Start from the weights of this Hugging Face Llama directory (config.json and *.safetensors); its config is the model.")]


@app.command("run")
@handles_errors
def run_cmd(
    model: ModelOpt = "gpt-tiny",
    grid: GridOpt = "1x1x1x1",
    steps: Annotated[int, typer.Option(help="Number of training steps.")] = 50,
    batch: BatchOpt = None,
    micro_batches: MicroOpt = 1,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 1e-3,
    min_lr: Annotated[float, typer.Option(help="Learning rate at the end of the cosine decay.")] = 1e-4,
    warmup: Annotated[int, typer.Option(help="Linear warm-up steps.")] = 10,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = 0.1,
    grad_clip: Annotated[float, typer.Option(help="Clip the global gradient norm to this; 0: off.")] = 1.0,
    oar: OarOpt = True, ors: OrsOpt = True, oag: OagOpt = True,
    cache_layers: CacheOpt = 0, recompute: RecomputeOpt = True,
    data: Annotated[str, typer.Option(help="'synthetic', a .bin of uint16 token ids, or any file read as bytes.")] = "synthetic",
    out: Annotated[str, typer.Option(help="Directory for log.jsonl, summary.json and trace/ (per-rank traces).")] = "runs/latest",
    ckpt_dir: Annotated[Optional[str], typer.Option(help="Checkpoint directory; a run resumes from its latest checkpoint.")] = None,
    ckpt_every: Annotated[int, typer.Option(help="Save a checkpoint every N steps (0: never).")] = 0,
    log_every: Annotated[int, typer.Option(help="Log every N steps.")] = 1,
    trace_step: Annotated[Optional[int], typer.Option(help="Step whose ops are written to trace/ (default: the last).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the weights and the data order.")] = 0,
    device: DeviceOpt = "cpu",
    goldfish_k: Annotated[Optional[int], typer.Option(help="Goldfish loss: leave about one target in K out of the loss (K >= 1; default: off).")] = None,
    goldfish_h: Annotated[int, typer.Option(help="Goldfish loss: a target is dropped by a hash of the H tokens before it.")] = 13,
    eval_data: Annotated[Optional[str], typer.Option(help="Held-out data (same forms as --data); its loss goes to the log.")] = None,
    eval_every: Annotated[int, typer.Option(help="Evaluate the held-out loss every N steps (0: after the last step only).")] = 0,
    eval_batches: Annotated[int, typer.Option(help="Global batches of held-out windows per evaluation.")] = 4,
    progress_timeout: Annotated[float, typer.Option(help="End the run when a rank makes no progress (no step done) for this many seconds; 0: never.")] = 900.0,
    program: ProgramOpt = None,
    init_from: InitFromOpt = None,
) -> int:
    """Train a GPT or Llama with the 4D algorithm: `backend run --model gpt-tiny --grid 2x2x2x1 --steps 50`."""
    from backend.launch import launch
    from backend.train import TrainConfig, validate

    cfg = TrainConfig(model=model, steps=steps, batch=batch, micro_batches=micro_batches,
                      lr=lr, min_lr=min_lr, warmup=warmup, weight_decay=weight_decay,
                      grad_clip=grad_clip, oar=oar, ors=ors, oag=oag, cache_layers=cache_layers,
                      recompute=recompute, data=data, out=out, ckpt_dir=ckpt_dir, ckpt_every=ckpt_every,
                      log_every=log_every, trace_step=trace_step, seed=seed, device=device,
                      goldfish_k=goldfish_k or 0, goldfish_h=goldfish_h, eval_data=eval_data,
                      eval_every=eval_every, eval_batches=eval_batches,
                      program_file=program, grid=program_grid(program, grid))
    if init_from:
        from backend.hf import HFCheckpoint
        cfg.init_from, ckpt = init_from, HFCheckpoint(init_from)
        cfg.spec, cfg.hf_config = asdict(ckpt.spec(global_batch=batch or 8)), ckpt.config.raw
    if goldfish_k is not None:
        from backend.goldfish import check
        check(goldfish_k, goldfish_h)
    g = Grid.parse(cfg.grid)
    check_launcher_world(g)
    validate(cfg)
    if not 0 <= progress_timeout < 1e9:
        raise TwinError(f"--progress-timeout must be a number of seconds >= 0, got {progress_timeout}")
    code = launch("run", asdict(cfg), g.size, progress_timeout=progress_timeout)
    from backend.launch import env_rank, under_launcher
    line = None if code or (under_launcher() and env_rank()[0] != 0) else summary_line(out)
    if line:
        typer.echo(line)
    return code


@app.command("replay")
@handles_errors
def replay_cmd(
    model: ModelOpt = "gpt-tiny",
    grid: GridOpt = "1x1x1x1",
    steps: Annotated[int, typer.Option(help="Iterations to replay (the last one is traced).")] = 2,
    batch: BatchOpt = None,
    micro_batches: MicroOpt = 1,
    oar: OarOpt = True, ors: OrsOpt = True, oag: OagOpt = True,
    cache_layers: CacheOpt = 0, recompute: RecomputeOpt = True,
    out: Annotated[str, typer.Option(help="Trace folder (one Chrome trace per rank; Perfetto and HTA read it).")] = "runs/replay-trace",
    device: DeviceOpt = "cpu",
    dtype: Annotated[str, typer.Option(help="auto (bf16 on cuda, fp32 on cpu), fp32 or bf16.")] = "auto",
    program: ProgramOpt = None,
) -> int:
    """Execute the twin's program op by op with random tensors (GEMMs and collectives) and trace it."""
    from backend.launch import launch
    from backend.replay import ReplayConfig, validate

    cfg = ReplayConfig(model=model, steps=steps, batch=batch, micro_batches=micro_batches,
                       oar=oar, ors=ors, oag=oag, cache_layers=cache_layers, recompute=recompute,
                       out=out, device=device, dtype=dtype, program_file=program,
                       grid=program_grid(program, grid))
    g = Grid.parse(cfg.grid)
    check_launcher_world(g)
    validate(cfg)
    check_output(out, "--out", folder=True)
    return launch("replay", asdict(cfg), g.size)


@app.command("finetune")
@handles_errors
def finetune_cmd(
    data: Annotated[str, typer.Option(help="Training data: a .jsonl of {\"prompt\": ..., \"response\": ...} lines (the loss counts response tokens only), or a text file.")],
    init_from: InitFromOpt = None,
    grid: GridOpt = "1x1x1x1",
    steps: Annotated[int, typer.Option(help="Number of training steps.")] = 100,
    batch: Annotated[int, typer.Option(help="Global batch in sequences (examples) per step.")] = 8,
    micro_batches: MicroOpt = 1,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sequence (default: the config's max_position_embeddings, at most 2048).")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Peak learning rate (default: 2e-5 x sqrt(4096 / hidden): 2e-5 for 8B, 1e-5 for 405B).")] = None,
    min_lr: Annotated[Optional[float], typer.Option(help="Learning rate at the end of the cosine decay (default: lr / 10).")] = None,
    warmup: Annotated[Optional[int], typer.Option(help="Linear warm-up steps (default: 3 % of the steps, at least 1).")] = None,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = 0.0,
    grad_clip: Annotated[float, typer.Option(help="Clip the global gradient norm to this; 0: off.")] = 1.0,
    eval_data: Annotated[Optional[str], typer.Option(help="Held-out data (.jsonl examples or text); default: 5 % of the examples of --data.")] = None,
    eval_every: Annotated[int, typer.Option(help="Held-out loss every N steps (and after the last).")] = 10,
    out: Annotated[str, typer.Option(help="Directory for log.jsonl, summary.json and trace/.")] = "runs/finetune",
    ckpt_dir: Annotated[Optional[str], typer.Option(help="Checkpoint directory; a fine-tune resumes from its latest checkpoint (then --init-from may be left out).")] = None,
    ckpt_every: Annotated[Optional[int], typer.Option(help="Save a checkpoint every N steps (default: at the end only).")] = None,
    export: Annotated[Optional[str], typer.Option(help="After the last step, write the model as a Hugging Face directory here (needs --ckpt-dir).")] = None,
    log_every: Annotated[int, typer.Option(help="Log every N steps.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the data order.")] = 0,
    device: DeviceOpt = "cpu",
    recompute: RecomputeOpt = True,
) -> int:
    """Fine-tune a Llama from a Hugging Face checkpoint: the loss on responses only, a lower learning rate,
    warm-up then cosine decay, a held-out loss in the log."""
    from backend.launch import launch
    from backend.train import TrainConfig, validate

    spec, hf_config, init_from = finetune_model(init_from, ckpt_dir, seq_len, batch)
    from backend.finetune import default_lr, default_warmup
    lr = lr if lr is not None else default_lr(spec.hidden)
    if export and not ckpt_dir:
        raise TwinError("--export writes the final checkpoint: give --ckpt-dir too")
    cfg = TrainConfig(model=spec.name, spec=asdict(spec), hf_config=hf_config, init_from=init_from, grid=grid,
                      steps=steps, batch=batch, micro_batches=micro_batches, lr=lr,
                      min_lr=min_lr if min_lr is not None else lr / 10,
                      warmup=warmup if warmup is not None else default_warmup(steps), weight_decay=weight_decay,
                      grad_clip=grad_clip, recompute=recompute, data=data, out=out, ckpt_dir=ckpt_dir,
                      ckpt_every=ckpt_every if ckpt_every is not None else (steps if ckpt_dir else 0),
                      log_every=log_every, seed=seed, device=device, eval_data=eval_data, eval_every=eval_every,
                      eval_holdout=0.05)
    g = Grid.parse(grid)
    check_launcher_world(g)
    validate(cfg)
    if export:
        from twin.common import check_output
        check_output(export, "--export", folder=True)
    code = launch("run", asdict(cfg), g.size)
    from backend.launch import env_rank, under_launcher
    if code or (under_launcher() and env_rank()[0] != 0):
        return code
    line = summary_line(out)
    if line:
        typer.echo(line)
    if export:
        from backend.hf import export as write_hf
        files = write_hf(ckpt_dir, export)
        typer.echo(f"exported to {export}/ ({len(files)} files)")
    return 0


def finetune_model(init_from: str | None, ckpt_dir: str | None, seq_len: int | None, batch: int):
    """The model of a fine-tune, its Hugging Face config and the directory it started from (its
    tokenizer's): from --init-from, else from the checkpoint it resumes (raises TwinError when there
    is neither)."""
    from pathlib import Path

    from twin.model import ModelSpec

    if seq_len is not None and seq_len < 1:
        raise TwinError(f"--seq-len must be >= 1, got {seq_len}")
    if init_from:
        from backend.hf import HFCheckpoint
        ckpt = HFCheckpoint(init_from)
        return ckpt.spec(seq_len, batch), ckpt.config.raw, init_from
    from backend import checkpoint
    path = checkpoint.latest(ckpt_dir) if ckpt_dir else None
    if path is None:
        raise TwinError("give --init-from HF_DIR (a Hugging Face Llama directory), or a --ckpt-dir holding a "
                        "checkpoint of a fine-tune to resume")
    meta = checkpoint.read_meta(path)
    saved = meta.get("config", {}) if isinstance(meta.get("config"), dict) else {}
    spec = ModelSpec(**meta["model"])
    if seq_len is not None and seq_len != spec.seq_len:
        raise TwinError(f"the checkpoint in {ckpt_dir} was trained with --seq-len {spec.seq_len}, not {seq_len}")
    source = saved.get("init_from")
    return spec, saved.get("hf_config"), source if isinstance(source, str) and Path(source).is_dir() else None


@app.command("export")
@handles_errors
def export_cmd(
    checkpoint: Annotated[str, typer.Option(help="A checkpoint directory of `backend run`/`finetune` (its latest step) or one step_* directory, of a Llama, any grid.")],
    out: Annotated[str, typer.Option(help="The Hugging Face directory to write (config.json, *.safetensors).")],
    dtype: Annotated[str, typer.Option(help="Weights' precision in the files: fp32, bf16 or fp16.")] = "fp32",
    max_shard_gb: Annotated[float, typer.Option(help="Largest safetensors file (GB); larger models are sharded with an index.")] = 5.0,
) -> int:
    """Write a Llama checkpoint as a Hugging Face directory that transformers loads (vocabulary unpadded)."""
    from backend.hf import export

    if not 0 < max_shard_gb < 1e6:
        raise TwinError(f"--max-shard-gb must be a positive size in GB, got {max_shard_gb}")
    files = export(checkpoint, out, dtype, int(max_shard_gb * 1e9))
    typer.echo(f"wrote {out}/: " + ", ".join(f.name for f in files))
    return 0


def default_bench_out(device: str) -> str:
    day = datetime.date.today().isoformat()
    return f"calibration/measurements/bench-{socket.gethostname()}-{device}-{day}.json"


@app.command("bench")
@handles_errors
def bench_cmd(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Also time this model's local GEMM shapes on --grid.")] = "gpt-tiny",
    grid: GridOpt = "1x1x1x1",
    squares: Annotated[str, typer.Option(help="Comma-separated sizes of square GEMMs to time.")] = "1024",
    sizes_mib: Annotated[str, typer.Option(help="Comma-separated collective payloads in MiB.")] = "0.0625,1,16",
    gemm: Annotated[bool, typer.Option(help="Time GEMMs (every rank at once).")] = True,
    comm: Annotated[bool, typer.Option(help="Time collectives over each axis of size > 1.")] = True,
    ops: Annotated[bool, typer.Option(help="Time small eager ops (per-op overhead, memory bandwidth).")] = True,
    overlap: Annotated[bool, typer.Option(help="Time a GEMM while an all-reduce runs on each axis.")] = True,
    train_steps: Annotated[int, typer.Option(help="Record this many training steps of --model on --grid: every op's cost inside training (0: none).")] = 4,
    layouts: Annotated[str, typer.Option(help="Model GEMMs in: all (NN, NT, TN) or program (the program's layout).")] = "all",
    all_grids: Annotated[bool, typer.Option(help="Model GEMM shapes of every valid grid with this many ranks.")] = False,
    batch: BatchOpt = None,
    min_time: Annotated[float, typer.Option(help="Seconds to spend timing each entry.")] = 0.2,
    out: Annotated[Optional[str], typer.Option(help="JSON table to write (default: calibration/measurements/bench-<host>-<device>-<date>.json).")] = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "fp32",
) -> int:
    """Microbenchmarks: GEMM flop/s by shape and layout; collective bandwidth by size per axis."""
    from backend.launch import launch

    g = Grid.parse(grid)
    if model:
        load_model(model)
    if device not in ("cpu", "cuda") or dtype not in ("fp32", "bf16", "fp16") or layouts not in ("all", "program"):
        raise TwinError("--device must be cpu or cuda, --dtype fp32, bf16 or fp16, --layouts all or program")
    if not 0 <= train_steps <= 100:
        raise TwinError(f"--train-steps must be in 0..100, got {train_steps}")
    if min_time <= 0 or (batch is not None and batch < 1):
        raise TwinError("--min-time must be positive and --batch at least 1")
    try:
        sq = [int(s) for s in squares.split(",") if s.strip()]
        sizes = [float(s) for s in sizes_mib.split(",") if s.strip()]
    except ValueError:
        raise TwinError("--squares takes integers and --sizes-mib numbers, comma-separated") from None
    if not all(0 < n <= 65536 for n in sq) or not all(0 < m <= 65536 for m in sizes):  # also refuses nan, inf
        raise TwinError("--squares must be sizes in 1..65536 and --sizes-mib payloads in (0, 65536] MiB")
    if not min_time < 3600:
        raise TwinError(f"--min-time must be under an hour per entry, got {min_time}")
    check_launcher_world(g)
    if model:
        g.validate(load_model(model), batch=batch)
    cfg = {"model": model, "grid": grid, "squares": sq, "sizes_mib": sizes, "gemm": gemm, "comm": comm,
           "ops": ops, "overlap": overlap, "steps": train_steps if model else 0, "layouts": layouts, "all_grids": all_grids, "batch": batch,
           "min_time_s": min_time, "out": out or default_bench_out(device), "device": device, "dtype": dtype}
    check_output(cfg["out"], "--out")  # before the work, not after it
    return launch("bench", cfg, g.size)


@app.command("generate")
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
    import json

    import torch

    from backend.generate import decode, encode, generate, load_weights

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
        typer.echo(json.dumps({"model": weights.spec.name, "grid": weights.grid, "step": weights.step,
                               "prompt_ids": ids, "ids": out, "text": text}))
    else:
        typer.echo((decode(ids, weights.spec) + text) if text is not None else " ".join(map(str, ids + out)))
    return 0


@app.command("memorization")
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
    import json

    from backend.generate import load_weights
    from backend.memorization import check_lengths, load_sequences, measure
    from twin.common import write_atomic

    if out:
        check_output(out, "--out")
    weights = load_weights(checkpoint, model)
    seqs = load_sequences(data, seq_len or weights.spec.seq_len, weights.spec.vocab)
    check_lengths(seqs.shape[1], prefix, suffix)
    report = measure(weights, seqs, prefix, suffix)
    typer.echo(report.table())
    if out:
        write_atomic(out, json.dumps(report.to_dict(), indent=1))
        typer.echo(f"wrote {out}")
    return 0


@app.command("memorization-study")
@handles_errors
def memorization_study_cmd(
    epochs: Annotated[int, typer.Option(help="Epochs over the training sequences.")] = 100,
    eval_every: Annotated[int, typer.Option(help="Measure memorization and held-out loss every N epochs.")] = 5,
    canaries: Annotated[int, typer.Option(help="Random-byte training sequences.")] = 32,
    texts: Annotated[int, typer.Option(help="Pseudo-text training sequences.")] = 32,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 64,
    prefix: Annotated[int, typer.Option(help="Prompt with the first P tokens of each training sequence.")] = 32,
    suffix: Annotated[int, typer.Option(help="Decode and score the next S tokens.")] = 32,
    goldfish_k: Annotated[int, typer.Option(help="Goldfish loss: drop about one target in K.")] = 4,
    goldfish_h: Annotated[int, typer.Option(help="Goldfish loss: hash the H tokens before a target.")] = 13,
    lr: Annotated[float, typer.Option(help="Peak learning rate (cosine decay to a tenth of it).")] = 3e-3,
    batch: Annotated[int, typer.Option(help="Sequences per step.")] = 16,
    threads: Annotated[int, typer.Option(help="Torch threads per rank (0: torch's default).")] = 0,
    grid: GridOpt = "1x1x1x1",
    seed: Annotated[int, typer.Option(help="Seed of the data, the weights and the order.")] = 0,
    out: Annotated[str, typer.Option(help="Directory for study.json and the chart.")] = "runs/memorization",
    png: Annotated[Optional[str], typer.Option(help="Also write the chart as PNG here (headless Chromium).")] = None,
) -> int:
    """Train the same small model with the standard and the goldfish loss; memorization against epochs."""
    import json
    from pathlib import Path

    from backend.launch import launch
    from backend.study import StudyConfig, chart, check

    cfg = StudyConfig(epochs=epochs, eval_every=eval_every, canaries=canaries, texts=texts, seq_len=seq_len,
                      prefix=prefix, suffix=suffix, goldfish_k=goldfish_k, goldfish_h=goldfish_h, lr=lr,
                      min_lr=lr / 10, batch=batch, threads=threads, grid=grid, seed=seed, out=out)
    check(cfg)
    g = Grid.parse(grid)
    check_launcher_world(g)
    check_output(out, "--out", folder=True)
    if png:
        check_output(png, "--png")
    code = launch("memorization-study", asdict(cfg), g.size)
    result_file = Path(out) / "study.json"
    if code or not result_file.is_file():
        return code
    try:
        files = chart(json.loads(result_file.read_text()), Path(out) / "memorization.html", png)
    except ImportError as e:  # plotly or playwright missing: the figures are in study.json
        typer.echo(f"no chart ({e}); the figures are in {result_file}", err=True)
        return 0
    typer.echo("wrote " + ", ".join(map(str, files)))
    return 0


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
