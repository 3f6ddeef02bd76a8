"""The host's time of an MoE dispatch that exchanges its row counts first (twin.host.order): which
all-to-alls do, what the twin charges for them where a CPU profile measured it (`host_exchange_s`),
and how `twin calibrate` measures it from bench's recorded steps (calibration.sharing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from calibration.sharing import exchange_measured
from twin.costs.profile import load_profile
from twin.host.order import charged_issues, count_exchange, host_ordered, host_times
from twin.predict.run import simulate_grid
from twin.predict.study import prepare
from twin.program.grid import Grid
from twin.program.model import load_model
from twin.program.program import Options, build_program


def _program(grid: str = "1x1x1x4e2"):
    return host_ordered(build_program(load_model("mixtral-tiny"), Grid.parse(grid), Options()))


def test_the_forward_and_recomputed_dispatches_exchange_counts():
    """As the executor runs them: the first all-to-all toward the experts after each routing (the
    forward's and the recompute's dispatch of each block), not the combines nor the backward's."""
    prog = _program()
    names = sorted(op.name for op in prog.ops if op.is_collective and count_exchange(op))
    assert names == ["L0.moe.fwd.dispatch", "L0.moe.rec.dispatch", "L1.moe.fwd.dispatch", "L1.moe.rec.dispatch"]
    assert not any(count_exchange(op) for op in _program("1x1x1x2").ops)  # dense grid of the model: no all-to-all


def test_host_times_charge_the_exchange_to_the_op_after_it_and_nothing_without_it():
    prog = _program()
    ops = prog.ops
    plain = host_times(ops, 1e-4, 2e-4)
    assert host_times(ops, 1e-4, 2e-4, 0.0) == plain  # not measured: as before
    with_ex = host_times(ops, 1e-4, 2e-4, 3e-3)
    charged = charged_issues(ops)
    after, pending = [], False  # the first compute op after each exchange, in the order the host runs them
    for i, op in enumerate(ops):
        if op.is_collective:
            pending = pending or count_exchange(op)
        elif pending:
            after.append(i)
            pending = False
    assert len(after) == 4
    for i, op in enumerate(ops):
        if op.is_collective:
            assert with_ex[i] == 0.0
            continue
        exchanged = 3e-3 if i in after else 0.0
        plain_issues = sum(not count_exchange(c) for c in charged[op.index])
        assert with_ex[i] == pytest.approx(1e-4 + 2e-4 * plain_issues + exchanged)
    # the four dispatches are waited for (the expert GEMM reads their rows): uncharged before
    assert sum(with_ex) - sum(plain) == pytest.approx(4 * 3e-3)


def test_a_profile_with_host_exchange_s_lengthens_the_moe_step_by_the_exchanges(tmp_path):
    """The shipped CPU profile with `host_exchange_s` added to its 4-rank node share: mixtral-tiny on
    1x1x1x4e2 (4 exchanges per step, each on the critical path) takes longer by about 4 of them; a dense
    grid of the same model (no all-to-all) not at all."""
    base = (Path(__file__).resolve().parent.parent / "twin" / "profiles" / "cpu.toml").read_text()
    lines = base.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln == "ranks = 4" and lines[i - 1] == "[[node_share]]")
    lines.insert(at + 1, 'host_exchange_s = { value = 0.002, source = "test: 2 ms per exchange" }')
    p = tmp_path / "cpu-ex.toml"
    p.write_text("\n".join(lines) + "\n")
    assert load_profile(str(p)).for_ranks(4).host.exchange_s == 0.002

    def step(profile, grid):
        spec = load_model("mixtral-tiny")
        study = prepare("cpu", spec, 4, 8, spec.seq_len, Options(), profile=profile, gemm_tuning=False)
        return simulate_grid(study, Grid.parse(grid)).iteration_time_s

    before, after = step("cpu", "1x1x1x4e2"), step(str(p), "1x1x1x4e2")
    assert 4 * 0.002 * 0.7 < after - before < 4 * 0.002 * 1.6
    assert step(str(p), "1x1x1x4") == step("cpu", "1x1x1x4")


def test_calibrate_measures_the_exchange_from_the_dispatches_issue_times():
    """calibration.sharing.exchange_measured: the mean issue time of the count-exchanging dispatches of
    bench's recorded steps, the other all-to-alls' and collectives' left out; None without any."""
    prog = build_program(load_model("mixtral-tiny"), Grid.parse("1x1x1x2e2"), Options())
    rows = [{"name": op.name, "kind": op.kind, "issue_s": 0.004 if count_exchange(op) else 0.0003}
            for op in prog.ops if op.is_collective]
    run = {"model": "mixtral-tiny", "grid": "1x1x1x2e2", "steps": rows}
    got = exchange_measured([run])
    assert got is not None and got[0] == pytest.approx(0.004) and "4 such dispatches" in got[1]
    dense = {"model": "mixtral-tiny", "grid": "1x1x1x2",
             "steps": [r for r in rows if r["kind"] != "all_to_all"]}
    assert exchange_measured([dense]) is None
