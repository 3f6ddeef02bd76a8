"""Re-run the bad inputs of issue 12 and say what each one gives now.

    python benchmarks/bad_inputs.py            # every case (a few minutes: backend cases start torch)
    python benchmarks/bad_inputs.py twin       # only the cases whose name contains "twin"

Each case runs `python -m twin.cli ...` or `python -m backend.cli ...` in a fresh process with a
timeout and is classified:
    error   exit 2, exactly one line on stderr, no traceback (what a bad input must give)
    ok      exit 0 (what a good input must give)
    BROKEN  anything else: a traceback, several lines, another exit code, a hang, or exit 0 where an
            error was due (accepted silently)
The last line counts the cases that held and prints the ones that did not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRONTIER = (ROOT / "topologies/systems/frontier.toml").read_text()
CPU_PROFILE = (ROOT / "twin/profiles/cpu.toml").read_text()
TINY = (ROOT / "twin/models/gpt-tiny.toml").read_text()


def edit(text: str, section: str | None, key: str, value: str) -> str:
    """Set `key = value` (TOML source) in [section] (None: the top level), replacing the line if present."""
    lines = text.splitlines()
    start = 0
    if section is not None:
        start = next(i for i, l in enumerate(lines) if l.strip() == f"[{section}]") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
    for i in range(start, end):
        if re.match(rf"{re.escape(key)}\s*=", lines[i]):
            j = i  # a multi-line array ends at the line that closes it
            if lines[i].rstrip().endswith("[") or (lines[i].count("[") > lines[i].count("]")):
                while not lines[j].strip().startswith("]"):
                    j += 1
            lines[i:j + 1] = [f"{key} = {value}"]
            return "\n".join(lines) + "\n"
    lines.insert(start, f"{key} = {value}")
    return "\n".join(lines) + "\n"


def cases(tmp: Path) -> list[tuple[str, list[str], str, dict]]:
    """(name, argv, expected 'error' or 'ok', extra environment)."""
    out: list[tuple[str, list[str], str, dict]] = []

    def file(name: str, text: str) -> str:
        p = tmp / name
        p.write_text(text)
        return str(p)

    twin = [sys.executable, "-m", "twin.cli"]
    backend = [sys.executable, "-m", "backend.cli"]
    small = ["--model", "gpt-1b", "--gpus", "16", "--batch", "16", "--grid", "2x2x2x2"]

    def system(name, section, key, value, extra=()):
        path = file(f"sys-{name}.toml", edit(FRONTIER, section, key, value))
        out.append((f"twin system {name}", twin + ["simulate", "--system", path, *small, *extra], "error", {}))

    def profile(name, text):
        path = file(f"prof-{name}.toml", text)
        out.append((f"twin profile {name}", twin + ["simulate", "--system", "perlmutter", "--profile", path,
                                                  *small], "error", {}))

    def model(name, key, value):
        path = file(f"model-{name}.toml", edit(TINY, None, key, value))
        out.append((f"twin model {name}", twin + ["program", "--model", path, "--grid", "1x1x1x1"], "error", {}))

    # hangs
    system("link_bandwidth=nan", "network", "link_bandwidth", "nan")
    system("nic_bandwidth=nan", "node", "nic_bandwidth", "nan")
    model("layers=1e12", "layers", "1000000000000")
    out.append(("twin program huge layers --hbm-gib", twin + ["program", "--model", str(tmp / "model-layers=1e12.toml"),
                                                           "--grid", "1x1x1x1", "--hbm-gib", "80"], "error", {}))
    # twin tracebacks
    out.append(("twin simulate --seq 0", twin + ["simulate", "--system", "perlmutter", *small, "--seq", "0"], "error", {}))
    for v in ("nan", "inf", "1e308"):
        out.append((f"twin --slowdown 3:{v}", twin + ["simulate", "--system", "perlmutter", *small, "--full",
                                                   "--slowdown", f"3:{v}"], "error", {}))
    out.append(("twin --slowdown without --full", twin + ["simulate", "--system", "perlmutter", *small,
                                                        "--slowdown", "3:2"], "error", {}))
    out.append(("twin program --json-out ''", twin + ["program", "--model", "gpt-tiny", "--grid", "1x1x1x1", "--json-out", ""], "error", {}))
    out.append(("twin simulate --trace ''", twin + ["simulate", "--system", "perlmutter", *small, "--trace", ""], "error", {}))
    out.append(("twin simulate --html ''", twin + ["simulate", "--system", "perlmutter", *small, "--html", ""], "error", {}))
    out.append(("twin topology --html ''", twin + ["topology", "--system", "cpu", "--html", ""], "error", {}))
    out.append(("twin simulate --trace into a missing dir", twin + ["simulate", "--system", "perlmutter", *small,
                                                                  "--trace", str(tmp / "no/such/dir/t.json")], "ok", {}))
    out.append(("twin simulate --trace onto a file", twin + ["simulate", "--system", "perlmutter", *small,
                                                           "--trace", str(tmp / "sys-nodes=true.toml")], "error", {}))
    out.append(("twin program --json-out onto a folder", twin + ["program", "--model", "gpt-tiny", "--grid", "1x1x1x1",
                                                               "--json-out", str(tmp)], "error", {}))
    out.append(("twin topology scattered --seed -1", twin + ["topology", "--system", "perlmutter", "--placement",
                                                           "scattered", "--seed", "-1"], "error", {}))
    for v in ("nan", "inf", "1e300"):
        system(f"hbm_gib={v}", "gpu", "hbm_gib", v)
    system("gemm_flops='abc'", "gpu", "gemm_flops", '"abc"')
    system("gemm_flops=[1]", "gpu", "gemm_flops", "[1]")
    system("gpu_nic=5", "node", "gpu_nic", "5")
    system("sources=5", None, "sources", "5")
    system("ring_only=5", "collectives", "ring_only", "5")
    system("ring_only=['bogus']", "collectives", "ring_only", '["bogus"]')
    system("switch_latency=inf", "network", "switch_latency", "inf")
    system("link_latency=nan", "node", "link_latency", "nan")
    system("step_latency=-inf", "collectives", "step_latency", "-inf")
    system("peak_flops=nan", "gpu", "peak_flops", "nan", ("--json",))
    system("peak_flops=inf", "gpu", "peak_flops", "inf", ("--json",))
    system("links_gbs nan", "node", "links_gbs", "[[0, nan], [nan, 0]]")
    system("nodes=true", "node", "nodes", "true")
    profile("compute_units=nan", edit(CPU_PROFILE, None, "compute_units", '{ value = nan, source = "x" }'))
    profile("compute_units=inf", edit(CPU_PROFILE, None, "compute_units", '{ value = inf, source = "x" }'))
    profile("gemm_table no m", CPU_PROFILE + '\n[[gemm_table]]\nn = 64\nk = 64\nlayout = "NN"\n'
            'flops = { value = 1e9, source = "x" }\n')
    profile("gemm_table m='big'", CPU_PROFILE + '\n[[gemm_table]]\nm = "big"\nn = 64\nk = 64\nlayout = "NN"\n'
            'flops = { value = 1e9, source = "x" }\n')
    profile("gpus=5", edit(CPU_PROFILE, None, "gpus", "5"))
    profile("overlap_slowdown=true", edit(CPU_PROFILE, None, "overlap_slowdown", '{ value = true, source = "x" }'))
    # accepted silently
    out.append(("twin program --batch 0", twin + ["program", "--model", "gpt-tiny", "--grid", "1x1x1x1", "--batch", "0"], "error", {}))
    out.append(("twin program --hbm-gib nan", twin + ["program", "--model", "gpt-tiny", "--grid", "1x1x1x1", "--hbm-gib", "nan"], "error", {}))
    model("layers=true", "layers", "true")
    model("tied_embeddings='no'", "tied_embeddings", '"no"')
    model("hidden=1.5", "hidden", "1.5")
    # mixture of experts (docs/moe.md)
    moe = ["--model", "mixtral-tiny", "--gpus", "8"]
    out.append(("twin moe: E_p does not divide the experts", twin + ["simulate", "--system", "perlmutter", *moe,
                                                                    "--grid", "1x1x1x8e8"], "error", {}))
    out.append(("twin moe: E_p does not divide G_data", twin + ["simulate", "--system", "perlmutter", *moe,
                                                              "--grid", "1x1x1x8e3"], "error", {}))
    out.append(("twin moe: e0", twin + ["program", "--model", "mixtral-tiny", "--grid", "1x1x1x8e0"], "error", {}))
    out.append(("twin moe: --moe-imbalance 9", twin + ["simulate", "--system", "perlmutter", *moe, "--grid",
                                                      "1x1x1x8e2", "--moe-imbalance", "9"], "error", {}))
    out.append(("twin moe: --moe-imbalance nan", twin + ["simulate", "--system", "perlmutter", *moe, "--grid",
                                                        "1x1x1x8e2", "--moe-imbalance", "nan"], "error", {}))
    out.append(("twin moe: --moe-imbalance on a dense model", twin + ["simulate", "--system", "perlmutter", *small,
                                                                     "--moe-imbalance", "2"], "error", {}))
    for name, extra in (("top_k > experts", "experts = 4\ntop_k = 5\n"), ("capacity_factor=0", "experts = 4\ntop_k = 2\ncapacity_factor = 0\n"),
                        ("capacity_factor=-1", "experts = 4\ntop_k = 2\ncapacity_factor = -1\n"),
                        ("top_k without experts", "top_k = 2\n")):
        path = file(f"moe-{name}.toml", TINY + "\n" + extra)
        out.append((f"twin moe model {name}", twin + ["program", "--model", path, "--grid", "1x1x1x1"], "error", {}))
    out.append(("twin good: simulate mixtral-tiny 1x1x1x8e4", twin + ["simulate", "--system", "perlmutter", *moe,
                                                                     "--grid", "1x1x1x8e4", "--json"], "ok", {}))
    # usage errors
    out.append(("twin usage: unknown option", twin + ["simulate", "--system", "cpu", "--bogus"], "error", {}))
    out.append(("twin usage: --gpus abc", twin + ["simulate", "--system", "cpu", "--gpus", "abc"], "error", {}))
    out.append(("twin usage: unknown command", twin + ["simulat"], "error", {}))
    out.append(("twin usage: missing --system", twin + ["simulate"], "error", {}))
    out.append(("twin good: simulate cpu", twin + ["simulate", "--system", "cpu", "--json"], "ok", {}))
    # backend
    run = backend + ["run", "--model", "gpt-tiny", "--steps", "2", "--out", str(tmp / "run")]
    for flag, value in (("--warmup", "-5"), ("--grad-clip", "-1"), ("--trace-step", "0"), ("--trace-step", "-1"),
                        ("--trace-step", "999"), ("--seed", "-1"), ("--data", "synthetic:-5"), ("--lr", "nan"),
                        ("--lr", "inf"), ("--min-lr", "-1"), ("--weight-decay", "nan"), ("--out", "")):
        out.append((f"backend run {flag} {value}", run + [flag, value], "error", {}))
    out.append(("backend run RANK=abc", run, "error", {"RANK": "abc"}))
    out.append(("backend bench --sizes-mib -1", backend + ["bench", "--sizes-mib", "-1", "--out", str(tmp / "b.json")], "error", {}))
    out.append(("backend bench --squares -5", backend + ["bench", "--squares", "-5", "--out", str(tmp / "b.json")], "error", {}))
    out.append(("backend bench --min-time nan", backend + ["bench", "--min-time", "nan", "--out", str(tmp / "b.json")], "error", {}))
    big = file("model-huge.toml", edit(edit(TINY, None, "hidden", "65536"), None, "layers", "2000"))
    out.append(("backend run model too big for memory", backend + ["run", "--model", big, "--steps", "1",
                                                                 "--out", str(tmp / "big")], "error", {}))
    out.append(("backend usage: --steps x", backend + ["run", "--steps", "x"], "error", {}))
    out.append(("backend good: run 2 steps", run, "ok", {}))
    return out


def classify(proc: subprocess.CompletedProcess | None, expect: str) -> tuple[str, str]:
    if proc is None:
        return "BROKEN", "hang (killed after the timeout)"
    err = proc.stderr.strip().splitlines()
    if "Traceback" in proc.stderr:
        return "BROKEN", f"traceback, exit {proc.returncode}: {err[-1] if err else ''}"
    if expect == "ok":
        return ("ok", "") if proc.returncode == 0 else ("BROKEN", f"exit {proc.returncode}: {' | '.join(err[:3])}")
    if proc.returncode == 0:
        return "BROKEN", "accepted silently (exit 0)"
    if proc.returncode == 2 and len(err) == 1:
        return "error", err[0]
    return "BROKEN", f"exit {proc.returncode}, {len(err)} lines: {' | '.join(err[:3])}"


def main() -> int:
    pattern = sys.argv[1] if len(sys.argv) > 1 else ""
    held, broken = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv, expect, env in cases(Path(tmp)):
            if pattern not in name:
                continue
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT,
                                      env={**os.environ, **env})
            except subprocess.TimeoutExpired:
                proc = None
            verdict, detail = classify(proc, expect)
            print(f"{verdict:6} {time.perf_counter() - t0:5.1f}s  {name}: {detail[:150]}", flush=True)
            if verdict == "BROKEN":
                broken.append(name)
            else:
                held += 1
    print(f"{held} held, {len(broken)} broken" + (": " + "; ".join(broken) if broken else ""))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
