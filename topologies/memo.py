"""A process-wide memo of results keyed by the *content* of their numpy inputs.

A configuration search, `simulate --grid auto`, scaling and sensitivity sweeps ask the network model
the same questions many times over in one process: the probe grid of groups of 8 at stride 4,096 has
exactly the rings of the data axis of 2x32x64x8, so its routes and rates are the same computation.
Routing and max-min fairness are deterministic functions of their arrays, so their results are kept
here under a digest of those arrays (BLAKE2b, 128 bits) and handed back, unchanged, to the next caller
that asks the same. Callers treat what they get as read-only. The memo holds at most `budget`
bytes of results, least recently used first out.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict

import numpy as np

from topologies import caches


def digest(*parts) -> bytes:
    """128-bit digest of numpy arrays (content, dtype, shape) and plain scalars or strings."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, np.ndarray):
            a = np.ascontiguousarray(p)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(memoryview(a).cast("B"))
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return h.digest()


# id(array) -> (weak reference to it, its key): each entry goes with its array (see remember_key)
_ARRAY_KEYS: dict[int, tuple] = caches.register("topologies.memo.array_keys", {})


def array_key(a: np.ndarray) -> bytes:
    """Digest of an array, remembered for as long as that very array lives (capacity vectors are
    built once per network or collective model and never changed), or the key `remember_key` gave it."""
    hit = _ARRAY_KEYS.get(id(a))
    if hit is not None and hit[0]() is a:
        return hit[1]
    key = digest(a)
    remember_key(a, key)
    return key


def remember_key(a: np.ndarray, key: bytes) -> None:
    """Let `array_key(a)` answer `key` while `a` lives, without hashing it: for a read-only array
    whose content `key` determines (a digest of what it was computed from). The entry goes when the
    array does, and not before: a key given here is not the digest of the content, so forgetting it
    while the array lives would give the same array, or an equal one, another key."""
    i = id(a)

    def forget(dead: weakref.ref) -> None:
        if _ARRAY_KEYS.get(i, (None,))[0] is dead:  # not an entry since made for a new array at that id
            del _ARRAY_KEYS[i]

    try:
        ref = weakref.ref(a, forget)
    except TypeError:
        return
    _ARRAY_KEYS[i] = (ref, key)


class Memo:
    """Least-recently-used memo with a byte budget; `size(value)` says what a value holds (bytes)."""

    def __init__(self, budget: int, size):
        self.budget, self.size = budget, size
        self.items: OrderedDict[bytes, object] = OrderedDict()
        self.held = 0
        self.hits = self.misses = 0

    def get(self, key: bytes):
        v = self.items.get(key)
        if v is None:
            self.misses += 1
            return None
        self.hits += 1
        self.items.move_to_end(key)
        return v

    def put(self, key: bytes, value) -> None:
        n = self.size(value)
        if n > self.budget:
            return
        self.items[key] = value
        self.held += n
        while self.held > self.budget:
            _, old = self.items.popitem(last=False)
            self.held -= self.size(old)

    def __len__(self) -> int:
        return len(self.items)

    def clear(self) -> None:
        self.items.clear()
        self.held = self.hits = self.misses = 0
