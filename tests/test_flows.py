"""Max-min fair rates on small hand-checkable networks."""

import numpy as np
import pytest

from twin.costs.flows import max_min_rates


def test_single_bottleneck_is_shared_equally():
    assert max_min_rates([[0], [0], [0], [0]], [100.0]).tolist() == [25.0] * 4


def test_parking_lot():
    # links 0, 1 of capacity 1; flow A crosses both, B only 0, C only 1: everyone 1/2
    assert max_min_rates([[0, 1], [0], [1]], [1.0, 1.0]) == pytest.approx([0.5, 0.5, 0.5])


def test_unused_capacity_goes_to_the_unconstrained_flow():
    # A and B share link 0 (cap 1); A and C share link 1 (cap 10): A = B = 0.5, C takes the rest 9.5
    assert max_min_rates([[0, 1], [0], [1]], [1.0, 10.0]) == pytest.approx([0.5, 0.5, 9.5])


def test_two_levels_of_bottlenecks():
    # link 0 (cap 3) carries A, B, C; link 1 (cap 1) carries C and D.
    # C and D are limited by link 1 to 0.5; A and B share the remaining 2.5 of link 0: 1.25 each
    r = max_min_rates([[0], [0], [0, 1], [1]], [3.0, 1.0])
    assert r == pytest.approx([1.25, 1.25, 0.5, 0.5])


def test_per_flow_caps_and_empty_paths():
    # B is capped at 0.2, so A gets 0.8 of link 0 and C the rest of link 1; D has no links: its cap
    r = max_min_rates([[0, 1], [0], [1], []], [1.0, 10.0], caps=[np.inf, 0.2, np.inf, 5.0])
    assert r == pytest.approx([0.8, 0.2, 9.2, 5.0])
    assert np.isinf(max_min_rates([[]], [1.0])[0])


def test_result_is_feasible_and_every_flow_has_a_saturated_bottleneck():
    rng = np.random.default_rng(0)
    n_links, n_flows = 40, 300
    cap = rng.uniform(1, 10, n_links)
    paths = [rng.choice(n_links, size=rng.integers(1, 6), replace=False) for _ in range(n_flows)]
    r = max_min_rates(paths, cap)
    load = np.zeros(n_links)
    for p, x in zip(paths, r):
        load[p] += x
    assert (load <= cap * (1 + 1e-9)).all()
    # max-min optimality: each flow crosses a saturated link on which it is among the fastest
    fastest = np.zeros(n_links)
    for p, x in zip(paths, r):
        fastest[p] = np.maximum(fastest[p], x)
    saturated = load >= cap * (1 - 1e-9)
    for p, x in zip(paths, r):
        assert (saturated[p] & (x >= fastest[p] * (1 - 1e-9))).any()


@pytest.mark.parametrize("capacity", [[np.nan, 1.0], [-1.0, 1.0]])
def test_bad_capacity_is_refused_not_spun_on(capacity):
    with pytest.raises(ValueError, match="capacities"):
        max_min_rates([[0, 1], [0], [1]], capacity)


def test_nan_cap_is_refused():
    with pytest.raises(ValueError, match="caps"):
        max_min_rates([[0], [0]], [1.0], caps=[np.nan, 1.0])


def _max_min_by_definition(paths, capacity, caps, rtol=1e-9):
    """Progressive filling as first written (every round over every unfrozen flow's links, the
    bottleneck test by np.minimum.at): the fast version must give exactly the same rates."""
    rate = np.where([len(p) == 0 for p in paths], caps, np.inf)
    rem = np.asarray(capacity, dtype=float).copy()
    live = [f for f, p in enumerate(paths) if len(p)]
    while live:
        cnt = np.bincount(np.concatenate([paths[f] for f in live]), minlength=len(rem))
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(cnt > 0, rem / np.maximum(cnt, 1), np.inf)
        fmin = np.array([min(share[paths[f]].min(), caps[f]) for f in live])
        lmin = np.full(len(rem), np.inf)
        for f, m in zip(live, fmin):
            np.minimum.at(lmin, paths[f], m)
        bottleneck = (cnt > 0) & (share <= lmin * (1 + rtol))
        hit = np.array([bottleneck[paths[f]].any() or caps[f] <= m * (1 + rtol) for f, m in zip(live, fmin)])
        done = [f for f, h in zip(live, hit) if h]
        rate[done] = fmin[hit]
        if hit.all():
            break
        entries = np.concatenate([paths[f] for f in done])
        rem -= np.bincount(entries, weights=np.repeat(fmin[hit], [len(paths[f]) for f in done]), minlength=len(rem))
        np.maximum(rem, 0.0, out=rem)
        live = [f for f, h in zip(live, hit) if not h]
    return rate


def test_rates_equal_the_definition_exactly():
    rng = np.random.default_rng(7)
    for i in range(150):
        n_links, n_flows = int(rng.integers(1, 40)), int(rng.integers(1, 120))
        cap = rng.choice([1.0, 2.0, 2.5, 7.0], n_links) if i % 2 else rng.uniform(0.5, 10, n_links)
        if i % 5 == 0:
            cap[rng.integers(0, n_links)] = 0.0
        paths = [rng.choice(n_links, size=min(int(rng.integers(0, 6)), n_links), replace=False)
                 for _ in range(n_flows)]
        caps = np.where(rng.random(n_flows) < 0.3, rng.choice([0.5, 1.0, 1.5], n_flows), np.inf)
        if i % 3 == 0:  # every flow capped: often below every link's share (the one-round shortcut)
            caps = rng.choice([0.005, 0.01, 0.02] if i % 2 else [0.01, 0.02, 0.3], n_flows)
        elif i % 3 == 1:  # most flows at one cap, some tight links (the first round's split)
            caps = np.where(rng.random(n_flows) < 0.8, rng.choice([0.02, 0.1]), rng.choice([np.inf, 0.01]))
            if i % 2:
                cap[rng.integers(0, n_links, 3)] = 0.05
        want = _max_min_by_definition(paths, cap, caps)
        assert np.array_equal(max_min_rates(paths, cap, caps), want)


def test_rates_equal_the_definition_with_most_flows_at_one_cap():
    """Collectives' shape: many sub-flows at one cap over roomy links (the first round settles them
    without working each out), a few uncapped flows alone on tight links, some capped flows crossing
    a tight link too."""
    rng = np.random.default_rng(11)
    for i in range(40):
        tight, roomy = int(rng.integers(1, 8)), int(rng.integers(5, 30))
        cap = np.concatenate([rng.choice([1.0, 2.0, 3.0], tight), rng.uniform(50, 100, roomy)])
        paths = [rng.choice(roomy, size=int(rng.integers(1, 5)), replace=False) + tight
                 for _ in range(int(rng.integers(10, 80)))]
        caps = [0.5] * len(paths)
        for _ in range(int(rng.integers(1, 12))):   # uncapped flows on one tight link
            paths.append(np.array([rng.integers(0, tight)]))
            caps.append(np.inf)
        for _ in range(int(rng.integers(0, 3)) if i % 2 else 0):   # capped flows across a tight link
            paths.append(np.array([rng.integers(0, tight), tight + rng.integers(0, roomy)]))
            caps.append(rng.choice([0.5, 0.2]))
        caps = np.array(caps)
        assert np.array_equal(max_min_rates(paths, cap, caps), _max_min_by_definition(paths, cap, caps))


def test_first_round_of_mostly_capped_flows_equals_the_definition():
    """The first round worked out on the uncapped or tight flows only (twin.costs.flows._first_round): links
    that carry both flows frozen at their cap and flows frozen at a tight link's share, and flows left
    for later rounds, must give exactly the definition's rates (sums in the same order)."""
    rng = np.random.default_rng(13)
    for i in range(60):
        tight, roomy = int(rng.integers(2, 10)), int(rng.integers(8, 40))
        cap = np.concatenate([rng.uniform(0.3, 3.0, tight), rng.uniform(20, 60, roomy)])
        c = rng.choice([0.1, 1 / 3, 0.7])
        paths, caps = [], []
        for _ in range(int(rng.integers(40, 200))):    # easy: roomy links only, one cap
            paths.append(rng.choice(roomy, size=int(rng.integers(1, 5)), replace=False) + tight)
            caps.append(c)
        for _ in range(int(rng.integers(1, 30))):      # hard: a tight link and roomy ones
            k = int(rng.integers(1, 3))
            paths.append(np.concatenate([rng.choice(tight, size=k, replace=False),
                                         rng.choice(roomy, size=int(rng.integers(0, 3)), replace=False) + tight]))
            caps.append(rng.choice([np.inf, c, 2 * c, 0.05]))
        order = rng.permutation(len(paths))
        paths, caps = [paths[j] for j in order], np.array(caps)[order]
        assert np.array_equal(max_min_rates(paths, cap, caps), _max_min_by_definition(paths, cap, caps))
    # a flow left for round 2 whose bottleneck then is a link where only capped flows froze: its
    # rate is the capacity minus c + c + ... (k times, in turn), which k x c need not equal
    for k in range(7, 40):
        for c in (0.1, 1 / 3, 0.7):
            cap = np.array([0.1 * c, 1.9 * c, (k + 1.5) * c, 1e3])   # T2, T, M, roomy
            paths = [np.array([0, 1]), np.array([1, 2])] + [np.array([2])] * k + [np.array([3])] * (k + 2)
            caps = np.array([np.inf, np.inf] + [c] * (2 * k + 2))
            assert np.array_equal(max_min_rates(paths, cap, caps), _max_min_by_definition(paths, cap, caps))


def test_first_round_bottleneck_just_above_the_top_cap():
    """A flow on a narrow link (share just below the easy flows' cap c) whose bottleneck is a link
    whose share is c itself, within rtol of the flow's rate: the first round must look at that link's
    flows too (twin.costs.flows._first_round's `more` links), or the flow waits for a later round."""
    for eps in (1e-12, 1e-11, 3e-10):
        for n_easy in (4, 9):
            # links: A (narrow: share 1 - eps), C (tight for flow 1), B (share exactly 1), roomy ones
            cap = np.array([2 * (1 - eps), 0.5, 2.0] + [100.0] * n_easy)
            paths = [np.array([0, 2]), np.array([0, 1]), np.array([2])] + [np.array([3 + i]) for i in range(n_easy)]
            caps = np.array([np.inf, np.inf] + [1.0] * (1 + n_easy))
            want = _max_min_by_definition(paths, cap, caps)
            assert want[0] == 1 - eps                  # frozen in round one at A's share, by B
            assert np.array_equal(max_min_rates(paths, cap, caps), want)
