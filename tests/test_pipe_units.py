"""Large pipelines simulated by units (twin.engine.units, twin.predict.pipe_units): a schedule worked by
hand, and the same iteration as the op-level engine on studies small enough for both."""

import pytest

from twin.engine.units import UnitCost, run_units
from twin.predict.pipe_units import use_units
from twin.predict.pipelined import simulate_pipelined
from twin.predict.study import prepare
from twin.program.grid import Grid
from twin.program.ops import Options
from twin.program.pipeline import schedule


def test_two_stages_by_hand():
    # 1F1B, P = 2, M = 2: a forward takes 1 s, a backward 2 s, a send 0.5 s.
    # stage 0: F0 [0,1] F1 [1,2], waits for B0's gradient (sent by stage 1 at [4.5,5]): B0 [5,7];
    #          B1's gradient is sent at [7.5,8]: B1 [8,10]
    # stage 1: F0 arrives at 1.5: F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]
    plans = [schedule("1f1b", 2, 2, 1, k) for k in range(2)]
    cost = lambda k, u: UnitCost(1.0 if u[0] == "F" else 2.0, 1.0 if u[0] == "F" else 2.0, {})  # noqa: E731
    lines = run_units(plans, 1, cost, lambda k, peer: 0.5, record=True)
    assert [ln.end_s for ln in lines] == [10.0, 7.5]
    assert [(u, s) for u, s, _ in lines[0].spans] == [(("F", 0, 0), 0.0), (("F", 1, 0), 1.0),
                                                      (("B", 0, 0), 5.0), (("B", 1, 0), 8.0)]
    assert lines[0].pipe_s == 1.0 and lines[0].bubble_s == 3.0     # waits [2,5] and [7,8], sends 0.5 each
    assert lines[1].pipe_s == 0.5 and lines[1].bubble_s == 1.0     # waits [0,1.5], the send [1,1.5]
    assert lines[0].compute_s == 6.0


def test_blocking_sends_hold_the_sender():
    # as above, but a stage waits for its own sends: stage 0 F0 [0,1] send [1,1.5], F1 [1.5,2.5]
    # send [2.5,3]; stage 1 F0 [1.5,2.5] B0 [2.5,4.5] send [4.5,5], F1 [5,6] B1 [6,8] send [8,8.5];
    # stage 0 B0 [5,7] B1 [8.5,10.5]
    plans = [schedule("1f1b", 2, 2, 1, k) for k in range(2)]
    cost = lambda k, u: UnitCost(1.0 if u[0] == "F" else 2.0, 1.0 if u[0] == "F" else 2.0, {})  # noqa: E731
    lines = run_units(plans, 1, cost, lambda k, peer: 0.5, blocking_sends=True)
    assert [ln.end_s for ln in lines] == [10.5, 8.5]
    assert lines[0].pipe_s == 1.0 + 1.0 and lines[1].pipe_s == 0.5 + 1.0


def test_deadlock_is_reported():
    plans = [[("B", 0, 0)], [("F", 0, 0)]]  # stage 0 waits for a gradient stage 1 never sends
    with pytest.raises(RuntimeError, match="deadlock"):
        run_units(plans, 1, lambda k, u: UnitCost(1.0, 1.0, {}), lambda k, p: 0.0)


@pytest.mark.parametrize("system, model, gpus, grid, options, batch, tol", [
    ("perlmutter", "gpt-20b", 256, "4x1x1x4x16", Options(micro_batches=16, schedule="1f1b"), None, 1e-4),
    ("frontier", "gpt-10b", 128, "2x2x2x4x4", Options(micro_batches=8, schedule="gpipe"), None, 1e-4),
    ("frontier", "gpt-320b", 1024, "8x2x1x8x8", Options(micro_batches=16, schedule="interleaved", chunks=2),
     None, 2e-3),
    ("cpu", "gpt-small", 8, "2x1x1x2x2", Options(micro_batches=4, schedule="interleaved", chunks=2), 8, 0.03),
])
def test_units_agree_with_ops(system, model, gpus, grid, options, batch, tol):
    study = prepare(system, model, gpus, batch=batch, options=options)
    g = Grid.parse(grid)
    ops = simulate_pipelined(study, g, units=False)
    units = simulate_pipelined(study, g, units=True)
    assert units.iteration_time_s == pytest.approx(ops.iteration_time_s, rel=tol)
    assert units.breakdown_s["compute"] == pytest.approx(ops.breakdown_s["compute"], rel=tol)
    b = units.breakdown_s
    total = b["compute"] + sum(b["exposed_comm"].values()) + b["bubble"] + b["idle"]
    assert total == pytest.approx(units.iteration_time_s, rel=1e-9)
    assert any("by units" in n for n in units.notes) and not any("by units" in n for n in ops.notes)


def test_many_micro_batches_go_by_units():
    o = Options(micro_batches=256, schedule="1f1b")
    study = prepare("frontier", "gpt-1b", 64, batch=1024, options=o)
    assert use_units(study.model, o)
    r = simulate_pipelined(study, Grid.parse("2x1x1x8x4"), record=True)
    assert any("by units" in n for n in r.notes)
    # 13.8 s op by op (376k ops) gave 9.908 s; by units 9.914 s in 0.2 s (measured 2026-12-03)
    assert r.iteration_time_s == pytest.approx(9.908, rel=0.01)
    units = [sp for sp in r.spans if sp.kind == "unit"]
    assert len(units) == 8 * 2 * 256  # every stage's forward and backward of every micro-batch
    assert max(sp.start_s + sp.duration_s for sp in r.spans) == pytest.approx(r.iteration_time_s)
