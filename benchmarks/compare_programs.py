"""Check that two checkouts build the same programs: the op lists (every field, in field order, with
its type) of several hundred programs, hashed in each checkout (a fresh process each), compared.

    python benchmarks/compare_programs.py OTHER_CHECKOUT

Run from this checkout's root; OTHER_CHECKOUT is e.g. a worktree of main. The programs: gpt-tiny,
gpt-small, llama-tiny and llama-small on 7 grids (every axis alone of size 2, none, all) x 6 switch
sets (overlaps off, no recomputation with cached layers, micro-batches, goldfish, ...), each also
host-ordered (twin.host.order.host_ordered), and the default programs of gpt-5b, gpt-20b, gpt-80b,
gpt-320b on their compare_predictions grids. A grid a model refuses contributes its error message.
Exits non-zero when the hashes differ (for a change meant to leave programs alone: a faster builder).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HASH = r'''
import hashlib, itertools
from dataclasses import fields
try:
    from topologies.common import TwinError
    from twin.program.grid import Grid
    from twin.program.model import load_model
    from twin.program.program import Op, Options, build_program
    try:
        from twin.host.order import host_ordered
    except ImportError:
        from twin.program.program import host_ordered
except ImportError:  # a checkout from before the layout of issue 39
    from twin.common import TwinError
    from twin.grid import Grid
    from twin.model import load_model
    from twin.program import Op, Options, build_program, host_ordered
h, n, ops = hashlib.sha256(), 0, 0
names = [f.name for f in fields(Op)]
def add(prog):
    global n, ops
    for op in prog.ops:
        h.update(repr(list(vars(op))).encode())
        h.update(repr([(getattr(op, f), type(getattr(op, f)).__name__) for f in names]).encode())
    h.update(repr((prog.vocab, prog.batch, prog.seq_len, str(prog.grid))).encode())
    n, ops = n + 1, ops + len(prog.ops)
grids = ["1x1x1x1", "2x1x1x1", "1x2x1x1", "1x1x2x1", "1x1x1x2", "2x2x2x2", "4x2x2x1"]
switches = [Options(), Options(oar=False, ors=False, oag=False), Options(recompute=False, cache_layers=2),
            Options(micro_batches=2, cache_layers=1),
            Options(goldfish_h=4, grad_clip=False, recompute=False, micro_batches=2),
            Options(oag=False, cache_layers=5, ors=False)]
for name in ("gpt-tiny", "gpt-small", "llama-tiny", "llama-small"):
    m = load_model(name)
    for g, o in itertools.product(grids, switches):
        try:
            p = build_program(m, Grid.parse(g), o, batch=8, seq_len=min(m.seq_len, 64))
        except TwinError as e:
            h.update(str(e).encode())
            continue
        add(p)
        add(host_ordered(p))
for name, g in (("gpt-5b", "2x2x2x64"), ("gpt-20b", "4x4x4x16"), ("gpt-80b", "8x8x4x16"), ("gpt-320b", "2x32x64x8")):
    add(build_program(load_model(name), Grid.parse(g), Options()))
print(n, "programs,", ops, "ops:", h.hexdigest())
'''


def digest(root: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", HASH], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode:
        return "error: " + (out.stderr.strip().splitlines() or ["?"])[-1]
    return out.stdout.strip()


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    here, other = Path.cwd(), Path(sys.argv[1]).resolve()
    a, b = digest(here), digest(other)
    print(f"this   {a}\nother  {b}")
    if a != b or a.startswith("error"):
        print("programs DIFFER")
        sys.exit(1)
    print("same programs")


if __name__ == "__main__":
    main()
