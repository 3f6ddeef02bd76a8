"""The flows of one ring step as the library lays them out (twin.costs.collectives.CollectiveModel._ring_channels),
against a plain ring-by-ring layout of the rules in twin.costs.collectives' docstring: the same rows in the same
order, for rings of every shape (members on one node, runs of several lengths, runs split across the ring's
wrap-around, one member per node)."""

from __future__ import annotations

import types

import numpy as np

from twin.costs.collectives import CollectiveModel


def ring_channels_by_definition(gpus: np.ndarray, gpn: int, channel_cap: float, directions: int = 2) -> list[list]:
    internal, back, cross = [], [], {}
    for r, m in enumerate(gpus.tolist()):
        q = len(m)
        node = [g // gpn for g in m]
        run_start, runs = [], []          # runs of consecutive members on one node (not across the wrap)
        for i in range(q):
            if i == 0 or node[i] != node[i - 1]:
                runs.append(0)
                start = i
            runs[-1] += 1
            run_start.append(start)
        single = len(runs) == 1
        both = q > 2 and directions == 2  # a ring inside one node runs both ways, or one
        k = (2 if both else 1) if single else min(runs)
        for i in range(q):
            j = (i + 1) % q
            if node[i] == node[j]:
                internal.append((m[i], m[j], m[i], m[j], r, k if single else 1, np.inf))
                if single and both:
                    back.append((m[j], m[i], m[j], m[i], r, k, np.inf))
            else:
                for c in range(k):
                    cross.setdefault(c, []).append((m[i], m[j], m[run_start[i] + c], m[run_start[j] + c], r, k,
                                                    channel_cap))
    return internal + back + [row for c in sorted(cross) for row in cross[c]]


def test_ring_channels_equal_the_plain_layout():
    rng = np.random.default_rng(7)
    for t in range(400):
        gpn = int(rng.choice([1, 2, 4, 8]))
        rings, q = int(rng.integers(1, 5)), int(rng.integers(1, 10))
        n = rings * q
        ids = [rng.permutation(2 * n)[:n], np.arange(n) * int(rng.integers(1, 5)),
               np.sort(rng.choice(3 * n, n, replace=False))][t % 3]
        gpus = ids.reshape(rings, q).astype(np.int64)
        directions = int(rng.integers(1, 3))
        coll = types.SimpleNamespace(node_ring_directions=directions)
        model = types.SimpleNamespace(system=types.SimpleNamespace(gpus_per_node=gpn, collectives=coll),
                                      channel_cap=2.5e10)
        cols = CollectiveModel._ring_channels(model, gpus)
        assert [c.dtype for c in cols] == [np.int64] * 6 + [np.float64]
        got = [tuple(row) for row in zip(*(c.tolist() for c in cols))]
        assert got == ring_channels_by_definition(gpus, gpn, 2.5e10, directions)
