"""twin.host.spread: spans drawn at the spread bench measured (CPU ranks time-slicing their node's cores)."""

import math
import statistics
from types import SimpleNamespace

import pytest

from twin.program.grid import Grid
from twin.program.model import load_model
from twin.host.order import host_ordered
from twin.program.program import build_program
from twin.host.spread import DRAWS, draws, drawn_runs, factors, mean_result, op_spreads, spread_key


def _program(grid: str):
    return host_ordered(build_program(load_model("gpt-tiny"), Grid.parse(grid)))


def test_factors_are_log_normal_of_mean_one_in_antithetic_pairs():
    f = factors([0.0, 0.5, 0.5], [1.0, 1.0, -1.0])
    assert f[0] == 1.0
    s = math.sqrt(math.log(1.25))
    assert f[1] == pytest.approx(math.exp(s - s * s / 2)) and f[1] * f[2] == pytest.approx(math.exp(-s * s))
    many = draws([0.7] * 4000)
    assert len(many) == DRAWS and DRAWS % 2 == 0
    assert all(a * b == pytest.approx(math.exp(-math.log(1 + 0.49))) for a, b in zip(many[0], many[1]))
    flat = [x for d in many for x in d]
    assert statistics.fmean(flat) == pytest.approx(1.0, abs=0.02)
    assert statistics.pstdev(flat) == pytest.approx(0.7, rel=0.1)
    assert draws([0.7] * 10) == draws([0.7] * 10)  # seeded


def test_only_collectives_beside_compute_are_drawn():
    """1x1x2x2: the z all-gathers are prefetched (the compute op after their issue does not wait for
    them) and drawn at their own class; a collective waited for at once is not drawn; compute ops
    at the compute spread; a class not measured falls back to every collective's."""
    prog = _program("1x1x2x2")
    spread = {"compute": 0.4, spread_key("all_gather", "z"): 0.6, "collective": 0.5}
    got = op_spreads(prog.ops, spread)
    by = {(op.kind, op.axis, cv) for op, cv in zip(prog.ops, got) if op.is_collective}
    assert ("all_gather", "z", 0.6) in by and ("reduce_scatter", "z", 0.5) in by
    waited = [cv for op, cv in zip(prog.ops, got) if op.is_collective and cv == 0.0]
    assert waited  # the last of the backward's collectives, which the optimizer step waits for
    assert all(cv == 0.4 for op, cv in zip(prog.ops, got) if not op.is_collective)
    assert op_spreads(prog.ops, {}) == [0.0] * len(prog.ops)


def test_drawn_runs_time_each_op_by_its_factor_and_keep_the_host_time():
    prog = _program("1x1x2x1")
    n = len(prog.ops)
    hosts = [0.0 if op.is_collective else 1e-4 for op in prog.ops]
    compute = [0.0 if op.is_collective else 1e-3 + h for op, h in zip(prog.ops, hosts)]
    seen = []

    def engine(p, comp, coll, **kw):
        assert kw == {"record": True, "by_size": False}
        seen.append((comp, [coll(i, frozenset()) for i in range(n)]))
        return SimpleNamespace(iteration_s=sum(comp))
    runs = drawn_runs(prog, compute, hosts, lambda i, _c: 2e-3, {"compute": 0.5, "collective": 0.5}, engine,
                      record=True)
    assert len(runs) == DRAWS == len(seen)
    f = draws(op_spreads(prog.ops, {"compute": 0.5, "collective": 0.5}))
    for (comp, coll), fk in zip(seen, f):
        for i, op in enumerate(prog.ops):
            if op.is_collective:
                assert coll[i] == pytest.approx(2e-3 * fk[i])
            else:
                assert comp[i] == pytest.approx(1e-3 * fk[i] + 1e-4)


def test_the_mean_result_keeps_the_timeline_of_mean_spans():
    from twin.engine.engine import EngineResult
    plain = EngineResult(1.0, 0.6, {"z": 0.3}, 0.1, 10, 1, spans=[(0, 0, 0.0, 1.0)])
    runs = [EngineResult(1.2, 0.6, {"z": 0.5}, 0.1, 10, 1), EngineResult(1.0, 0.6, {"z": 0.3}, 0.1, 10, 1)]
    got = mean_result(plain, runs)
    assert got.iteration_s == pytest.approx(1.1) and got.exposed_s == {"z": pytest.approx(0.4)}
    assert got.spans == plain.spans and got.compute_s + sum(got.exposed_s.values()) + got.idle_s == pytest.approx(1.1)


@pytest.mark.parametrize("line,match", [
    ('span_spread = { compute = 0.5, all_gather_q = 0.3, source = "bench" }', "all_gather_q is not a known key"),
    ('span_spread = { compute = -0.5, source = "bench" }', "compute must be a finite number in \\[0, 100\\]"),
    ('span_spread = { compute = 0.5 }', "span_spread.source is missing")])
def test_a_malformed_span_spread_gets_one_line(tmp_path, line, match):
    from pathlib import Path
    from topologies.common import TwinError
    from twin.costs.profile import load_profile
    import re
    text = (Path(__file__).resolve().parent.parent / "twin" / "profiles" / "cpu.toml").read_text()
    text = re.sub(r"(?m)^span_spread = .*\n", "", text)  # the shipped profile's own, measured
    good = text.replace("[[node_share]]\nranks = 8\n",
                        '[[node_share]]\nranks = 8\nspan_spread = { compute = 0.7, all_gather_z = 0.6, source = "bench" }\n', 1)
    assert good != text
    (tmp_path / "good.toml").write_text(good)
    assert load_profile(str(tmp_path / "good.toml")).for_ranks(8).host.span_spread == {"compute": 0.7, "all_gather_z": 0.6}
    (tmp_path / "bad.toml").write_text(text.replace("[[node_share]]\nranks = 8\n", f"[[node_share]]\nranks = 8\n{line}\n", 1))
    with pytest.raises(TwinError, match=match):
        load_profile(str(tmp_path / "bad.toml"))
