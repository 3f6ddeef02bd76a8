"""The arithmetic of the CPU benchmarks that explain the loop's misses: benchmarks/cpu_sched_split.py
(where a rank's wall time goes) and benchmarks/cpu_op_noise.py --bench (bench's GEMM times against the
runs')."""

import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_split_puts_each_interval_on_its_side():
    """Two ops with a gap between them: the ops' wall, CPU and run-queue deltas add up on the op side,
    the gap's on the gap side; marks before the first op's end or after the last op's begin are left
    out of the gaps."""
    from cpu_sched_split import split
    marks = [("b", 0.0, 0.0, 0.0), ("e", 5.0, 2.0, 3.0),    # op 1: 2 s CPU, 3 s on the run queue
             ("b", 9.0, 2.5, 6.0),                          # gap: 0.5 s CPU, 3 s queued, 0.5 s asleep
             ("e", 10.0, 3.5, 6.0)]                         # op 2: 1 s CPU
    t = split(marks)
    assert t == pytest.approx({"op_wall": 6.0, "op_cpu": 3.0, "op_rq": 3.0,
                               "gap_wall": 4.0, "gap_cpu": 0.5, "gap_rq": 3.0})
    from cpu_sched_split import report
    line = report("1x1x1x2", [[t], [t]], plain=False)
    assert "op stretch 2.00" in line and "rq in gaps 0.50" in line and "sleeping 500" in line, line


def test_gemm_cpu_drift_is_over_the_runs_median():
    """Each bench file's and each run's summed GEMM on-CPU time over the runs' median, on the GEMMs
    that every one of them has (others, and non-GEMM ops, left out)."""
    from cpu_op_noise import gemm_cpu_drift

    def run(a, b):
        return {"per_op": [{"name": "g1", "kind": "gemm", "cpu_s": a}, {"name": "g2", "kind": "gemm", "cpu_s": b},
                           {"name": "ln", "kind": "layernorm", "cpu_s": 9.0}]}
    runs = [run(1.0, 1.0), run(1.5, 1.5), run(0.5, 0.5)]
    benches = [{"steps": [{"name": "g1", "kind": "gemm", "cpu_s": 1.1}, {"name": "g2", "kind": "gemm", "cpu_s": 1.1},
                          {"name": "g3", "kind": "gemm", "cpu_s": 50.0}]}]
    bench, each = gemm_cpu_drift(runs, benches)
    assert bench == pytest.approx([1.1]) and each == pytest.approx([1.0, 1.5, 0.5])


def test_bench_passes_of_02h_drift_with_the_machine(tmp_path):
    """cpu_op_noise.py --bench on cpu-2026-12-02h's 8x1x1x1: the first bench pass's GEMMs ran 0.99 of
    the runs' median on-CPU time, the second 1.18 (the runs 0.89-1.15): the profile's in-training GEMM
    time moves with when bench ran, not by how it measures."""
    import json
    from calibration.validate import validate_run
    from cpu_op_noise import gemm_cpu_drift
    loop = ROOT / "calibration" / "measurements" / "cpu-2026-12-02h"
    with tarfile.open(loop / "runs.tar.xz") as tar:
        tar.extractall(tmp_path, members=[m for m in tar.getmembers() if m.name.split("/")[1:2] == ["8x1x1x1"]],
                       filter="data")
    runs = [validate_run(f.parent) for f in sorted((tmp_path / "runs" / "8x1x1x1").rglob("log.jsonl"))]
    assert len(runs) == 4
    benches = [json.loads((loop / f"bench-8x1x1x1{p}.json").read_text()) for p in ("", "-p2")]
    (first, second), each = gemm_cpu_drift(runs, benches)
    assert first < 1.02 and second > 1.12 and min(each) < 0.95 and max(each) > 1.1, (first, second, each)
