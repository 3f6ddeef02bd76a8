"""How fast the simulator is, against a baseline measured in the same run (a report, not a test).

    python benchmarks/bench_simulate.py [--baseline DIR] [--repeat N] [--quick] [--only WORD] [--machine]

Each figure is a whole `twin` process (imports included), as a user runs it:
1. `twin simulate --system frontier` (gpt-320b on 32,768 GCDs, grid auto) and with the grid fixed;
2. `twin search --system frontier --model gpt-320b --gpus 32768 --top 10` (every grid ranked, top 10
   simulated and any other that could beat them);
3. full mode: gpt-5b on 4,096 GCDs (grid 2x2x2x512), simulated ops per second of the whole process;
6. mixture of experts: mixtral-8x7b on 1,024 Frontier GCDs, grid auto (E_p among the searched axes);
4. CPU: gpt-small on 8 ranks of the 2-core CPU system with a grid (1x1x4x2) and with grid auto, both
   with this checkout's twin/profiles/cpu.toml (so that both checkouts read the same figures):
   a grid's stretch is a fixed point of simulations, each the mean of twin.host.spread's drawn runs;
5. with --machine: gpt-320b on all 32,768 Frontier GCDs in full mode (about 196 M ops; minutes).
Every command runs in this checkout and, with --baseline, in another one (e.g. a worktree of an older
commit: `git worktree add /tmp/base COMMIT`), alternately, `--repeat` times; the table gives the
median wall and CPU seconds of each, their ratio, and each process's peak resident memory. The
machine may be shared: the load average is printed before and after, and CPU seconds are steadier
than wall seconds under load.
Each checkout's modules are compiled to bytecode first and the children may read it, as after
`pip install` (which compiles them): a shell with PYTHONDONTWRITEBYTECODE set would otherwise recompile
every module on every run (about 0.15 s that no installed `twin` pays).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
# runs the CLI in a child and prints its peak resident memory (KiB) on the last line of stderr
# (twin.cli.main ends a process with os._exit, skipping the interpreter's teardown: the line is printed then)
RUNNER = ("import os, resource, runpy, sys\n"
          "def _exit(code, _real=os._exit):\n"
          "    print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr, flush=True)\n"
          "    _real(code)\n"
          "os._exit = _exit\n"
          "sys.argv = ['twin'] + sys.argv[1:]\n"
          "try:\n    runpy.run_module('twin.cli', run_name='__main__')\n"
          "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
          "print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
          "sys.exit(code)\n")

CPU_PROFILE = str(HERE / "twin" / "profiles" / "cpu.toml")
CPU = ["simulate", "--system", "cpu", "--model", "gpt-small", "--gpus", "8", "--batch", "16", "--profile", CPU_PROFILE]
CASES = [
    ("simulate frontier (grid auto)", ["simulate", "--system", "frontier", "--json"], "< 2 s (goal 1 s)"),
    ("simulate frontier --grid 2x32x64x8", ["simulate", "--system", "frontier", "--grid", "2x32x64x8", "--json"],
     "< 1 s"),
    ("search frontier gpt-320b 32768 --top 10", ["search", "--system", "frontier", "--model", "gpt-320b",
                                                 "--gpus", "32768", "--top", "10", "--json"], "< 10 s"),
    ("full: gpt-5b on 4,096 GCDs 2x2x2x512", ["simulate", "--system", "frontier", "--model", "gpt-5b", "--gpus",
                                              "4096", "--grid", "2x2x2x512", "--full", "--json"],
     ">= 1 M ops/s"),
    ("cpu: gpt-small on 8 ranks --grid 1x1x4x2", CPU + ["--grid", "1x1x4x2", "--json"], "< 1 s"),
    ("cpu: gpt-small on 8 ranks (grid auto)", CPU + ["--json"], "< 4 s"),
    ("moe: mixtral-8x7b on 1,024 GCDs (grid auto, E_p searched)", ["simulate", "--system", "frontier", "--model",
                                                                   "mixtral-8x7b", "--gpus", "1024", "--json"], "< 2 s"),
]
MACHINE = ("full: gpt-320b on 32,768 GCDs 2x32x64x8", ["simulate", "--system", "frontier", "--grid", "2x32x64x8",
                                                      "--full", "--json"], "< 300 s, < 12 GB")


def child_env(root: Path) -> dict:
    """The environment of a timed child: this one, importing from `root`, reading cached bytecode."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def compile_checkout(root: Path) -> None:
    """Compile a checkout's packages to bytecode, as `pip install` does."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "twin", "topologies"], cwd=root, check=True,
                   env=child_env(root))


def run(root: Path, args: list[str], timeout: float) -> dict:
    """One whole process: wall s, CPU s (user + system), peak RSS bytes, simulated ops (if printed)."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, *args], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(root))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t
    rss = next((int(line.split()[1]) * 1024 for line in reversed(err.splitlines()) if line.startswith("maxrss")), 0)
    if proc.returncode:
        return {"error": (err.strip().splitlines() or ["?"])[-2 if rss else -1][:200]}
    ops = None
    try:
        d = json.loads(out)
        ops = d.get("simulated_ops") if isinstance(d, dict) else None
    except json.JSONDecodeError:
        pass
    return {"wall": wall, "rss": rss, "ops": ops}


def timed(root: Path, args: list[str], timeout: float) -> dict:
    """`run` with the child's CPU seconds (from the rusage of waited-for children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = run(root, args, timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    r["cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return r


def fmt(rs: list[dict]) -> tuple[str, float | None, float | None]:
    ok = [r for r in rs if "error" not in r]
    if not ok:
        return rs[0]["error"], None, None
    wall = statistics.median(r["wall"] for r in ok)
    cpu = statistics.median(r["cpu"] for r in ok)
    rss = max(r["rss"] for r in ok)
    ops = ok[0]["ops"]
    extra = f", {ops / wall / 1e6:.2f} M ops/s" if ops and "--full" in " ".join(ok[0].get("args", [])) else ""
    return f"{wall:7.2f} s wall {cpu:7.2f} s CPU {rss / 2**30:5.2f} GiB{extra}", wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="another checkout to run the same commands in")
    ap.add_argument("--repeat", type=int, default=3, help="runs per command and checkout (median reported)")
    ap.add_argument("--quick", action="store_true", help="the two simulate commands only")
    ap.add_argument("--only", action="append", default=[], metavar="WORD",
                    help="only the figures whose name has WORD (e.g. auto, search, full); repeatable")
    ap.add_argument("--machine", action="store_true", help="also the whole-machine full-mode run (minutes)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    a = ap.parse_args()
    cases = CASES[:2] if a.quick else CASES + ([MACHINE] if a.machine else [])
    if a.only:
        cases = [c for c in cases if any(w in c[0] for w in a.only)]
    roots = [("this", HERE)] + ([("baseline", a.baseline.resolve())] if a.baseline else [])
    for _, root in roots:
        compile_checkout(root)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    for name, args, target in cases:
        results: dict[str, list[dict]] = {k: [] for k, _ in roots}
        for _ in range(1 if args == MACHINE[1] else a.repeat):
            for k, root in roots:  # alternate, so that both see the same load
                r = timed(root, args, a.timeout)
                r["args"] = args
                results[k].append(r)
        print(f"== {name}  (target {target})")
        figures = {}
        for k, _ in roots:
            text, wall, cpu = fmt(results[k])
            figures[k] = (wall, cpu)
            print(f"   {k:9s} {text}")
        if a.baseline and None not in figures["this"] and None not in figures["baseline"]:
            (w1, c1), (w0, c0) = figures["this"], figures["baseline"]
            print(f"   ratio     {w1 / w0:7.2f} x wall {c1 / c0:7.2f} x CPU (this / baseline)")
        sys.stdout.flush()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
