"""`backend run`, `finetune` and `memorization-study`: the commands that train, and the line that
sums up a run."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Optional

import typer

from backend.cli.common import (DeviceOpt, InitFromOpt, ProgramOpt, check_launcher_world, grid_of, handles_errors,
                                load_program_file, refuse_fixed)
from topologies.common import TwinError, check_output
from twin.program.flags import (BatchOpt, CacheOpt, ChunksOpt, GridOpt, MicroOpt, ModelOpt, OagOpt, OarOpt, OrsOpt,
                                RecomputeOpt, ScheduleOpt, output_folder)
from twin.program.grid import Grid


CPU_RANKS_PER_HOST = 8  # twin/profiles/cpu.toml: "2 cores x 2.6 GHz x 32 fp32 flop/cycle shared by 8 ranks"


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
        from twin.costs.profile import load_profile
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
    from backend.training.train import format_flops
    pct = f" ({100 * s['flops_per_s'] / peak:.1f} % of peak)" if peak else ""
    loss = "not finite" if s.get("final_loss") is None else f"{s['final_loss']:.4f}"
    if s.get("skipped_steps"):
        loss += f" ({s['skipped_steps']} steps skipped: not finite)"
    return (f"done: {s['steps']} steps, final loss {loss}; {s['tokens_per_s']:,.0f} tokens/s, "
            f"{format_flops(s['flops_per_s'])}{pct}; outputs in {out}/ (log.jsonl, summary.json, trace/)")


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
    schedule: ScheduleOpt = "1f1b", chunks: ChunksOpt = 1,
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
    progress_timeout: Annotated[Optional[float], typer.Option(help="End the run when a rank makes no progress (no step done) for this many seconds; 0: never (default: 20 times the slowest step measured, at least 120 s; 900 s to start and while saving).", show_default=False)] = None,
    skip_nonfinite: Annotated[bool, typer.Option("--skip-nonfinite", help="Skip a step whose loss or gradients are NaN or infinite (default: stop the run naming the step).")] = False,
    program: ProgramOpt = None,
    init_from: InitFromOpt = None,
    tensorboard: Annotated[Optional[str], typer.Option(help="Also write TensorBoard scalars here: loss, learning rate, tokens/s, flop/s, memory.", callback=output_folder)] = None,
    ctx: typer.Context = None,
) -> int:
    """Train a GPT or Llama with the 4D algorithm: `backend run --model gpt-tiny --grid 2x2x2x1 --steps 50`."""
    from backend.launch.launcher import launch
    from backend.training.train import TrainConfig, validate

    refuse_fixed(ctx, program)
    prog = load_program_file(program)  # checked once here (a file of 10^5 ops takes seconds)
    cfg = TrainConfig(model=model, steps=steps, batch=batch, micro_batches=micro_batches,
                      lr=lr, min_lr=min_lr, warmup=warmup, weight_decay=weight_decay,
                      grad_clip=grad_clip, oar=oar, ors=ors, oag=oag, cache_layers=cache_layers,
                      recompute=recompute, data=data, out=out, ckpt_dir=ckpt_dir, ckpt_every=ckpt_every,
                      log_every=log_every, trace_step=trace_step, seed=seed, device=device,
                      goldfish_k=goldfish_k or 0, goldfish_h=goldfish_h, eval_data=eval_data,
                      eval_every=eval_every, eval_batches=eval_batches, schedule=schedule, chunks=chunks,
                      skip_nonfinite=skip_nonfinite, tensorboard=tensorboard,
                      program_file=program, grid=grid_of(prog) if prog else grid)
    if init_from:
        from backend.hf.load import HFCheckpoint
        cfg.init_from, ckpt = init_from, HFCheckpoint(init_from)
        cfg.spec, cfg.hf_config = asdict(ckpt.spec(global_batch=batch or 8)), ckpt.config.raw
    if goldfish_k is not None:
        from backend.training.goldfish import check
        check(goldfish_k, goldfish_h)
    g = Grid.parse(cfg.grid)
    check_launcher_world(g)
    validate(cfg, prog)
    if progress_timeout is not None and not 0 <= progress_timeout < 1e9:
        raise TwinError(f"--progress-timeout must be a number of seconds >= 0, got {progress_timeout}")
    code = launch("run", asdict(cfg), g.size, progress_timeout=progress_timeout)
    from backend.launch.env import env_rank, under_launcher
    line = None if code or (under_launcher() and env_rank()[0] != 0) else summary_line(out)
    if line:
        typer.echo(line)
    return code


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
    from backend.training.finetune import default_lr, default_warmup, finetune_model
    from backend.launch.launcher import launch
    from backend.training.train import TrainConfig, validate

    spec, hf_config, init_from = finetune_model(init_from, ckpt_dir, seq_len, batch)
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
        from topologies.common import check_output
        check_output(export, "--export", folder=True)
    code = launch("run", asdict(cfg), g.size)
    from backend.launch.env import env_rank, under_launcher
    if code or (under_launcher() and env_rank()[0] != 0):
        return code
    line = summary_line(out)
    if line:
        typer.echo(line)
    if export:
        from backend.hf.export import export as write_hf
        files = write_hf(ckpt_dir, export)
        typer.echo(f"exported to {export}/ ({len(files)} files)")
    return 0


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

    from backend.launch.launcher import launch
    from backend.studies.study import NoBrowser, StudyConfig, chart, check

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
    except NoBrowser as e:  # the HTML chart is written; only the PNG is missing
        typer.echo(f"no PNG ({e}); the chart is in {Path(out) / 'memorization.html'}, the figures in {result_file}",
                   err=True)
        return 0
    typer.echo("wrote " + ", ".join(map(str, files)))
    return 0
