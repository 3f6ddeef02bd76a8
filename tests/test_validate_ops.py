"""What a recorded span means on CPU, and how `twin validate` compares an op with the twin's:
on-CPU time spread over the rank's compute ops as a fluid share of the cores, collectives span to
span with the time spent waiting for the group's last member."""

from __future__ import annotations

import time

import pytest

from calibration.validate_measured import measured_ops
from twin.program.grid import Grid
from twin.program.trace import Span


def test_a_compute_span_carries_its_on_cpu_time():
    """A compute op that is off the CPU for part of its span (here: asleep, as a descheduled rank
    is) records less CPU time than wall time; a collective records none (it runs on gloo's thread)."""
    from backend.runtime.recorder import Recorder

    rec = Recorder()
    with rec.op("L0.gelu.fwd", "elementwise"):
        time.sleep(0.03)
    with rec.op("L0.qkv.fwd.gemm", "gemm", m=1, n=1, k=1, layout="NN"):
        end = time.thread_time() + 0.02
        while time.thread_time() < end:  # on the CPU the whole span
            pass
    r = rec.begin("L0.qkv.fwd.ar_x", "all_reduce", "x", axis="x", bytes=8)
    rec.end(r)
    asleep, busy, coll = rec.spans(0)
    assert asleep.duration_s >= 0.03 and asleep.args["cpu_us"] < 0.5 * asleep.duration_s * 1e6
    assert 0.0199e6 <= busy.args["cpu_us"] <= busy.duration_s * 1e6 + 1e-3  # its 20 ms of CPU, whatever the load
    assert "cpu_us" not in coll.args


def _span(rank, name, kind, start, wall, cpu=None, axis=None):
    args = {"kind": kind}
    if cpu is not None:
        args["cpu_us"] = cpu * 1e6
    if axis:
        args["axis"] = axis
    return Span(rank, name, kind, axis or "compute", start, wall, args)


def test_descheduled_time_is_spread_over_the_rank_as_a_fluid_share():
    """Rank 1 lost 9 ms to another rank inside `b`: its wall spans are 1 ms and 10 ms, its on-CPU
    times 1 ms each. Compared with the twin, each of its ops takes 1 ms x (11 / 2) = 5.5 ms: the
    rank's total is kept, the arbitrary attribution to `b` is not."""
    spans = [_span(0, "a", "gemm", 0.000, 0.001, 0.001), _span(0, "b", "gemm", 0.001, 0.001, 0.001),
             _span(1, "a", "gemm", 0.000, 0.001, 0.001), _span(1, "b", "gemm", 0.001, 0.010, 0.001)]
    got = measured_ops(spans, Grid(1, 1, 1, 2))
    assert got["stretch"] == {0: 1.0, 1: pytest.approx(5.5)}
    assert got["fluid"]["a"] == pytest.approx([0.001, 0.0055]) and got["fluid"]["b"] == pytest.approx([0.001, 0.0055])
    assert sum(got["fluid"]["a"][1:] + got["fluid"]["b"][1:]) == pytest.approx(0.011)  # rank 1's total
    assert got["wall"]["b"] == [0.001, 0.010] and got["cpu_source"] == "recorded (cpu_us)"
    # a trace written before cpu_us: the fastest rank's wall span stands for the op's on-CPU time
    old = [Span(s.rank, s.name, s.kind, s.stream, s.start_s, s.duration_s, {"kind": s.kind}) for s in spans]
    got = measured_ops(old, Grid(1, 1, 1, 2))
    assert got["cpu"]["b"] == [0.001, 0.001] and got["cpu_source"] == "fastest rank's wall span"
    # GPU kernels are not time-sliced: the wall span is compared as it is
    assert measured_ops(old, Grid(1, 1, 1, 2), time_sliced=False)["fluid"]["b"] == [0.001, 0.010]


def test_a_collective_waits_for_its_groups_last_member():
    """An all-reduce over x issued at 0 ms on rank 0 and at 3 ms on rank 1 (both complete at 5 ms):
    rank 0 waited 3 ms for its peer; the spans themselves are compared as recorded."""
    spans = [_span(0, "ar", "all_reduce", 0.000, 0.005, axis="x"), _span(1, "ar", "all_reduce", 0.003, 0.002, axis="x"),
             _span(2, "ar", "all_reduce", 0.000, 0.001, axis="x"), _span(3, "ar", "all_reduce", 0.000, 0.001, axis="x")]
    got = measured_ops(spans, Grid(2, 1, 1, 2))
    assert got["wait"]["ar"] == pytest.approx([0.003, 0.0, 0.0, 0.0])
    assert got["fluid"]["ar"] == [0.005, 0.002, 0.001, 0.001]


def test_a_collectives_wake_up_counts_as_the_twins_line_holds_it():
    """Rank 0 issues an all-reduce at 1 ms (after compute `a`), it completes at 5 ms, and the compute
    op that waited for it starts at 7 ms: 2 ms of wake-up, of which the twin charges 0.5 ms of host
    time to that op and the rest to the collective's line (bench's wake_s), so the collective is
    compared as 4 + 1.5 ms. Rank 1's waited op started at its completion: its span as it is. On a GPU
    no wake-up is added."""
    spans = [_span(0, "a", "gemm", 0.000, 0.001, 0.001), _span(0, "ar", "all_reduce", 0.001, 0.004, axis="x"),
             _span(0, "b", "gemm", 0.007, 0.001, 0.001),
             _span(1, "a", "gemm", 0.000, 0.001, 0.001), _span(1, "ar", "all_reduce", 0.001, 0.004, axis="x"),
             _span(1, "b", "gemm", 0.005, 0.001, 0.001)]
    got = measured_ops(spans, Grid(2, 1, 1, 1), host_s=0.0005)
    assert got["wake"]["ar"] == pytest.approx([0.002, 0.0])
    assert got["fluid"]["ar"] == pytest.approx([0.0055, 0.004])
    assert measured_ops(spans, Grid(2, 1, 1, 1), time_sliced=False, host_s=0.0005)["fluid"]["ar"] == [0.004, 0.004]


def test_the_twins_excess_over_a_collective_alone_is_known_per_op():
    """A collective inside training costs its line measured alone plus the profile's per-op excess
    (the wait for the last member among it): validate takes that excess off the predicted span to
    compare from the last member's arrival. The committed CPU profile, 8 ranks, grid 2x2x2x1."""
    from calibration.validate import _excess_of
    from twin.costs.profile_types import CollectiveTable
    from twin.predict.study import prepare
    grid = Grid(2, 2, 2, 1)
    study = prepare("cpu", "gpt-small", 8, 16, None, profile="cpu", gemm_tuning=False)
    excess = _excess_of(study, grid)
    table = study.profile.collectives()
    alone = CollectiveTable(table.points, table.activation_bytes)
    rs = "L0.mlp_down.bwd.rs_z"
    args = ("reduce_scatter", "z", 2, 1 << 17, grid.stride("z"))
    assert excess[rs] == pytest.approx(table.time(*args) - alone.time(*args))
    assert excess[rs] > 0 and all(v >= 0 for v in excess.values())
    assert not any(name.endswith("ar_data") for name in excess)  # no data axis on this grid


def test_collectives_from_the_last_arrival_and_done_with_the_one_before(tmp_path):
    """A run traced by the twin itself (no peer wait): from the last arrival, the twin's span less its
    per-op excess against the whole measured span; a collective recorded as 0 s completed with the one
    issued before it on its stream (two in flight at once, as gloo runs them)."""
    import json
    from fake_run import fake_run
    from calibration.validate import validate_run
    d = fake_run(tmp_path, "2x1x1x1")
    r = validate_run(d)
    ar = r["ops"]["by_kind"]["all_reduce"]
    assert ar["completed_with_previous_share"] == 0
    ops = [o for o in r["per_op"] if o["kind"] == "all_reduce"]
    assert ops and all(o["error"] == pytest.approx(0, abs=1e-6) for o in ops)
    for o in ops:
        assert o["error_from_last_arrival"] == pytest.approx(-o["predicted_excess_s"] / o["measured_s"], abs=1e-6)
    f = d / "trace" / "rank0.json"
    trace = json.loads(f.read_text())
    events = [e for e in trace["traceEvents"] if e.get("args", {}).get("kind") == "all_reduce"]
    events[1]["dur"] = 0.0
    f.write_text(json.dumps(trace))
    share = validate_run(d)["ops"]["by_kind"]["all_reduce"]["completed_with_previous_share"]
    assert share == pytest.approx(1 / len(events))
