"""What a tier reports about its own contents: `TierEvent`s in a `TierEvents` buffer it owns.

A tier never calls up into whoever owns it. When it stores, drops or clears chunks it appends an
event to its buffer (under no lock of its own that a reader could need) and returns; the storage
manager takes the events (`StorageBackendInterface.take_events`) after each call into the tiers
and does the follow-up off the tier's call stack (e.g. telling peers which keys this instance no
longer holds). Events of a tier's background threads (the disk tier's writes) wait in the buffer
for the manager's next call.

An event names its tier (`tier`, the tier's registry name) and its chunk keys in order, which is
what vLLM's KV events (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`, with a `medium`) need.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from lmcache.cache_key import CacheEngineKey

logger = logging.getLogger(__name__)
MAX_EVENTS = 4096  # events a buffer keeps until they are taken; the oldest go first
E = TypeVar("E")


class EventKind(enum.Enum):
    STORED = "stored"  # the tier now holds `keys`
    REMOVED = "removed"  # the tier no longer holds `keys` (see `reason`)
    CLEARED = "cleared"  # the tier dropped everything it held: `keys`


class RemovalReason(enum.Enum):
    EVICTED = "evicted"  # dropped to make room
    DELETED = "deleted"  # removed on request, or found gone
    CORRUPT = "corrupt"  # failed verification and was removed
    HANDED_OVER = "handed_over"  # given to its reader, who owns it now (received PD KV)


@dataclass(frozen=True)
class TierEvent:
    kind: EventKind
    tier: str
    keys: tuple[CacheEngineKey, ...]
    reason: RemovalReason | None = None  # set for REMOVED only


class PublishedEvent(NamedTuple):
    """A tier's event as published to subscribers: `medium` is the tier's (`"CPU"`, `"STORAGE"`)."""

    medium: str
    event: TierEvent


class EventBuffer(Generic[E]):
    """A bounded, thread-safe buffer of events. When `max_events` are waiting, the oldest is
    dropped and counted (`num_dropped`; logged once until the next `take`). A buffer nobody has
    taken from yet keeps the latest events without a word."""

    def __init__(self, name: str, max_events: int = MAX_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.name = name
        self._lock = threading.Lock()
        self._events: deque[E] = deque(maxlen=max_events)
        self._overflowed = True  # not worth a warning until someone takes events
        self.num_dropped = 0

    def append(self, event: E) -> None:
        with self._lock:
            full = len(self._events) == self._events.maxlen
            self._events.append(event)
            if not full:
                return
            self.num_dropped += 1
            first = not self._overflowed
            self._overflowed = True
        if first:
            logger.warning("the %s event buffer is full (%d events not taken): dropping the oldest",
                           self.name, self._events.maxlen)

    def __len__(self) -> int:
        """Events waiting to be taken."""
        with self._lock:
            return len(self._events)

    def take(self) -> list[E]:
        """The events since the last `take`, oldest first."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
            self._overflowed = False
        return events


class TierEvents(EventBuffer[TierEvent]):
    """A tier's event buffer (a lost event only leaves a peer registration or a subscriber's view
    stale, which readers see as a miss)."""

    def __init__(self, tier: str, max_events: int = MAX_EVENTS) -> None:
        super().__init__(f"{tier} tier's", max_events)
        self.tier = tier

    def stored(self, keys: Sequence[CacheEngineKey]) -> None:
        self._add(EventKind.STORED, keys, None)

    def removed(self, keys: Sequence[CacheEngineKey], reason: RemovalReason) -> None:
        self._add(EventKind.REMOVED, keys, reason)

    def cleared(self, keys: Sequence[CacheEngineKey]) -> None:
        self._add(EventKind.CLEARED, keys, None)

    def _add(self, kind: EventKind, keys: Sequence[CacheEngineKey], reason: RemovalReason | None) -> None:
        if keys or kind is EventKind.CLEARED:
            self.append(TierEvent(kind, self.tier, tuple(keys), reason))
