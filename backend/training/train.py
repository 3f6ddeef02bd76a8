"""The training loop: config, learning-rate schedule, logging, checkpoints, traces.

`main(config_dict)` is the job of one rank (started by backend.launch.launcher). Each step: the micro-batches
of this rank's data shard, forward/backward over them with gradient accumulation, the data all-reduce,
clipping and AdamW (backend.training.optim), then logging and, every `ckpt_every` steps, a checkpoint.

Throughput convention: `flops_per_s` uses ModelSpec.reference_flops (Narayanan et al., SC'21:
96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) per step, V the padded vocabulary) with the recomputed forward
counted when recomputation is on (as the AxoNN papers count); `model_flops_per_s` uses the same
formula without recomputation (72 instead of 96: useful work only, like MFU). A Llama counts the same
way with its own matrices (GQA k/v, three MLP matrices, untied head): the log says "reference-llama".
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from topologies.common import TwinError, finite_json, naming, write_atomic
from twin.program.grid import Grid
from twin.program.flags import options_from_flags
from twin.program.model import load_model
from twin.program.program import Options, Program, build_program

CRASH_ENV = "BACKEND_TEST_CRASH_AFTER_STEP"  # tests: rank 0 SIGKILLs itself after this step


@dataclass
class TrainConfig:
    """Everything a run depends on. Steps count from 1; `steps` is the last step."""

    model: str = "gpt-tiny"
    grid: str = "1x1x1x1"
    steps: int = 50
    batch: int | None = None          # global batch, sequences (default: the model's)
    micro_batches: int = 1
    lr: float = 1e-3                  # peak learning rate
    min_lr: float = 1e-4              # end of the cosine decay
    warmup: int = 10                  # linear warm-up steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0            # global-norm clip; 0 turns clipping off
    oar: bool = True
    ors: bool = True
    oag: bool = True
    cache_layers: int = 0
    recompute: bool = True
    schedule: str = "1f1b"            # pipeline schedule on a grid XxYxZxPxD (twin/program/pipeline.py)
    chunks: int = 1                   # model chunks per pipeline stage (interleaved schedule)
    data: str = "synthetic"           # 'synthetic', a .bin of uint16 token ids, or any file (bytes)
    out: str = "runs/latest"          # log.jsonl, summary.json and trace/ (per-rank traces) go here
    ckpt_dir: str | None = None       # checkpoints (resumes from its latest one when present)
    ckpt_every: int = 0               # steps between checkpoints; 0: none
    keep_ckpts: int = 2
    log_every: int = 1
    trace_step: int | None = None     # step whose ops go to trace/ (default: the last one)
    seed: int = 0
    device: str = "cpu"               # cpu (gloo, fp32) or cuda (NCCL, bf16 compute, fp32 master weights)
    goldfish_k: int = 0               # goldfish loss: drop one target in k (backend.training.goldfish); 0: off
    goldfish_h: int = 13              # goldfish loss: tokens hashed per target
    eval_data: str | None = None      # held-out data (same forms as `data`); its loss is logged
    eval_every: int = 0               # steps between held-out evaluations (0: at the last step only)
    eval_batches: int = 4             # global batches of held-out data per evaluation
    program_file: str | None = None   # run this program file (twin program --json-out): it fixes model, grid, batch, switches
    init_from: str | None = None      # a Hugging Face Llama directory: the weights a fresh run starts from
    tensorboard: str | None = None    # also write TensorBoard scalars here (backend.training.tensorboard)
    spec: dict | None = None          # the model spec itself (e.g. from init_from's config.json); overrides `model`
    hf_config: dict | None = None     # init_from's config.json, kept for `backend export`
    eval_holdout: float = 0.0         # prompt/response data without eval_data: hold out this share of the examples
    skip_nonfinite: bool = False      # a step with a non-finite loss or gradient: skip it (else stop the run)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def program(self, stage: int = 0) -> Program:
        """The run resolved once: model spec, grid, switches and batch, as the program it runs (the
        program file's, validated, when given; raises TwinError when the grid cannot run the model).
        stage: on a pipelined grid, the program of that stage."""
        if self.program_file:
            from twin.program.programfile import load_program
            loaded = load_program(self.program_file)
            return loaded[stage] if isinstance(loaded, list) else loaded
        return build_program(self.model_spec(), Grid.parse(self.grid), self.options(), batch=self.batch, stage=stage)

    def model_spec(self):
        """The model: `spec` when given (a Hugging Face import), else the spec named by `model`."""
        from twin.program.model import ModelSpec
        return ModelSpec(**self.spec) if self.spec else load_model(self.model)

    def options(self) -> Options:
        return options_from_flags(self.oar, self.ors, self.oag, self.cache_layers, self.recompute,
                                  self.micro_batches, grad_clip=self.grad_clip > 0,
                                  goldfish_h=self.goldfish_h if self.goldfish_k else 0, schedule=self.schedule,
                                  chunks=self.chunks)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of `step` (1-based): linear warm-up to cfg.lr, then cosine decay to cfg.min_lr."""
    if cfg.warmup > 0 and step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def check_run_flags(steps: int, batch: int | None, device: str, ranks: int = 1) -> None:
    """The checks `backend run` and `backend replay` share (raises TwinError with one clear line).

    ranks: the grid's size; started here (no launcher) on cuda, each rank needs a GPU of its own.
    """
    if steps < 1:
        raise TwinError(f"--steps must be >= 1, got {steps}")
    if batch is not None and batch < 1:
        raise TwinError(f"--batch must be >= 1 sequence, got {batch}")
    if device not in ("cpu", "cuda"):
        raise TwinError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise TwinError("--device cuda but no CUDA device is visible to PyTorch (use --device cpu)")
        from backend.launch.env import under_launcher
        gpus = torch.cuda.device_count()
        if not under_launcher() and ranks > gpus:
            raise TwinError(f"the grid has {ranks} ranks but this machine has {gpus} GPU(s) and NCCL needs "
                            f"one each: choose a grid of at most {gpus} ranks, or start the ranks on "
                            f"several nodes with torchrun or srun")


def check_numbers(cfg: TrainConfig) -> None:
    """Every number of a run in its range (raises TwinError with one line): finite rates, no negative
    steps or seeds, a trace step within the run, an output folder that is a folder."""
    import math
    for flag, v, lo in (("--lr", cfg.lr, 0.0), ("--min-lr", cfg.min_lr, 0.0), ("--weight-decay", cfg.weight_decay, 0.0),
                        ("--grad-clip", cfg.grad_clip, 0.0)):
        if not (math.isfinite(v) and v >= lo) or (flag == "--lr" and v <= 0):
            raise TwinError(f"{flag} must be a finite number {'> 0' if flag == '--lr' else '>= 0'}, got {v}")
    if cfg.min_lr > cfg.lr:
        raise TwinError(f"--min-lr {cfg.min_lr} must not exceed --lr {cfg.lr}")
    if cfg.warmup < 0 or not 0 <= cfg.seed < 2 ** 32:
        raise TwinError(f"--warmup must be >= 0 and --seed in 0..2^32-1, got {cfg.warmup} and {cfg.seed}")
    if cfg.trace_step is not None and not 1 <= cfg.trace_step <= cfg.steps:
        raise TwinError(f"--trace-step must be a step of this run (1..{cfg.steps}), got {cfg.trace_step}")
    from topologies.common import check_output
    check_output(cfg.out, "--out", folder=True)
    if cfg.ckpt_dir is not None:
        check_output(cfg.ckpt_dir, "--ckpt-dir", folder=True)


def validate(cfg: TrainConfig, program: Program | None = None) -> None:
    """Check a config before any rank starts (raises TwinError with one clear line). program: the
    run's program when the caller has it already (a program file, loaded and checked once)."""
    from backend.runtime import checkpoint

    check_run_flags(cfg.steps, cfg.batch, cfg.device, Grid.parse(cfg.grid).size)
    if cfg.cache_layers < 0 or cfg.ckpt_every < 0 or cfg.log_every < 1:
        raise TwinError("--cache-layers and --ckpt-every must be >= 0, --log-every >= 1")
    if cfg.ckpt_every and not cfg.ckpt_dir:
        raise TwinError("--ckpt-every needs --ckpt-dir")
    check_numbers(cfg)
    if cfg.goldfish_k:
        from backend.training.goldfish import check
        check(cfg.goldfish_k, cfg.goldfish_h)
    program = program or cfg.program()  # grid x model x batch checks
    if isinstance(program, list):  # a pipelined grid's program file: every stage's program; the first holds the most
        program = program[0]
    spec, grid = program.model, program.grid
    from backend.launch.env import check_memory
    check_memory(program, cfg.device, 2 if cfg.device == "cuda" else 4)  # bf16 compute on GPU, fp32 on CPU
    if cfg.eval_every < 0 or cfg.eval_batches < 1:
        raise TwinError(f"--eval-every must be >= 0 and --eval-batches >= 1, got {cfg.eval_every} and {cfg.eval_batches}")
    if cfg.init_from:
        from backend.hf.load import HFCheckpoint
        HFCheckpoint(cfg.init_from).check(spec)  # every tensor there, with the spec's shapes
    from backend.training.finetune import check_data
    check_data(cfg, spec)
    if cfg.ckpt_dir:
        for entry in sorted(Path(cfg.ckpt_dir).glob("step_*")):
            if not entry.is_dir():
                raise TwinError(f"{entry} is a file, not a checkpoint folder: move it away or choose another --ckpt-dir")
        path = checkpoint.latest(cfg.ckpt_dir)
        if path is not None:
            checkpoint.check_compatible(path, grid, spec)


def step_flops(program: Program, recompute: bool) -> float:
    """Reference flops of one step (flop), see the module docstring."""
    return program.model.reference_flops(program.batch, program.seq_len, program.vocab, recompute)


def format_flops(flops_per_s: float) -> str:
    """flop/s with an SI prefix, e.g. '412.3 TF/s'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if flops_per_s >= scale:
            return f"{flops_per_s / scale:.1f} {prefix}F/s"
    return f"{flops_per_s:.0f} F/s"


def format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def keep_log(path: Path, resumed_after: int) -> None:
    """Start a run's log: keep the records of the steps before the checkpoint it resumed from (none for a
    fresh run), so that the log holds each step once however often the run was restarted."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            if 0 < json.loads(line)["step"] <= resumed_after:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
    write_atomic(path, "".join(line + "\n" for line in kept))


class MetricsLog:
    """Per-step metrics: one JSON line per logged step in `path`, and a progress line on stdout."""

    def __init__(self, path: Path, cfg: TrainConfig, program: Program, enabled: bool, resumed_after: int = 0):
        self.path, self.cfg, self.enabled = path, cfg, enabled
        self.flops = step_flops(program, program.options.recompute)
        self.model_flops = step_flops(program, False)
        self.tokens = program.batch * program.seq_len
        self.gpus = program.grid.size
        self.convention = "narayanan-sc21" if program.model.arch == "gpt" else f"reference-{program.model.arch}"
        if program.options.recompute:
            self.convention += "+recompute"
        self.times: list[float] = []
        self.tb = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            keep_log(path, resumed_after)
            if cfg.tensorboard:
                from backend.training.tensorboard import EventWriter
                self.tb = EventWriter(cfg.tensorboard)

    def log(self, step: int, loss: float, lr: float, seconds: float, extra: dict | None = None) -> dict:
        """Record one step that took `seconds`; returns the record."""
        self.times.append(seconds)
        recent = self.times[-10:]
        avg = sum(recent) / len(recent)
        rec = {"step": step, "loss": loss, "lr": lr, "step_time_s": seconds,
               "tokens_per_s": self.tokens / seconds, "flops_per_s": self.flops / seconds,
               "flops_per_s_per_gpu": self.flops / seconds / self.gpus,
               "model_flops_per_s": self.model_flops / seconds,
               "flops_convention": self.convention,
               "eta_s": avg * (self.cfg.steps - step), **(extra or {})}
        if self.enabled and (step % self.cfg.log_every == 0 or step == self.cfg.steps or "val_loss" in rec):
            with naming(self.path), open(self.path, "a") as f:
                f.write(finite_json(rec) + "\n")
            if self.tb is not None:
                from backend.training.tensorboard import memory_bytes
                self.tb.scalars(step, {"loss": loss, "lr": lr, "tokens_per_s": rec["tokens_per_s"],
                                       "flops_per_s": rec["flops_per_s"], "step_time_s": seconds,
                                       "memory_bytes": memory_bytes(), "val_loss": rec.get("val_loss")})
            # one line that fits 80 columns (flop/s per GPU by the convention the first line names)
            print(f"step {step:>{len(str(self.cfg.steps))}}/{self.cfg.steps}  loss {loss:.4f}  "
                  f"lr {lr:.1e}  {rec['tokens_per_s']:,.0f} tok/s  {format_flops(rec['flops_per_s_per_gpu'])}/GPU  "
                  f"eta {format_eta(rec['eta_s'])}"
                  + (f"  held-out loss {rec['val_loss']:.4f}" if "val_loss" in rec else ""), flush=True)
        return rec


def _write_trace(path: Path, spans: list, ctx, metadata: dict) -> None:
    """Gather every rank's spans to rank 0 and write the run folder of per-rank traces (twin.program.trace)."""
    import torch.distributed as dist
    from twin.program.trace import write_trace

    gathered = [None] * ctx.grid.size if ctx.rank == 0 else None
    dist.gather_object(spans, gathered, dst=0)
    if ctx.rank == 0:
        write_trace(path, [s for part in gathered for s in part], metadata, step=metadata.get("step", 1),
                    world_size=ctx.grid.size, backend="nccl" if ctx.device.type == "cuda" else "gloo")


def _save(cfg: TrainConfig, step: int, model, optimizer, loader, ctx) -> None:
    from backend.runtime import checkpoint
    from backend.training import state

    from backend.training.guard import check_finite_state
    check_finite_state(model.state_dict(), f"step {step} (rank {ctx.rank}), not saved")
    meta = checkpoint.make_meta(step, ctx.grid, model.spec, {"config": asdict(cfg)})
    checkpoint.save(cfg.ckpt_dir, step, ctx.rank, state.state_dict(model, optimizer, loader, cfg, ctx, step), meta,
                    keep=cfg.keep_ckpts, sharded=True)


def _resume(cfg: TrainConfig, model, optimizer, loader, ctx) -> int:
    """Load the latest checkpoint of cfg.ckpt_dir if there is one; returns the last completed step.
    A checkpoint of any grid (DCP), or of this grid in the older per-rank format."""
    from backend.runtime import checkpoint

    if not cfg.ckpt_dir:
        return 0
    path = checkpoint.find_resume(cfg.ckpt_dir, ctx.rank)  # newest good one; the same on every rank
    if path is None:
        return 0
    meta = checkpoint.check_compatible(path, ctx.grid, model.spec)
    from backend.training.guard import check_finite_state
    if meta["format"] == checkpoint.FORMAT:
        from backend.training import state
        step = state.load(path, model, optimizer, loader, cfg, ctx)
        check_finite_state(model.state_dict(), f"checkpoint {path} cannot be resumed (rank {ctx.rank}): delete it")
        return step
    saved = checkpoint.load(path, ctx.rank, ctx.grid, model.spec, map_location=ctx.device)
    check_finite_state(saved["model"], f"checkpoint {path} cannot be resumed (rank {ctx.rank}): delete it")
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    loader.load_state_dict(saved["data"])
    checkpoint.set_rng_state(saved["rng"])
    return int(saved["step"])


def train(cfg: TrainConfig) -> list[dict]:
    """Run the training loop on this rank (torch.distributed initialized here); returns the step records."""
    import torch
    import torch.distributed as dist

    from backend.runtime.dist import ParallelContext, destroy
    from backend.launch.env import check_world_size, env_rank, fabric_warning
    from backend.launch.rank import heartbeat
    from backend.training.guard import StepGuard
    from backend.models.build import make_model
    from backend.training.optim import make_optimizer, train_step
    from backend.runtime.recorder import NULL_RECORDER, Recorder

    program = cfg.program()
    spec, grid, options = program.model, program.grid, program.options
    cfg.micro_batches = options.micro_batches  # a program file's: the data loader splits batches as it runs
    check_world_size(grid.size, cfg.grid)
    warn = fabric_warning(cfg.device)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TwinError("--device cuda but no CUDA device is visible to PyTorch")
    ctx = ParallelContext.from_env(grid, backend="nccl" if cfg.device == "cuda" else "gloo")
    if grid.pipe > 1:  # a pipeline stage runs its stage's program
        program = cfg.program(ctx.stage)
    guard = StepGuard(check_grads=not options.grad_clip)
    guard.install()  # SIGTERM, SIGUSR1: save at the next step boundary and stop
    try:
        rank0 = ctx.rank == 0
        if warn and env_rank()[1] == 0:
            print(warn, file=sys.stderr, flush=True)
        torch.manual_seed(cfg.seed)
        model = make_model(spec, ctx, seed=cfg.seed, program=program).to(ctx.device)
        optimizer = make_optimizer(model, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
        from backend.training.finetune import make_data
        loader, held_out = make_data(cfg, spec, program.batch, ctx)  # prompt/response examples or windows
        start = _resume(cfg, model, optimizer, loader, ctx)
        if cfg.init_from and not start:
            from backend.hf.load import load_into
            load_into(model, cfg.init_from)  # each rank reads only its slices
        out = Path(cfg.out)
        metrics = MetricsLog(out / "log.jsonl", cfg, program, enabled=rank0, resumed_after=start)
        if rank0:
            out.mkdir(parents=True, exist_ok=True)
            print(f"backend run: {spec.name} ({spec.parameters(spec.padded_vocab(grid.y)) / 1e6:.1f} M parameters) "
                  f"on grid {grid} ({ctx.device}, {ctx.compute_dtype})\n{metrics.tokens} tokens/step, "
                  f"data {cfg.data}" + (f", from {cfg.init_from}" if cfg.init_from and not start else "")
                  + (f", resumed after step {start}" if start else "")
                  + f"; flop/s by {metrics.convention}", flush=True)
        trace_step = cfg.trace_step or cfg.steps
        crash_after = int(os.environ.get(CRASH_ENV, "0"))
        records, peaks, skipped = [], [], 0
        for step in range(start + 1, cfg.steps + 1):
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = [(b.inputs, b.targets) for b in loader.next(ctx.device)]
            recorder = Recorder(enabled=True, device=ctx.device) if step == trace_step else NULL_RECORDER
            if step == trace_step:
                dist.barrier()  # align the ranks' time origins
                recorder.reset()
            guard.begin(ctx.device)  # agrees on a stop signal by the step's end
            t0 = time.perf_counter()
            if step == min(start + 2, cfg.steps) and step != trace_step:
                # the second step (optimizer state exists by then): also measure the memory peak
                from backend.runtime.memory import peak_memory
                loss, peak = peak_memory(lambda: train_step(model, optimizer, batches, max_norm=cfg.grad_clip,
                                                            guard=guard), model, optimizer)
                peaks = [None] * grid.size
                dist.all_gather_object(peaks, peak)
            else:
                loss = train_step(model, optimizer, batches, recorder=recorder, max_norm=cfg.grad_clip, guard=guard)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            extra = guard.settle(step, cfg.skip_nonfinite, cfg.init_from, rank0)  # stops a non-finite step, or skips it
            skipped += "skipped" in extra
            if held_out is not None and held_out.due(step, cfg.eval_every, cfg.steps):
                heartbeat("busy")  # an evaluation may take longer than a step
                extra["val_loss"] = held_out.loss(model)
            records.append(metrics.log(step, loss, lr, seconds, extra))
            heartbeat("busy")  # the launcher ends a run whose rank stops making progress (busy: slow work follows)
            guard.stopping()
            if step == trace_step:
                model.recorder = NULL_RECORDER
                _write_trace(out / "trace", recorder.spans(ctx.rank, program), ctx,
                             {"source": "backend run", "model": spec.name, "grid": str(grid), "step": step,
                              "device": str(ctx.device), "options": asdict(options)})
            if (cfg.ckpt_every and (step % cfg.ckpt_every == 0 or step == cfg.steps)) or (guard.stop and cfg.ckpt_dir):
                _save(cfg, step, model, optimizer, loader, ctx)
            heartbeat()
            if guard.stop and step < cfg.steps:
                guard.stop_here(step, cfg.ckpt_dir)  # raises Stopped: one line, exit 128 + the signal
            if crash_after and step == crash_after and rank0:
                os.kill(os.getpid(), signal.SIGKILL)  # tests: die like a crashed node
        if rank0 and records:
            warm = records[1:] or records
            summary = {"model": spec.name, "grid": str(grid), "device": str(ctx.device),
                       "dtype": str(ctx.compute_dtype).removeprefix("torch."), "steps": cfg.steps,
                       "final_loss": records[-1]["loss"], "skipped_steps": skipped,
                       "tokens_per_s": sum(r["tokens_per_s"] for r in warm) / len(warm),
                       "flops_per_s": sum(r["flops_per_s"] for r in warm) / len(warm),
                       "model_flops_per_s": sum(r["model_flops_per_s"] for r in warm) / len(warm),
                       "flops_convention": records[-1]["flops_convention"],
                       "memory_peak_bytes": peaks,  # per rank, second step of this run (torch's memory tracker)
                       # where the ranks ran (backend.launch.launcher: 'cores' pins rank i to core i mod cores)
                       "cpu_bind": os.environ.get("BACKEND_CPU_BIND", "none"),
                       "threads_per_rank": torch.get_num_threads(),
                       "note": "averages over the steps of this run after its first"}
            write_atomic(out / "summary.json", finite_json(summary, indent=1))
        return records
    finally:
        guard.uninstall()
        destroy()


def main(config: dict) -> None:
    """The `run` job of one rank (see backend.launch.launcher)."""
    train(TrainConfig.from_dict(config))
