"""Eviction orders for a cache tier: LRU, LFU, FIFO, and the domain that keeps one order for the
tiers that share an arena.

A policy only orders keys; the tier decides which candidates may actually go (nobody else holds
them, not pinned). `candidates()` yields keys from the first to evict to the last.
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class CachePolicy(abc.ABC, Generic[K]):
    @abc.abstractmethod
    def on_insert(self, key: K) -> None: ...

    @abc.abstractmethod
    def on_access(self, key: K) -> None: ...

    @abc.abstractmethod
    def on_remove(self, key: K) -> None: ...

    @abc.abstractmethod
    def candidates(self) -> Iterator[K]: ...


class FIFOPolicy(CachePolicy[K]):
    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def on_insert(self, key: K) -> None:
        self._order[key] = None

    def on_access(self, key: K) -> None:
        pass

    def on_remove(self, key: K) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[K]:
        return iter(list(self._order))


class LRUPolicy(FIFOPolicy[K]):
    def on_access(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)


class LFUPolicy(CachePolicy[K]):
    """Least frequently used first; ties broken least recently used first."""

    def __init__(self) -> None:
        self._freq: dict[K, int] = {}
        self._buckets: dict[int, OrderedDict[K, None]] = {}

    def on_insert(self, key: K) -> None:
        self.on_remove(key)
        self._freq[key] = 1
        self._buckets.setdefault(1, OrderedDict())[key] = None

    def on_access(self, key: K) -> None:
        f = self._freq.get(key)
        if f is None:
            return
        self._drop(key, f)
        self._freq[key] = f + 1
        self._buckets.setdefault(f + 1, OrderedDict())[key] = None

    def on_remove(self, key: K) -> None:
        f = self._freq.pop(key, None)
        if f is not None:
            self._drop(key, f)

    def _drop(self, key: K, f: int) -> None:
        bucket = self._buckets[f]
        del bucket[key]
        if not bucket:
            del self._buckets[f]

    def candidates(self) -> Iterator[K]:
        return iter([k for f in sorted(self._buckets) for k in self._buckets[f]])


POLICIES: dict[str, type[CachePolicy]] = {"LRU": LRUPolicy, "LFU": LFUPolicy, "FIFO": FIFOPolicy}


def make_policy(name: str) -> CachePolicy:
    try:
        return POLICIES[name.upper()]()
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {sorted(POLICIES)}") from None


class EvictionDomain(Generic[K]):
    """One eviction order (and one lock) for the hot tiers that share an arena: the cache server's
    models evict each other's least recently used chunks, not only their own. The hot tier orders
    ``(tier, key)`` pairs in it, so equal keys of two tiers stay apart. An engine's hot tier has a
    domain of its own."""

    def __init__(self, policy: str = "LRU") -> None:
        self.lock = threading.RLock()
        self.policy: CachePolicy[K] = make_policy(policy)
