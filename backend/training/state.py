"""A run's state as a DCP checkpoint that any grid resumes (backend.runtime.dcp, backend.models.placement).

What a checkpoint holds, by name:
- every full tensor of the model under its reference name (`wte`, `blocks.0.qkv`, ... for a GPT;
  Hugging Face's for a Llama), fp32, as boxes of the ranks' shards, stacked with AdamW's two moments
  of it: a DCP tensor of shape (3, *full shape) holding [weight, exp_avg, exp_avg_sq] (one item per
  box instead of three: a DCP item costs a torch.save or torch.load of its own);
- `train`: the step, AdamW's step count, the data loader's position (the next step, seed, batch,
  sequence length), the goldfish settings, the learning-rate schedule (its inputs: peak, floor,
  warm-up, steps) and the run's config;
- `rng/rank_<r>`: each rank's RNG states (a rank of another grid takes its own rank's, else rank 0's).

Parameters the placement does not know (an MoE block's experts, so far) are saved per rank under
`local/rank_<r>/<name>` and resume on the same grid only: on another grid, load says so in one line
before it reads anything.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from backend.models.placement import placements
from backend.runtime import checkpoint, dcp
from backend.runtime.checkpoint import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")


def _step_count(optimizer) -> int:
    """AdamW's step count (the same for every parameter it has stepped; 0 before the first)."""
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return int(max(steps, default=0))


def _places(model):
    params = dict(model.named_parameters())
    return params, placements(model)


def state_dict(model, optimizer, loader, cfg, ctx, step: int) -> dict:
    """The DCP state dict of this rank at the end of `step` (module docstring)."""
    import torch.distributed as dist

    params, places = _places(model)
    count = torch.tensor([_step_count(optimizer)], dtype=torch.int64, device=ctx.device)  # NCCL: on the GPU
    if ctx.grid.pipe > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX)  # a pipeline stage may hold no state of some tensors
    out: dict = {}
    for pname, p in params.items():
        state = optimizer.state.get(p, {})
        if pname not in places:
            out[f"local/rank_{ctx.rank:05d}/{pname}"] = p.detach()
            for m in MOMENTS:
                if m in state:
                    out[f"local/rank_{ctx.rank:05d}/optimizer/{m}/{pname}"] = state[m]
            continue
        for pl in places[pname]:
            write = pl.owner is None or pl.owner == ctx.stage
            moments = [state[m] if m in state else torch.zeros_like(p) for m in MOMENTS]
            out[pl.name] = dcp.Boxes([p.detach(), *moments], pl.shape, pl.boxes, write)
    out["train"] = {"step": step, "optimizer_steps": int(count.item()), "data": loader.state_dict(),
                    "goldfish": {"k": cfg.goldfish_k, "h": cfg.goldfish_h},
                    "schedule": {"lr": cfg.lr, "min_lr": cfg.min_lr, "warmup": cfg.warmup, "steps": cfg.steps},
                    "config": asdict(cfg)}
    out[f"rng/rank_{ctx.rank:05d}"] = checkpoint.rng_state()
    return out


def load(path, model, optimizer, loader, cfg, ctx) -> int:
    """Load the DCP checkpoint at `path` into this rank's model, optimizer, loader and RNG (every rank
    calls it); returns its step. Raises CheckpointError (the same on every rank) when it cannot."""
    saved = dcp.keys(path)
    params, places = _places(model)
    local = [pname for pname in params if pname not in places]
    if local:  # per-rank tensors fit only the grid that wrote them: say so before reading any
        head = {"train": None}
        _read(head, path)
        wrote = str(head["train"].get("config", {}).get("grid", ""))
        if wrote.replace(" ", "") != str(cfg.grid).replace(" ", ""):
            raise CheckpointError(f"checkpoint {path} holds {local[0]} per rank (a layer no global placement "
                                  f"maps: an MoE block's experts), written on grid {wrote}: resume it on {wrote}, "
                                  "or use another --ckpt-dir")
    state: dict = {}
    moments: dict = {}
    missing = []
    for pname, p in params.items():
        if pname not in places:
            key = f"local/rank_{ctx.rank:05d}/{pname}"
            if key not in saved:
                missing.append(pname)
                continue
            state[key] = p.data
            for m in MOMENTS:
                if f"local/rank_{ctx.rank:05d}/optimizer/{m}/{pname}" in saved:
                    moments.setdefault(pname, {})[m] = state[f"local/rank_{ctx.rank:05d}/optimizer/{m}/{pname}"] \
                        = torch.zeros_like(p)
            continue
        for pl in places[pname]:
            if pl.name not in saved:
                missing.append(pl.name)
                continue
            bufs = moments.setdefault(pname, {m: torch.zeros_like(p) for m in MOMENTS})
            state[pl.name] = dcp.Boxes([p.data, *(bufs[m] for m in MOMENTS)], pl.shape, pl.boxes)
    if missing:
        raise CheckpointError(f"checkpoint {path} has no {missing[0]} for this run's model on grid {ctx.grid}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + ": resume it on the grid that wrote it, or use another --ckpt-dir")
    rng = f"rng/rank_{ctx.rank:05d}"
    state["train"] = None
    state[rng if rng in saved else "rng/rank_00000"] = None
    _read(state, path)
    train = state["train"]
    _check_settings(path, train, cfg)

    loader.load_state_dict(train["data"])
    count = train["optimizer_steps"]
    for pname, ms in moments.items():
        p = params[pname]
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        on_device = group.get("fused") or group.get("capturable")
        optimizer.state[p] = {"step": torch.tensor(float(count), dtype=torch.float32,
                                                   device=p.device if on_device else "cpu"),
                              **{m: ms[m].to(p.device) for m in MOMENTS if m in ms}}
    checkpoint.set_rng_state(state[rng if rng in state else "rng/rank_00000"])
    return int(train["step"])


def _read(state: dict, path) -> None:
    """dcp.read, a failure as one CheckpointError line."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        dcp.read(state, path)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps a reader's error; one line
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200]})") \
            from None


def _check_settings(path, train: dict, cfg) -> None:
    """The settings a resumed run must share with the run that wrote the checkpoint."""
    gold = train.get("goldfish", {})
    if (gold.get("k", 0), gold.get("h", 13)) != (cfg.goldfish_k, cfg.goldfish_h) and (gold.get("k", 0) or cfg.goldfish_k):
        raise CheckpointError(f"checkpoint {path} was written with goldfish k={gold.get('k', 0)}, h={gold.get('h')}, "
                              f"this run has k={cfg.goldfish_k}, h={cfg.goldfish_h}: give the same --goldfish-k "
                              "and --goldfish-h, or use another --ckpt-dir")

