"""How fast the event engine runs a program and the builder makes one, against a baseline checkout,
in one process (a report, not a test).

    python benchmarks/bench_engine.py --baseline DIR [--repeat N] [--grids 2x32x64x8,2x16x32x32]

The baseline's `twin` package is copied to a temporary folder under another name (`twin_base`,
its imports rewritten), so both versions run in this very process, alternately (the first of each
pair alternates too), on the same inputs: Frontier's default study on each grid, its collectives
routed once beforehand (a warm run), so that what is timed is the engine (symmetric mode) and the
builder alone. Printed per grid, as medians of CPU seconds over --repeat pairs with their ratio
this / baseline:
- engine: `simulate_program` on the grid's program again (what a second run of a program costs);
- engine, first run: the same with each side's kept per-program work dropped before each run
  (twin.engine.plan._PLANS, or twin.engine.engine._PLANS before the engine's split: what the first run of a
  program costs; a baseline without it has nothing to drop);
- build: `build_program` of the grid.
Each pair's results are checked equal first (the iteration, breakdown and op count; the ops built).
The machine may be shared: CPU seconds of one process, alternated, are steadier than wall seconds.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent.parent


def load_baseline(root: Path, into: Path):
    """The baseline checkout's twin package, importable as `twin_base` (its own modules throughout)."""
    dst = into / "twin_base"
    shutil.copytree(root / "twin", dst)
    for f in dst.rglob("*.py"):
        text = f.read_text()
        text = re.sub(r"\b(from|import) twin\.", r"\1 twin_base.", text)
        f.write_text(re.sub(r"\bfrom twin import\b", "from twin_base import", text))
    sys.path.insert(0, str(into))
    # the modules by their names in the layout of issue 39, else by their older flat names
    where = {"engine": ("engine.engine", "engine"), "plan": ("engine.plan", "engine_plan", "engine"),
             "grid": ("program.grid", "grid"), "model": ("program.model", "model"),
             "program": ("program.program", "program")}
    return SimpleNamespace(**{k: _first_module(*(f"twin_base.{n}" for n in names)) for k, names in where.items()})


def _first_module(*names: str):
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names}")


def timed(f) -> float:
    """CPU seconds of f(), from a collected heap (so that neither side pays the other's garbage)."""
    gc.collect()
    t = time.process_time()
    f()
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout to compare with (e.g. a worktree of main)")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--grids", default="2x32x64x8,2x16x32x32")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from twin.engine import engine
    from twin.engine import plan as engine_plan
    from twin.program.grid import Grid
    from twin.program.program import build_program
    from twin.costs.collectives import collective_timer
    from twin.predict.study import prepare
    from twin.predict.study_cache import model_for, program_for
    tmp = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    try:
        base = load_baseline(a.baseline.resolve(), tmp)
        base_plans = getattr(base.plan, "_PLANS", {})
        study = prepare("frontier", None, None, None, None, None, "contiguous", None, True)
        # by_size (ask each distinct collective once) on each side that has it, so that both run alike
        by_size, base_by_size = ({"by_size": True} if "by_size" in inspect.signature(f).parameters else {}
                                 for f in (engine.simulate_program, base.engine.simulate_program))
        base_model = base.model.load_model(study.model.name)
        base_options = base.program.Options(**study.options.__dict__)
        print(f"{'grid':12s} {'what':18s} {'this ms':>8s} {'base ms':>8s} {'ratio':>6s}")
        for name in a.grids.split(","):
            grid = Grid.parse(name)
            prog, cm = program_for(study, grid), model_for(study, grid)
            compute = [0.0 if op.is_collective else study.kernels.kernel_time(op) for op in prog.ops]
            kw = dict(overlap_slowdown=study.profile.overlap_slowdown)

            def run_this():
                return engine.simulate_program(prog, compute, collective_timer(prog, cm), **kw, **by_size)

            def run_base():
                return base.engine.simulate_program(prog, compute, collective_timer(prog, cm), **kw, **base_by_size)

            def cold_this():
                engine_plan._PLANS.clear()
                return run_this()

            def cold_base():
                base_plans.clear()
                return run_base()

            r, rb = run_this(), run_base()  # routes the collectives (memoised for both)
            assert (r.iteration_s, r.compute_s, r.exposed_s, r.idle_s, r.simulated_ops) == \
                (rb.iteration_s, rb.compute_s, rb.exposed_s, rb.idle_s, rb.simulated_ops), name
            grid_b = base.grid.Grid.parse(name)
            args = (study.batch, study.seq_len)
            ops = build_program(study.model, grid, study.options, *args).ops
            assert repr(ops) == repr(base.program.build_program(base_model, grid_b, base_options, *args).ops), name
            cases = [("engine", run_this, run_base), ("engine, first run", cold_this, cold_base),
                     ("build", lambda: build_program(study.model, grid, study.options, *args),
                      lambda: base.program.build_program(base_model, grid_b, base_options, *args))]
            for what, this, other in cases:
                t_this, t_base = [], []
                for k in range(a.repeat):
                    pair = ((this, t_this), (other, t_base))
                    for f, acc in (pair if k % 2 == 0 else pair[::-1]):
                        acc.append(timed(f))
                m_this, m_base = statistics.median(t_this), statistics.median(t_base)
                print(f"{name:12s} {what:18s} {m_this * 1e3:8.1f} {m_base * 1e3:8.1f} {m_this / m_base:6.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
