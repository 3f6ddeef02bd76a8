"""The process-wide caches, behind one registry.

A configuration search, `simulate --grid auto`, scaling and sensitivity sweeps ask the same questions
many times in one process (the same network, routes, programs, collective models, bounds), so several
modules keep what they computed for the rest of the process. Each such cache registers itself here,
where it is made, under a dotted name "module.what" (e.g. "twin.predict.study_cache.programs"); what
it holds, and how much of it, is said at its `register` call.

- `register(name, cache)`: add a cache, and return it;
- `clear()`: empty every registered cache (tests start and end from an empty process with the
  `fresh_caches` fixture of tests/conftest.py; a long-lived process can drop what it holds);
- `sizes()`: entries held per cache name.

A cache is any object with a `clear()` method (a dict, an OrderedDict, a weakref.WeakKeyDictionary,
a topologies.memo.Memo) or a functools.lru_cache function (its `cache_clear()`). Every cache holds
values computed from their keys alone, so clearing one changes how soon an answer comes, never the
answer. This module imports nothing of the project: any module may register here.
"""

from __future__ import annotations

_CACHES: dict[str, list] = {}  # name -> the objects registered under it (usually one)


def register(name: str, cache):
    """Register `cache` under the dotted `name` and return it, e.g.
    `_PLANS: dict = caches.register("twin.engine.plan.plans", {})`.

    A name registered again with another object keeps both: a package loaded twice in one process
    under two names (as benchmarks/bench_engine.py loads its baseline) registers its caches twice,
    and `clear()` must empty both copies."""
    if not callable(getattr(cache, "clear", None)) and not callable(getattr(cache, "cache_clear", None)):
        raise TypeError(f"cache {name!r}: {type(cache).__name__} has neither clear() nor cache_clear()")
    held = _CACHES.setdefault(name, [])
    if not any(c is cache for c in held):
        held.append(cache)
    return cache


def clear() -> None:
    """Empty every registered cache."""
    for held in _CACHES.values():
        for cache in held:
            if callable(getattr(cache, "cache_clear", None)):
                cache.cache_clear()
            else:
                cache.clear()


def sizes() -> dict[str, int]:
    """Entries each registered cache holds, by name (summed over the objects of one name)."""
    return {name: sum(_entries(c) for c in held) for name, held in sorted(_CACHES.items())}


def _entries(cache) -> int:
    info = getattr(cache, "cache_info", None)
    return info().currsize if callable(info) else len(cache)
