"""`RemoteConnector`: the small interface every remote store implements (key string -> bytes).

Methods raise on transport failures (any exception); the remote tier turns that into a miss.
`failure_domain(key)` names the unit that fails together (a whole server by default, one node
of a cluster for `redis-cluster://`), so a fault only disables the keys that live there.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TypeVar

from lmcache.storage_backend.serde.blob_stream import BufferStream, ReadStream
from lmcache.write_parts import Buffer, Parts

T = TypeVar("T")


class RemoteConnector(abc.ABC):
    @abc.abstractmethod
    def get(self, key: str) -> Buffer | None: ...

    def get_into(self, key: str, read: Callable[[ReadStream, int], T]) -> T | None:
        """`read(stream, length)` over the value of `key` (None if missing). A store that can
        deliver the value as it arrives (without buffering it whole) overrides this."""
        value = self.get(key)
        return None if value is None else read(BufferStream(value), len(value))

    def get_many(self, keys: Sequence[str]) -> list[Buffer | None]:
        """Several GETs in one round trip where the store allows it."""
        return [self.get(k) for k in keys]

    def get_many_into(self, keys: Sequence[str], read: Callable[[int, ReadStream, int], T]) -> list[T | None]:
        """`get_many` that hands the value of each `keys[i]` found to `read(i, stream, length)`
        (None for missing keys), in one round trip where the store allows it. `read` may leave part of a value
        unread (the rest is skipped); if it raises, the batch fails with that error. A store that
        can stream values into `read` as they arrive overrides this."""
        values = self.get_many(keys)
        return [None if v is None else read(i, BufferStream(v), len(v)) for i, v in enumerate(values)]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Several EXISTS in one round trip where the store allows it."""
        return [self.exists(k) for k in keys]

    @abc.abstractmethod
    def put(self, key: str, parts: Parts) -> None:
        """Store the concatenation of `parts` under `key` (`write_parts`: a sealed value is made
        piece by piece as it is taken; write each part before taking the next, keep none)."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> bool: ...

    def failure_domain(self, key: str) -> str:
        return "*"

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
