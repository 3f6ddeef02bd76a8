"""`backend bench --for-twin`: bench every rank count and axis that a study's grids need, one
measurement file per benched grid, with an estimate up front and progress as it goes.

What the twin needs of a machine, per count of ranks sharing a node (calibration.fit fits each count
apart, and a profile asked about a count it did not measure takes the nearest one's figures):
- the model's GEMM shapes of every grid with that many ranks, attention, the small ops: one grid per
  count measures them (`first`: the grid with the most split axes, `--all-grids`, square GEMMs);
- each collective over each (axis, group size) the study's grids use, alone and inside recorded
  training steps, with whether the group stays inside a node or crosses nodes: the grids benched
  after the first cover the pairs the first does not, fewest grids first (greedily, a grid of the
  study and a grid with fewer split axes preferred: its steps record each collective kind alone).

The plan is a pure function of the model, the study's grids and the ranks per node (`bench_plan`);
the estimate counts the entries each benched grid times (`estimate_s`). On one machine every rank
count is spawned here in turn. Under torchrun or srun this process is one rank of a fixed world: the
plan keeps the grids of that world size (their groups inside a node and across nodes, as
LOCAL_WORLD_SIZE says), every rank walks it in the same order, and rank 0 writes the files; run it
once per node count to cover several (docs/calibration.md).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from topologies.common import TwinError, finite_json
from twin.program.grid import AXES, Grid

# the defaults the developers' loops were measured with (benchmarks/bench_validate.py); --for-twin
# uses them where the command line leaves an option at `backend bench`'s own default
FOR_TWIN_DEFAULTS = {"squares": "256", "sizes_mib": "0.004,0.03,0.25,1,4", "layouts": "program", "min_time": 0.1}


@dataclass(frozen=True)
class BenchGrid:
    """One benched grid: `first` measures the GEMMs of every grid with its rank count and the small ops;
    every benched grid measures its axes' collectives and records training steps. `covers`: the
    (axis, group size, across nodes) triples it measures."""

    grid: str
    first: bool
    covers: tuple[tuple[str, int, bool], ...] = field(default=())

    @property
    def ranks(self) -> int:
        return Grid.parse(self.grid).size


def needs(grid: Grid, per_node: int) -> set[tuple[str, int, bool]]:
    """The (axis, group size, across nodes) of each split axis of `grid` with `per_node` ranks per node;
    with experts (E_p > 1) also the expert group (its all-to-alls) and the expert-data group."""
    out = {(a, grid.axis_size(a), grid.stride(a) * grid.axis_size(a) > per_node)
           for a in AXES if grid.axis_size(a) > 1}
    if grid.expert > 1:
        out |= {(a, grid.axis_size(a), grid.stride(a) * grid.axis_size(a) > per_node)
                for a in ("expert", "edata") if grid.axis_size(a) > 1}
    return out


def _split(g: Grid) -> int:
    return sum(g.axis_size(a) > 1 for a in AXES)


def first_grid(candidates: list[Grid]) -> Grid:
    """The grid that measures a rank count's GEMMs and small ops: the most axes split, each the least
    (2x2x2x1 for 8 ranks, 2x2x1x1 for 4, 2x1x1x1 for 2), data last (its GEMMs are the largest)."""
    return min(candidates, key=lambda g: (-_split(g), max(g.x, g.y, g.z, g.data), g.data, -g.x, -g.y, str(g)))


def bench_plan(model: str, grids: list[Grid], per_node: int | None = None, batch: int | None = None) -> list[BenchGrid]:
    """The grids to bench for a study of `grids` (see the module docstring), rank count by rank count."""
    from backend.bench.shapes import grids_of
    by_size: dict[int, list[Grid]] = {}
    for g in grids:
        by_size.setdefault(g.size, []).append(g)
    plan = []
    for size, study in sorted(by_size.items()):
        node = min(per_node or size, size)
        candidates = grids_of(model, size, batch)
        candidates += [g for g in study if g.expert > 1 and g not in candidates]  # the MoE grids measure their own axes
        if not candidates:
            raise TwinError(f"no grid of {size} rank(s) runs {model} (at its batch): choose other rank counts")
        want = set().union(*(needs(g, node) for g in study))
        first = first_grid(candidates)
        chosen = [BenchGrid(str(first), True, tuple(sorted(needs(first, node))))]
        left = want - needs(first, node)
        mine = {str(g) for g in study}
        while left:
            best = min(candidates, key=lambda g: (-len(needs(g, node) & left), str(g) not in mine, _split(g), str(g)))
            got = needs(best, node) & left
            if not got:  # no valid grid measures the rest (cannot happen: the study's own grids do)
                break
            chosen.append(BenchGrid(str(best), False, tuple(sorted(needs(best, node)))))
            left -= got
        plan += chosen
    return plan


def entries(step: BenchGrid, model: str, squares: list[int], sizes: int, batch: int | None) -> dict:
    """What `backend bench` times for one benched grid: the GEMM shapes' flops (first only: the
    program's of every grid with its rank count, and the squares in 3 layouts), the count of attention
    shapes (first only), small ops, collectives (3 kinds x sizes per split axis), overlap rows."""
    from backend.bench.shapes import OP_SIZES, program_attention_shapes, program_gemm_shapes
    g = Grid.parse(step.grid)
    axes = sum(g.axis_size(a) > 1 for a in AXES)
    gemm = ([2.0 * m * n * k for m, n, k, _ in program_gemm_shapes(model, g, True, batch)]
            + [2.0 * q ** 3 for q in squares for _ in range(3)]) if step.first else []
    attn = len(program_attention_shapes(model, g, True, batch)) if step.first else 0
    return {"gemm": gemm, "attention": attn, "ops": len(OP_SIZES) + 1 if step.first else 0,
            "collectives": 3 * sizes * axes, "overlap": axes if step.first else 0}


# what an entry and a launch cost beyond --min-time (measured on the 2-core development VM, gpt-tiny
# and gpt-small, 2026-12-03: a loaded machine takes longer, which the progress lines correct for)
ENTRY_OVERHEAD_S = 0.05   # the warm-up and sizing calls of each timed entry
LAUNCH_S = 4.0            # starting a grid's ranks, their process groups and the model
STEP_FLOP_RATE = 2e10     # flop/s of a recorded training step, per core (fp32 on a CPU core)
MIN_CALLS = 8             # a timed entry calls its function at least this often (backend.bench.timing.time_fn)


def estimate_s(step: BenchGrid, model: str, cfg: dict) -> float:
    """Seconds one benched grid should take: its entries at --min-time each (attention twice: forward,
    backward), the recorded steps (the model's flops of a step over the cores), the launch."""
    n = entries(step, model, list(cfg["squares"]), len(cfg["sizes_mib"]), cfg.get("batch"))
    timed = 2 * n["attention"] + n["ops"] + n["collectives"] + 2 * n["overlap"]
    steps = int(cfg.get("steps", 0)) + 2  # warm-up steps too
    cores = os.cpu_count() or 1
    rate = STEP_FLOP_RATE * min(1.0, cores / step.ranks) if cfg.get("device", "cpu") == "cpu" else 1e13
    gemm = sum(max(cfg["min_time_s"], MIN_CALLS * f / rate) + ENTRY_OVERHEAD_S for f in n["gemm"])
    return (LAUNCH_S * (1 + step.ranks / cores) + gemm + timed * (cfg["min_time_s"] + ENTRY_OVERHEAD_S)
            + steps * step_seconds(model, cfg))


def step_seconds(model: str, cfg: dict) -> float:
    """A rough training step of `model`: its flops over the machine's cores at STEP_FLOP_RATE (CPU), or
    0.05 s (GPU: a small model's step is launch-bound)."""
    from twin.program.model import load_model
    if cfg.get("device", "cpu") != "cpu":
        return 0.05
    flops = load_model(model).reference_flops(cfg.get("batch"))  # a step's flops, recomputation included
    return flops / (STEP_FLOP_RATE * (os.cpu_count() or 1))


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def bench_for_twin(cfg: dict, grids: list[Grid], out_dir: str, say=print, plan_only: bool = False,
                   as_json: bool = False) -> int:
    """Bench the plan for `grids` (backend bench's config `cfg`, its grid and out set per step) into
    OUT_DIR/bench-<grid>.json; returns the exit code (0, or the failed grid's, after its line). Says the plan and its estimate first, then a
    line per benched grid with the time it took and the time left (the estimate, scaled by how the
    grids so far compared with theirs)."""
    from backend.launch.env import env_rank, under_launcher
    from backend.launch.launcher import launch
    from twin.program.model import load_model
    model = cfg["model"]
    world = env_rank()[2] if under_launcher() else None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if world else None
    rank = env_rank()[0] if world else 0
    if world:
        skipped = sorted({g.size for g in grids} - {world})
        grids = [g for g in grids if g.size == world]
        if not grids:
            raise TwinError(f"the launcher started {world} ranks but no grid of the study has {world}: "
                            f"start one job per rank count ({', '.join(map(str, skipped))})")
        if skipped and rank == 0:
            say(f"the launcher started {world} ranks: benching the grids of {world} only "
                f"(not {', '.join(map(str, skipped))}: one job per rank count)")
    for g in grids:
        g.validate(load_model(model), batch=cfg.get("batch"))
    plan = bench_plan(model, grids, per_node, cfg.get("batch"))
    est = [estimate_s(s, model, cfg) for s in plan]
    out = Path(out_dir)
    files = [out / f"bench-{s.grid}.json" for s in plan]
    if as_json:  # --plan-only --json: what `twin calibrate --run` reads to say how long its loop will take
        say(finite_json({"benched": [{"grid": s.grid, "first": s.first, "estimate_s": e} for s, e in zip(plan, est)],
                        "estimate_s": sum(est), "step_s": step_seconds(model, cfg), "cores": os.cpu_count(),
                        "launch_s": LAUNCH_S}))
        return 0
    if rank == 0:
        counts = sorted({s.ranks for s in plan})
        say(f"bench for the twin: {model}, {len(grids)} grid(s) of {', '.join(map(str, counts))} rank(s) -> "
            f"{len(plan)} benched grid(s), estimated {_minutes(sum(est))} "
            f"({os.cpu_count()} cores; a loaded machine takes longer)")
        for s, e in zip(plan, est):
            what = "GEMMs of every grid, small ops, " if s.first else ""
            axes = ", ".join(f"{a} {p}{' across nodes' if across else ''}" for a, p, across in s.covers) or "none"
            say(f"  {s.grid:<10} {what}collectives over {axes}, training steps  (~{_minutes(e)})")
    if plan_only:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    t0, done_est = time.perf_counter(), 0.0
    for k, (s, e, f) in enumerate(zip(plan, est, files), 1):
        t1 = time.perf_counter()
        # under a launcher every grid runs in this process on the launcher's process group: tearing it
        # down and initializing it again on the same rendezvous hung under torchrun (its store keeps the
        # first initialization's keys), so the group stays up until the last grid
        step_cfg = {**cfg, "grid": s.grid, "out": str(f), "all_grids": True, "gemm": s.first and cfg["gemm"],
                    "ops": s.first and cfg["ops"], "squares": cfg["squares"] if s.first else [], "verbose": False,
                    "keep_process_group": bool(world) and k < len(plan)}
        code = launch("bench", step_cfg, s.ranks)
        if code:
            say(f"bench of {s.grid} failed (exit {code}); the files of the grids before it are in {out}")
            return code
        done_est += e
        spent = time.perf_counter() - t0
        left = (sum(est) - done_est) * spent / max(done_est, 1e-9)
        if rank == 0:
            say(f"[{k}/{len(plan)}] {s.grid}: {time.perf_counter() - t1:.0f} s (estimated {e:.0f} s); "
                f"{_minutes(spent)} so far, about {_minutes(left)} left")
    if rank == 0:
        say(f"wrote {len(files)} measurement file(s) to {out}: fit them with `twin calibrate {out}/bench-*.json --out P.toml`")
    if world:  # the groups of the grids before the last one abort the interpreter's teardown of torch under
        import sys  # torchrun ("terminate called without an active exception"): skip it, as spawned ranks do
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
