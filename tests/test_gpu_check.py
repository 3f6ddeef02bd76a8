"""benchmarks/gpu_check.sh, the one script a session with an H200 runs, dry-run on the CPU (gpt-tiny,
fp32; the overrides its header names) so that it does not rot in the sessions without a GPU: every
step runs, the summary holds both runs and the replay, and the printed line commits the bench
measurement, the fitted profile and the validation report from the tarball."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "MODEL": "gpt-tiny", "DEVICE": "cpu", "DTYPE": "fp32",
           "SQUARE": "256", "STEPS": "4", "PYTHON": sys.executable, "GIT_COMMIT": "test"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert [run["run"] for run in summary["runs"]] == ["run_no_recompute", "run_recompute"]
    assert all(run["steps"] == 4 and run["tokens_per_s"] > 0 for run in summary["runs"])
    assert summary["commit"] == "test" and summary["replay"]["gemms"] > 0
    with tarfile.open(out / "gpu_check_files.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./gemm.json", "./profile/cpu.toml", "./validate.json"} <= names
    keep = r.stdout.splitlines()[r.stdout.splitlines().index("to keep it (from the repository root):") + 1]
    for name in ("./gemm.json", "./profile", "./validate.json", f"{out}/gpu_check_files.tar.gz"):
        assert name in keep
    assert json.loads(tarfile.open(out / "gpu_check_files.tar.gz").extractfile("./validate.json").read())["runs"]
