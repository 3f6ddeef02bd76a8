"""Fixtures shared by the tests.

`fresh_caches`: the test starts from a process that has computed nothing yet and leaves none of what it
computed behind: every process-wide cache (topologies.caches: networks, routes, rates, programs,
collective models, bounds, plans, simulations) is emptied before and after it. A test whose result
must not come from an earlier test's work takes it; one that drops the caches again midway calls
`topologies.caches.clear()`.
"""

from __future__ import annotations

import pytest

from topologies import caches


@pytest.fixture
def fresh_caches():
    caches.clear()
    yield
    caches.clear()
