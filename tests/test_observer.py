"""Bench's recorded training steps against unrecorded ones: bench runs an unrecorded step after each
recorded one (backend.bench.steps), and the fit takes the recorder's time out of the recorded steps'
wall times, per file (calibration.measurements.unobserved)."""

from __future__ import annotations

import pytest

from calibration.measurements import describe, observer_ratio, unobserved


def _file(name: str, ranks: int, step_s: float, free_step_s: float | None) -> dict:
    host = {"op": "host", "numel": 0, "bytes": 0, "seconds": 1e-4, "mean_s": 2e-4, "all_gaps_s": 1e-4,
            "free_mean_s": 1.5e-4, "busy_mean_s": 3e-4, "busy_by_kind_s": {"all_reduce": 4e-4}, "step_s": step_s}
    if free_step_s is not None:
        host["free_step_s"] = free_step_s
    steps = [{"name": "a.gemm", "kind": "gemm", "stream": "compute", "seconds": 2e-3, "cpu_s": 1.9e-3},
             {"name": "a.ar_x", "kind": "all_reduce", "stream": "x", "seconds": 1e-3, "wake_s": 2e-4, "issue_s": 1e-4}]
    return {"path": f"/m/{name}.json", "machine": {"host": "vm", "date": "d"}, "ranks_per_node": ranks,
            "ops": [{"op": "gemm_probe", "seconds": 1.0}, host], "steps": steps}


def test_recorded_steps_are_scaled_to_the_unrecorded_ones_of_their_file():
    files = [_file("a", 8, 0.30, 0.25), _file("b", 8, 0.20, 0.20), _file("c", 2, 0.1, None)]
    assert [observer_ratio(f) for f in files] == [pytest.approx(1.2), pytest.approx(1.0), None]
    a, b, c = (unobserved(f) for f in files)
    assert a["observer"] == pytest.approx(1.2)
    gemm, ar = a["steps"]
    assert gemm["seconds"] == pytest.approx(2e-3 / 1.2)
    assert gemm["cpu_s"] == pytest.approx(2e-3 / 1.2)  # on-CPU time kept, within its span
    assert (ar["seconds"], ar["wake_s"], ar["issue_s"]) == pytest.approx((1e-3 / 1.2, 2e-4 / 1.2, 1e-4 / 1.2))
    host = a["ops"][1]
    assert (host["free_mean_s"], host["step_s"]) == pytest.approx((1.5e-4 / 1.2, 0.25))
    assert host["busy_by_kind_s"]["all_reduce"] == pytest.approx(4e-4 / 1.2)
    assert a["ops"][0] == {"op": "gemm_probe", "seconds": 1.0}  # microbenchmarks are not recorded steps
    assert "recorded steps / 1.200" in describe(a)
    assert b["steps"][0]["seconds"] == pytest.approx(2e-3) and b["observer"] == pytest.approx(1.0)
    assert c is files[2] and "observer" not in c and "recorded steps" not in describe(c)  # older files as they are
    assert files[0]["steps"][0]["seconds"] == 2e-3  # the file read is left as it is


def test_bench_records_every_other_step_after_the_warm_up():
    from backend.bench.steps import WARMUP_STEPS, is_recorded
    assert [is_recorded(s) for s in range(WARMUP_STEPS + 8)] == [False] * WARMUP_STEPS + [True, False] * 4
