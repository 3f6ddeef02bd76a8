"""Every command example of the README and of docs/ runs (exit code 0), in the pages' order where one needs
what an earlier one wrote; the README stays a front page (at most 12 KB) and no page links outside the
repository.

Examples are the lines of the pages' bash blocks (continuations joined, comments dropped, each part of an
`&&` chain) and the inline `twin ...`/`backend ...` commands that have a flag and no placeholder (the
command table's `--system S [--model M]` are syntax, not examples). Each example is run as written, or
with a smaller study under the same command and flags (fewer GPUs, steps or epochs: the mapping names
each rewrite), in a temporary folder. The `twin` examples run in this process; the `backend` examples
(and the shell lines that make their data) run in order in one child process that imports torch once,
and are skipped, saying so, where torch is not installed. What cannot run here is listed with the
reason: the GPU launches (torchrun, srun) and the install lines of the Quick start (the CI runs them). A
new example that is in none of the lists fails `test_every_example_is_run`: add it to one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from twin.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
SMALL = ["--model", "gpt-5b", "--gpus", "512", "--batch", "512"]

# ---- the twin: example -> the arguments run instead (None: as written) ----------------------------------
TWIN = {
    "twin simulate --system frontier": ["simulate", "--system", "frontier", *SMALL, "--simulate-top", "1"],
    "twin simulate --system perlmutter --model gpt-80b --gpus 1024 --json":
        ["simulate", "--system", "perlmutter", *SMALL, "--json", "--simulate-top", "1"],
    "twin simulate --system frontier --grid 8x8x4x128 --trace frontier-trace --html frontier.html":
        ["simulate", "--system", "frontier", *SMALL, "--grid", "2x2x2x64", "--trace", "frontier-trace",
         "--html", "frontier.html"],
    "twin search --system alps --top 5": ["search", "--system", "alps", *SMALL, "--top", "5", "--simulate-top", "1"],
    "twin report --system frontier --out report.html":
        ["report", "--system", "frontier", *SMALL, "--grid", "2x2x2x64", "--top", "0", "--out", "report.html"],
    "twin scaling --system frontier --series weak":
        ["scaling", "--system", "frontier", "--series", "weak", "--gpus", "512,1024", "--simulate-top", "1"],
    "twin sensitivity --system perlmutter":
        ["sensitivity", "--system", "perlmutter", "--model", "gpt-1b", "--gpus", "16", "--batch", "16",
         "--grid", "2x2x2x2"],
    "twin simulate --system h200 --model gpt-1b --grid 1x1x1x1": None,
    # docs/architecture.md (the engine and simpy)
    "twin simulate --system frontier --grid 2x32x64x8": None,
    # docs/fidelity.md
    "twin sensitivity --system frontier --model gpt-80b --gpus 8192 --grid 2x8x16x32":
        ["sensitivity", "--system", "frontier", "--model", "gpt-1b", "--gpus", "16", "--batch", "16",
         "--grid", "2x2x2x2"],
    "twin scaling --system frontier --series weak --gpus 512,8192,16384":
        ["scaling", "--system", "frontier", "--series", "weak", "--gpus", "512,1024", "--simulate-top", "1"],
    "twin simulate --system frontier --model gpt-80b --gpus 8192 --grid 2x8x16x32 --cache-layers 42": None,
    "twin sensitivity --system frontier --model gpt-5b --gpus 512 --grid 1x1x128x4":
        ["sensitivity", "--system", "frontier", "--model", "gpt-1b", "--gpus", "16", "--batch", "16",
         "--grid", "1x1x8x2"],
    "twin sensitivity --system frontier --model gpt-80b --gpus 8192 --grid 2x8x32x16":
        ["sensitivity", "--system", "frontier", "--model", "gpt-1b", "--gpus", "16", "--batch", "16",
         "--grid", "2x2x2x2"],
    "twin sensitivity --system frontier --model gpt-5b --gpus 512 --grid 1x1x64x8":
        ["sensitivity", "--system", "frontier", "--model", "gpt-1b", "--gpus", "16", "--batch", "16",
         "--grid", "1x1x8x2"],
    "twin simulate --system frontier:axonn-table": ["simulate", "--system", "frontier:axonn-table", *SMALL,
                                                    "--simulate-top", "1"],
    "twin sensitivity --system perlmutter --model gpt-80b --gpus 1024 --grid 1x4x64x4":
        ["sensitivity", "--system", "perlmutter", "--model", "gpt-1b", "--gpus", "16", "--batch", "16",
         "--grid", "1x4x4x1"],
    # README and docs/megatron.md: Megatron-LM's program on one Selene node (0.3 s)
    "twin simulate --system selene --model megatron-22b --gpus 8 --batch 4 --grid 1x8x1x1 --framework megatron": None,
    "twin search --system selene --model megatron-22b --gpus 8 --batch 4 --framework megatron --top 5":
        ["search", "--system", "selene", "--model", "megatron-22b", "--gpus", "8", "--batch", "4", "--framework",
         "megatron", "--top", "5", "--simulate-top", "1"],
    # docs/fidelity.md: the 3,072-GPU Megatron-LM row (about 1.5 s of CPU: pipelines simulated by units)
    "twin simulate --system selene --model megatron-1t --gpus 3072 --batch 3072 --grid 1x8x1x64x6 --micro-batches 512 "
    "--schedule interleaved --chunks 2 --framework megatron": None,
    # README and docs/sweeps.md: a 4-point sweep in place of the 15 points of gpt-20b
    "twin sweep docs/sweep-nic.toml --html sweep-nic.html":
        ["sweep", str(ROOT / "tests/fixtures/sweep-small.toml"), "--serial", "--out", "sweep.csv", "--html",
         "sweep-nic.html"],
}
TWIN.update({  # docs/topologies.md (all of Selene is built in about 10 ms)
    "twin topology --system selene --html selene.html": None,
    "twin topology --system dgx-h100 --grid 8x1x4x8": None,
})
TWIN.update({  # docs/pipeline.md
    "twin simulate --system frontier --model gpt-20b --gpus 128 --batch 512 --grid 4x2x2x2x4 --micro-batches 8": None,
    "twin simulate --system frontier --model gpt-320b --gpus 32768 --grid auto":
        ["simulate", "--system", "frontier", *SMALL, "--simulate-top", "1"],
})
TWIN.update({  # docs/moe.md: mixtral-8x7b's grid auto on 128 GCDs in place of 1,024
    "twin simulate --system frontier --model mixtral-8x7b --gpus 1024":
        ["simulate", "--system", "frontier", "--model", "mixtral-8x7b", "--gpus", "128", "--batch", "128",
         "--simulate-top", "1"],
    "twin simulate --system perlmutter --model mixtral-tiny --gpus 8 --grid 2x1x1x4e2 --moe-imbalance 1.5": None,
})
# scripts of benchmarks/ that a page shows: example -> the arguments run instead (None: as written), from the root
SCRIPTS = {"python benchmarks/axonn_comm_model.py": None,
           "python benchmarks/bench_measured_collectives.py --summary": None}
# run in this order, in one folder (the second reads the program file the first writes)
TWIN_CHAIN = ["twin program --model gpt-tiny --grid 2x2x2x1 --batch 8 --json-out prog.json",
              "twin simulate --system cpu --program prog.json"]

# ---- the backend, in the pages' order: example -> what runs instead (None: as written) ------------------
TINY_BENCH = ["--squares", "64", "--sizes-mib", "0.01", "--min-time", "0.01"]
BACKEND = [
    # README: what you simulate is what you run
    ("twin program --model gpt-tiny --grid 2x2x2x1 --batch 8 --json-out prog.json", None),
    ("backend run --program prog.json", "backend run --program prog.json --steps 2 --out runs/prog"),
    # README: a run resumes on another grid
    ("backend run --model gpt-tiny --grid 2x2x2x1 --steps 2 --ckpt-dir ck --ckpt-every 2", None),
    ("backend run --model gpt-tiny --grid 4x1x1x2 --steps 4 --ckpt-dir ck", None),
    # docs/backend.md
    ("backend run --model gpt-tiny --grid 2x2x2x1 --steps 50 --device cpu --out runs/tiny",
     "backend run --model gpt-tiny --grid 2x2x2x1 --steps 2 --device cpu --out runs/tiny"),
    ("cat twin/*/*.py backend/*/*.py > input.txt", "cat {root}/twin/*/*.py {root}/backend/*/*.py > input.txt"),
    ("backend run --model gpt-small --grid 1x1x2x2 --steps 200 --data input.txt --out runs/text --ckpt-dir ckpt/small "
     "--ckpt-every 50",
     "backend run --model gpt-small --grid 1x1x2x2 --steps 2 --data input.txt --out runs/text --ckpt-dir ckpt/small "
     "--ckpt-every 1"),
    (None, "backend run --model gpt-small --grid 1x1x2x2 --steps 3 --data input.txt --out runs/text --ckpt-dir ckpt/small "
           "--ckpt-every 1"),  # "rerun the same command to resume after a crash"
    ("backend replay --model gpt-tiny --grid 2x1x2x1 --out runs/replay", None),
    ("backend bench --grid 1x1x2x2", "backend bench --grid 1x1x2x2 " + " ".join(TINY_BENCH) + " --out bench.json"),
    # docs/calibration.md
    ("backend bench --for-twin --model gpt-small --ranks 1,2,4,8 --out bench",
     "backend bench --for-twin --model gpt-tiny --grids 2x1x1x1 --min-time 0.01 --train-steps 2 --out bench"),
    ("twin calibrate bench/bench-*.json --out twin/profiles/mycpu.toml",
     "twin calibrate bench/bench-2x1x1x1.json --out mycpu.toml"),
    ("backend run --model gpt-small --grid 2x2x2x1 --steps 6 --out runs/small",
     "backend run --model gpt-tiny --grid 2x1x1x1 --steps 4 --out runs/small"),
    ("twin validate runs/small --profile mycpu --json-out v.json --html v.html",
     "twin validate runs/small --profile mycpu.toml --json-out v.json --html v.html"),
    # docs/llama.md
    ("backend run --model llama-tiny --grid 2x2x2x1", "backend run --model llama-tiny --grid 2x2x2x1 --steps 2 "
     "--out runs/llama-tiny"),
    # docs/pipeline.md
    ("backend run --model gpt-tiny --grid 1x1x1x2x2 --micro-batches 2 --steps 20 --out runs/pipe",
     "backend run --model gpt-tiny --grid 1x1x1x2x2 --micro-batches 2 --steps 2 --out runs/pipe"),
    # docs/memorization.md (its first line, the `cat` above, makes input.txt)
    ("head -c -65536 input.txt > train.txt", None),
    ("tail -c 65536 input.txt > held_out.txt", None),
    ("backend run --model gpt-small --data train.txt --goldfish-k 4 --goldfish-h 13 --out runs/goldfish "
     "--eval-data held_out.txt --eval-every 50 --ckpt-dir ckpt/goldfish --ckpt-every 100",
     "backend run --model gpt-small --data train.txt --goldfish-k 4 --goldfish-h 13 --out runs/goldfish "
     "--eval-data held_out.txt --eval-every 1 --ckpt-dir ckpt/goldfish --ckpt-every 100 --steps 2 --eval-batches 1"),
    ("backend memorization-study --png docs/memorization.png",
     "backend memorization-study --png study/memorization.png --out study --epochs 2 --eval-every 1 --canaries 4 "
     "--texts 4 --batch 4"),
    # docs/fine-tuning.md
    ("python -c \"import torch, transformers as t; torch.manual_seed(0); t.LlamaForCausalLM(t.LlamaConfig("
     "hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, "
     "vocab_size=300, max_position_embeddings=16)).save_pretrained('tiny-llama')\"", None),
    ("python -c \"import json, random; r = random.Random(0); print(*(json.dumps({'prompt': f'{a}+{b}=', "
     "'response': f'{a + b};'}) for a, b in ((r.randrange(50), r.randrange(50)) for _ in range(64))), sep='\\n')\" "
     "> sums.jsonl", None),
    ("backend finetune --init-from tiny-llama --data sums.jsonl --grid 2x2x2x1 --steps 30 --eval-every 10 "
     "--out runs/ft --ckpt-dir ckpt/ft --export tiny-llama-tuned",
     "backend finetune --init-from tiny-llama --data sums.jsonl --grid 2x2x2x1 --steps 2 --eval-every 1 "
     "--out runs/ft --ckpt-dir ckpt/ft --export tiny-llama-tuned"),
    ("backend export --checkpoint ckpt/ft --out tiny-llama-tuned-bf16 --dtype bf16", None),
    ("backend run --init-from tiny-llama --grid 1x2x1x1 --steps 10 --data README.md",
     "backend run --init-from tiny-llama --grid 1x2x1x1 --steps 2 --data {root}/README.md --out runs/llama"),
    # docs/moe-backend.md
    ("backend run --model mixtral-tiny --grid 1x1x1x4e2 --steps 20 --out runs/moe",
     "backend run --model mixtral-tiny --grid 1x1x1x4e2 --steps 2 --out runs/moe"),
    # these run in this process (no ranks): after every command that starts ranks
    ('backend generate --checkpoint ckpt/goldfish --prompt "Once upon a time" --tokens 64', None),
    ('backend generate --checkpoint ckpt/goldfish --prompt "Once upon a time" --temperature 0.8 --top-k 40', None),
    ("head -c 8192 train.txt > first.txt", None),
    ("backend memorization --checkpoint ckpt/goldfish --data first.txt --prefix 32 --suffix 32 --out mem.json",
     "backend memorization --checkpoint ckpt/goldfish --data first.txt --prefix 32 --suffix 4 --out mem.json"),
]
ELSEWHERE = {
    "python benchmarks/bench_validate.py --out loops/cpu-$(date +%F) --profile twin/profiles/cpu.toml":
        "the developers' 35-grid loop (27-47 minutes); its passes and summaries are calibration.loop's, which "
        "tests/test_calibration.py::test_the_loop_end_to_end runs through `twin calibrate --run`",
    "twin calibrate --run --model gpt-small --grids 1x1x1x1,2x1x1x1,1x1x1x2,2x2x1x1,1x1x4x1,2x2x2x1,1x1x1x8 "
    "--out mycpu.toml": "the whole loop (about 7 minutes on a quiet 2-core machine); tests/test_calibration.py::"
                        "test_the_loop_end_to_end runs it small (gpt-tiny, one grid of 2 ranks, 2 runs)",
    "twin calibrate --run --model mixtral-tiny --grids 1x1x1x2e2,1x1x1x4e2,1x1x1x8e4,2x1x1x4e2 --out moe.toml":
        "the whole loop on an MoE model (about 4 minutes on 2 cores); tests/test_bench_plan.py plans its benches "
        "and tests/test_moe.py checks that profiles take its axes and all-to-alls",
    "python benchmarks/bench_published.py": "a benchmark run on demand (every published row: 13 s to a minute); "
                                            "tests/test_fidelity.py checks the parts it uses",
    "python benchmarks/bench_published.py --rows megatron":
        "Megatron-LM's seven Selene rows, minutes (the pipelines of 280-3,072 GPUs); tests/test_megatron.py runs one row",
    "python benchmarks/bench_published.py --figures frontier:axonn-table --figures perlmutter:axonn-table":
        "the same benchmark with other collective figures (tests/test_measured_collectives.py loads them)",
    "python benchmarks/bench_sweep.py": "a benchmark run on demand (200 points, minutes); tests/test_sweep.py "
                                        "checks a sweep on Dask against the serial run",
    "torchrun --nproc-per-node 8 -m backend.cli run --model gpt-5b --grid 2x2x2x1 --device cuda": "needs 8 GPUs",
    "srun -N 2 --ntasks-per-node 4 --gpus-per-task 1 backend run --model gpt-5b --grid 2x2x2x1 --device cuda":
        "needs Slurm and 8 GPUs",
}
COMMANDS = ("twin ", "backend ", "cat ", "head ", "tail ", "torchrun ", "srun ", "python benchmarks/", "python -c ")


def page_examples(path: Path) -> list[str]:
    """One page's command examples, in order (see the module docstring)."""
    text = path.read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].split("# ", 1)[0] if not line.lstrip().startswith("#") else ""
            for part in line.split("&&"):
                part = " ".join(part.split())
                if part.startswith(COMMANDS):
                    out.append(part)
    prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")
    for code in re.findall(r"`((?:twin|backend) [^`]+)`", prose):
        code = " ".join(code.split())
        placeholder = re.search(r"\[|\.\.\.|\b(S|M|N|G|K|B|E|FILE|DIR)\b", code)
        if " --" in code and not placeholder:
            out.append(code)
    return out


def examples() -> dict[str, str]:
    """Every page's examples, in order: example -> the first page that has it."""
    found: dict[str, str] = {}
    for page in PAGES:
        for example in page_examples(page):
            found.setdefault(example, str(page.relative_to(ROOT)))
    return found


def test_every_example_is_run():
    found = examples()
    assert len(found) >= 20, found
    known = set(TWIN) | set(TWIN_CHAIN) | set(SCRIPTS) | {r for r, _ in BACKEND if r} | set(ELSEWHERE)
    missing = [f"{page}: {e}" for e, page in found.items() if e not in known]
    assert not missing, f"examples no test runs (add each to TWIN, BACKEND or ELSEWHERE): {missing}"
    gone = [e for e in known if e not in found]
    assert not gone, f"examples the test runs that no page has any more: {gone}"


def test_the_readme_is_a_front_page():
    assert len(README.read_bytes()) <= 12 * 1024
    quick = re.search(r"## Quick start\n\n(.*?)\n## ", README.read_text(), flags=re.S).group(1)
    assert len(re.findall(r"```bash\n", quick)) == 2, "the Quick start is two commands"


def test_every_link_stays_in_the_repository():
    bad = []
    for page in PAGES:
        text, name = page.read_text(), page.relative_to(ROOT)
        if "shared/" in text:
            bad.append(f"{name} names shared/, which is outside the repository")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():  # not a web address
                bad.append(f"{name} links to {target}, which does not exist")
    assert not bad, bad


@pytest.mark.parametrize("example", list(TWIN))
def test_twin_example(example, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = TWIN[example] or shlex.split(example)[1:]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, (example, r.output)


def test_twin_program_file_examples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for example in TWIN_CHAIN:
        r = CliRunner().invoke(app, shlex.split(example)[1:])
        assert r.exit_code == 0, (example, r.output)


@pytest.mark.parametrize("example", list(SCRIPTS))
def test_script_example(example):
    args = SCRIPTS[example] or shlex.split(example)[1:]
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (example, r.stdout[-2000:], r.stderr[-2000:])


CHILD = r"""
import json, subprocess, sys, time
from typer.testing import CliRunner
from twin.cli.main import app as twin
from backend.cli.main import app as backend
for step in json.loads(sys.argv[1]):
    cmd, t0 = step["run"], time.perf_counter()
    if cmd.startswith(("twin ", "backend ")):
        import shlex
        argv = shlex.split(cmd)
        r = CliRunner().invoke(twin if argv[0] == "twin" else backend, argv[1:])
        code, out = r.exit_code, r.output
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            code, out = 99, out + repr(r.exception)
    else:
        r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
        code, out = r.returncode, r.stdout + r.stderr
    print(json.dumps({"readme": step["readme"], "run": cmd, "code": code, "out": out[-3000:],
                      "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
    if code:
        break
"""


def test_backend_examples(tmp_path):
    """The backend's examples in the pages' order, in one child process (torch imported once)."""
    pytest.importorskip("torch")
    steps = [{"readme": readme, "run": (run or readme).replace("{root}", str(ROOT))} for readme, run in BACKEND]
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(steps)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    done = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    failed = [d for d in done if d["code"]]
    assert not failed and len(done) == len(steps), (failed or done[-1:], r.stderr[-3000:])
    runs = [d["out"] for d in done if d["run"].startswith("backend run")]
    assert all(o.strip().splitlines()[-1].startswith("done: ") for o in runs), runs  # the summary line
    log = [json.loads(line)["step"] for line in (tmp_path / "runs/text/log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3], log  # the rerun resumed after step 2 (its checkpoint) and logged each step once
    print("\n".join(f"{d['seconds']:6.2f} s  {d['run']}" for d in done))
    assert "val_loss" in (tmp_path / "runs/goldfish/log.jsonl").read_text()
    for f in ("bench.json", "bench/bench-2x1x1x1.json", "mycpu.toml", "v.json", "v.html", "mem.json", "runs/replay/rank0.json"):
        assert (tmp_path / f).is_file(), f
    greedy = next(d["out"] for d in done if d["run"].startswith("backend generate"))
    assert greedy.startswith("Once upon a time"), greedy
