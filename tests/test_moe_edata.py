"""An MoE step's expert-gradient all-reduces (axis edata) on a measured CPU profile: their own line inside
training at their real payload (fp32 gradients, as the data axis'), bench keeping the collectives whose
recorded span is 0, and measurement files that hold them (twin.costs.alltoall.measured_time,
twin.costs.profile_types.payload_bytes, backend.bench.steps.kept_rows, calibration.measurements)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from calibration.measurements import load_measurement
from topologies.common import TwinError
from twin.costs.alltoall import measured_time
from twin.costs.profile import load_profile
from twin.costs.profile_types import payload_bytes
from twin.program.grid import Grid

ROOT = Path(__file__).resolve().parent.parent
EDATA_LINE = """
[[collective_training]]
kind = "all_reduce"
axis = "edata"
group_size = 2
stride = 4
ranks = 8
latency_s = { value = 0.0001, source = "test" }
bandwidth = { value = 1e9, source = "test" }
"""


def _measured(tmp_path, extra: str = ""):
    """The shipped CPU profile (gpt-small's fit: no MoE lines), plus `extra`, as 1x1x1x8e4 sees it."""
    p = tmp_path / "cpu-edata.toml"
    p.write_text((ROOT / "twin" / "profiles" / "cpu.toml").read_text() + extra)
    return SimpleNamespace(measured=load_profile(str(p)).for_ranks(8).collectives(), grid=Grid.parse("1x1x1x8e4"))


def test_an_edata_all_reduce_takes_its_own_line_at_its_gradient_bytes(tmp_path):
    # 1x1x1x8e4: edata groups of 2 at stride 4 (E_p = 4); it was read as a data all-reduce of 2 ranks,
    # a line no grid with edata has, and its fp32 bytes would have been doubled as activations
    cm = _measured(tmp_path, EDATA_LINE)
    assert measured_time(cm, "all_reduce", "edata", 65536) == pytest.approx(1e-4 + 65536 / 1e9)
    # the all-to-alls over the expert axis are unchanged: activations, scaled to the CPU's fp32
    assert cm.measured.trained("all_reduce", "edata", 2) and not cm.measured.trained("all_reduce", "edata", 4)


def test_without_an_edata_line_it_is_read_as_a_data_all_reduce_as_before(tmp_path):
    cm = _measured(tmp_path)
    assert not cm.measured.trained("all_reduce", "edata", 2)
    got = measured_time(cm, "all_reduce", "edata", 65536)
    assert got is not None and got == cm.measured.time("all_reduce", "data", 2, 65536, 4)


def test_gradient_payloads_are_not_scaled_as_activations():
    assert payload_bytes("data", 1000, 4) == payload_bytes("edata", 1000, 4) == 1000
    assert payload_bytes("x", 1000, 4) == payload_bytes("expert", 1000, 4) == 2000  # bf16 counted, fp32 sent
    assert payload_bytes("edata", 1000, 2) == payload_bytes("z", 1000, 2) == 1000


def test_bench_keeps_collectives_recorded_at_a_span_of_0():
    from backend.bench.steps import kept_rows
    rows = [{"name": "a.gemm", "kind": "gemm", "seconds": 0.001},
            {"name": "a.grad.ar_edata", "kind": "all_reduce", "seconds": 0.0},
            {"name": "b.grad.ar_edata", "kind": "all_reduce", "seconds": 0.0},  # never recorded
            {"name": "c.elementwise", "kind": "elementwise", "seconds": 0.0}]
    assert [r["name"] for r in kept_rows(rows, {"a.gemm", "a.grad.ar_edata", "c.elementwise"})] == \
        ["a.gemm", "a.grad.ar_edata"]


def test_a_measurement_file_takes_a_collective_of_0_s_and_refuses_a_compute_op_of_0_s(tmp_path):
    data = json.loads((ROOT / "tests" / "fixtures" / "cpu-2026-12-03a" / "bench-1x1x1x2.json").read_text())
    coll = next(i for i, r in enumerate(data["steps"]) if r["kind"] == "all_reduce")
    data["steps"][coll]["seconds"] = 0.0
    p = tmp_path / "bench.json"
    p.write_text(json.dumps(data))
    assert load_measurement(p)["steps"][coll]["seconds"] == 0.0
    comp = next(i for i, r in enumerate(data["steps"]) if r["kind"] == "gemm")
    data["steps"][comp]["seconds"] = 0.0
    p.write_text(json.dumps(data))
    with pytest.raises(TwinError, match=rf"steps\[{comp}\]\.seconds must be > 0 for a gemm op"):
        load_measurement(p)


def test_a_fit_takes_an_axis_whose_recorded_spans_are_all_0(tmp_path):
    # 1x1x1x8e4's edata all-reduces all completed with the data one before them: the axis' slowdown
    # over its line alone is then 0, which the profile's range refused; it is floored at 1e-6
    from calibration.fit import calibrate
    data = json.loads((ROOT / "tests" / "fixtures" / "cpu-2026-12-03a" / "bench-2x1x1x1.json").read_text())
    for row in data["steps"]:
        if row["kind"] == "all_reduce":
            row["seconds"], row["wake_s"] = 0.0, 0.0
    p = tmp_path / "bench-2x1x1x1.json"
    p.write_text(json.dumps(data))
    calibrate([p], tmp_path / "zero.toml")
    prof = load_profile(str(tmp_path / "zero.toml")).for_ranks(2)
    assert prof.collectives().axis_slowdown["x"] == pytest.approx(1e-6)
