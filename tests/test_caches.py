"""topologies.caches: every process-wide cache is registered, and clear() empties all of them."""

import functools
import sys
from collections import OrderedDict

import pytest

from topologies import caches
from topologies.memo import Memo


def _module_containers() -> dict[tuple[str, str], object]:
    """Every module-level dict, OrderedDict, list, set, Memo or lru_cache function of twin and topologies
    (but the registry's own)."""
    kinds = (dict, list, set, Memo, functools._lru_cache_wrapper)
    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or mod is caches or not (name == "twin" or name.startswith(("twin.", "topologies"))):
            continue
        for attr, value in vars(mod).items():
            if isinstance(value, kinds) and not attr.startswith("__"):
                out[name, attr] = value
    return out


def _size(value) -> int:
    return value.cache_info().currsize if isinstance(value, functools._lru_cache_wrapper) else len(value)


def test_clear_empties_every_cache_a_simulation_filled(fresh_caches):
    """A grid search and its simulations fill the caches (GPU: Alps, adaptive routing; CPU: the fitted
    profile and host model); clear() empties every one, and what grew in a module is registered."""
    from twin.predict.auto import choose_grid
    from twin.predict.study import prepare
    before = {k: _size(v) for k, v in _module_containers().items()}
    for system, model, gpus in (("alps", "gpt-1b", 16), ("cpu", "gpt-tiny", 8)):
        choose_grid(prepare(system, model, gpus, batch=gpus))
    filled = {name for name, n in caches.sizes().items() if n}
    assert {"topologies.network.networks", "topologies.routing.routes", "twin.costs.flows.rates",
            "twin.costs.flowsets.flows", "twin.engine.plan.plans", "twin.predict.bounds.quick",
            "twin.predict.study_cache.programs", "twin.predict.study_cache.models"} <= filled, filled
    registered = {id(c) for held in caches._CACHES.values() for c in held}
    grown = [f"{mod}.{attr}" for (mod, attr), v in _module_containers().items()
             if _size(v) > before.get((mod, attr), 0) and id(v) not in registered]
    assert not grown, f"module-level state that grew in a simulation but is not in topologies.caches: {grown}"
    caches.clear()
    assert not any(caches.sizes().values()), caches.sizes()


def test_register_takes_anything_that_clears():
    @functools.lru_cache(maxsize=4)
    def square(x):
        return x * x

    d, od, memo = {}, OrderedDict(), Memo(1 << 10, lambda v: 8)
    names = ["test_caches.dict", "test_caches.ordered", "test_caches.memo", "test_caches.square"]
    try:
        assert [caches.register(n, c) for n, c in zip(names, (d, od, memo, square))] == [d, od, memo, square]
        d[1], od[2] = 1, 2
        memo.put(b"k", 3)
        square(3)
        assert {n: caches.sizes()[n] for n in names} == dict.fromkeys(names, 1)
        other = caches.register("test_caches.dict", {"a": 1})  # a second copy of a module: both kept
        assert caches.sizes()["test_caches.dict"] == 2
        caches.clear()
        assert not d and not od and len(memo) == 0 and square.cache_info().currsize == 0 and not other
        with pytest.raises(TypeError):
            caches.register("test_caches.bad", 3)
    finally:
        for n in names:
            caches._CACHES.pop(n, None)
