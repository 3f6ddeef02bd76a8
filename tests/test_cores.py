"""twin.host.cores: how the ranks of a CPU node share its cores (the stretch of their compute ops)."""

import pytest

from twin.host.cores import busy_shares, core_stretch, fixed_point, stretch_floor


def test_busy_shares_of_a_timeline():
    """One rank, 10 s: compute 0-4 s and 6-8 s (host time 0.5 s before each op), a collective
    in flight 3-7 s: kernels run 5 of 10 s, a collective 4 of 10 s."""
    coll = {2}
    spans = [(0, 0, 0.0, 4.0), (0, 1, 6.0, 2.0), (0, 2, 3.0, 4.0), (0, 3, 9.5, 0.5)]
    c, comm = busy_shares(spans, lambda i: i in coll, host_s=0.5)
    assert c == pytest.approx((3.5 + 1.5 + 0.0) / 10)
    assert comm == pytest.approx(0.4)
    # ranks are averaged
    two = spans + [(1, 0, 0.0, 10.0)]
    assert busy_shares(two, lambda i: i in coll, 0.0)[0] == pytest.approx((0.65 + 1.0) / 2)


def test_core_stretch_counts_the_runnable_threads_per_core():
    # 8 ranks on 2 cores, each computing 40 % of the time, collectives in flight 60 % at 0.35 core
    assert core_stretch(8, 2, 0.35, 0.4, 0.6) == pytest.approx((1 + 7 * (0.4 + 0.21)) / 2)
    # a grid whose ranks wait longer in collectives (less compute share) stretches less
    assert core_stretch(8, 2, 0.35, 0.25, 0.6) < core_stretch(8, 2, 0.35, 0.4, 0.6)
    # no fewer than 1: a rank never runs faster than its on-CPU time
    assert core_stretch(2, 2, 0.35, 0.3, 0.1) == 1.0


def test_ranks_within_the_cores_keep_the_stretch_measured_with_as_many_ranks():
    """2 ranks on 2 cores: the fluid demand stays under the cores, yet other threads take their
    slices (bench measured 1.04): the floor is that measured stretch; more ranks than cores: 1."""
    assert stretch_floor(2, 2, 1.04) == 1.04 and stretch_floor(4, 2, 1.5) == 1.0 and stretch_floor(2, 2, 0.9) == 1.0
    assert core_stretch(2, 2, 0.35, 0.3, 0.1, floor=1.04) == 1.04
    assert core_stretch(8, 2, 0.35, 0.4, 0.6, floor=1.04) == pytest.approx((1 + 7 * (0.4 + 0.21)) / 2)


def test_the_fixed_point_takes_the_secant_where_the_map_is_a_contraction():
    """g(x) = 1 + 0.3 x (the stretch map's slope on 8 ranks: 0.1-0.3) from 3: plain steps take 9
    evaluations to settle within 1e-4; the secant meets the line's root after 2 and stops at the third.
    A map whose slope leaves (0, 2/3) keeps the plain step, and still settles."""
    calls = []

    def g(x):
        calls.append(x)
        return 1.0 + 0.3 * x

    x = fixed_point(g, 3.0)
    assert x == pytest.approx(1 / 0.7, rel=1e-9) and len(calls) == 3
    calls.clear()
    assert fixed_point(g, 3.0, rounds=1) == pytest.approx(1.9) and len(calls) == 1  # out of rounds: the last step
    calls.clear()
    x = fixed_point(lambda v: calls.append(v) or 2.0 - 0.5 * v, 3.0)  # slope < 0: plain steps, damped around 4/3
    assert x == pytest.approx(4 / 3, rel=2e-4) and len(calls) > 3
    assert fixed_point(lambda v: max(1.0, 0.1 * v), 3.0) == 1.0  # a floor: settles there
