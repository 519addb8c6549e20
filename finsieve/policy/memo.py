"""Bounded memos for the rules' per-token questions (no reference cycles, thread-safe)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import lru_cache
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def memoized(method: Callable, maxsize: int) -> Callable:
    """A bounded, thread-safe memo of a bound method that holds its instance weakly.
    `lru_cache(maxsize)(self.method)` kept on self is a reference cycle: a pack replaced by a
    reload would wait for the cyclic garbage collector, which the serving processes keep
    away from what was alive at start-up (`gc.freeze`, serve.py). Without the cycle,
    reference counting frees it as soon as no request uses it."""
    ref = weakref.WeakMethod(method)
    return lru_cache(maxsize=maxsize)(lambda *args: ref()(*args))  # type: ignore[misc]


def remember(memo: dict[K, V], key: K, value: V, maxsize: int) -> V:
    """Keep `value` in a bounded memo (emptied when full) and return it.
    The memos read once per token are plain dicts: a hit is one `get`, cheaper than
    `memoized`'s lru_cache, and a dict of results (never a bound method) makes no reference
    cycle. Dict operations are atomic: any thread may fill or empty it."""
    if len(memo) >= maxsize:
        memo.clear()
    memo[key] = value
    return value
