"""Check that two checkouts predict the same: run `twin simulate --json` for several systems, grids and
modes in each, and compare the JSON apart from wall time.

    python benchmarks/compare_predictions.py OTHER_CHECKOUT [--quick]

Run from this checkout's root; OTHER_CHECKOUT is e.g. a worktree of main. Prints one line per case
and exits non-zero when any prediction differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CASES = [
    ["--system", "frontier", "--grid", "2x32x64x8"],
    ["--system", "frontier", "--grid", "2x32x128x4"],
    ["--system", "frontier", "--model", "gpt-80b", "--gpus", "8192", "--grid", "8x8x4x16", "--batch", "512"],
    ["--system", "perlmutter", "--model", "gpt-40b", "--gpus", "4096", "--grid", "1x8x8x64"],
    ["--system", "alps", "--model", "gpt-60b", "--gpus", "4096", "--grid", "4x4x8x32"],
    ["--system", "frontier", "--model", "gpt-5b", "--gpus", "512", "--grid", "2x2x2x64", "--full"],
    ["--system", "frontier", "--model", "gpt-20b", "--gpus", "1024", "--grid", "4x4x4x16", "--placement", "scattered"],
    ["--system", "perlmutter", "--model", "gpt-20b", "--gpus", "512", "--grid", "2x4x4x16", "--no-oar", "--cache-layers", "4"],
    ["--system", "h200", "--model", "gpt-5b", "--gpus", "64"],
    ["--system", "cpu"],
    # every rank its own compute factor: full mode rank by rank (twin.engine.lockstep.lockstep where it applies)
    ["--system", "frontier", "--model", "gpt-5b", "--gpus", "512", "--grid", "2x2x2x64", "--full",
     "--slowdown", ",".join(f"{r}:{1 + r * 1e-6:.6f}" for r in range(512))],
]
SLOW = [
    ["--system", "frontier"],
    ["--system", "perlmutter", "--model", "gpt-40b", "--gpus", "4096"],
]


def run(root: Path, args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "twin.cli", "simulate", *args, "--json"], cwd=root,
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["?"]}
    d = json.loads(out.stdout)
    d.pop("wall_time_s", None)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", type=Path)
    ap.add_argument("--quick", action="store_true", help="fixed grids only (no grid auto)")
    a = ap.parse_args()
    here = Path.cwd()
    cases = CASES + ([] if a.quick else SLOW)
    bad = 0
    with ThreadPoolExecutor(2) as ex:
        for args, (x, y) in zip(cases, ex.map(lambda c: (run(here, c), run(a.other, c)), cases)):
            same = x == y
            bad += not same
            shown = ' '.join(a if len(a) < 80 else a[:40] + f"... ({len(a):,} characters)" for a in args)
            print(f"{'same' if same else 'DIFFERENT':9s} {shown}")
            if not same:
                for k in sorted(set(x) | set(y)):
                    if x.get(k) != y.get(k):
                        print(f"    {k}: {x.get(k)!r} != {y.get(k)!r}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
