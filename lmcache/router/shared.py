"""`SharedIndex`: the chunks a cache server holds that every instance behind the router loads from
(``lmcache router --shared-kv-events``, the server's ``lmcache cache-server --kv-events``).

A cache server publishes each chunk as one block named by its LMCache digest
(`lmcache.cache_server.kv_events`): ``block_hashes = [chunk digest]``, ``block_size`` = the chunk
size, with the chunk's token ids and parent where the server knows them. The router needs neither:
the digest is a chain over the chunk's tokens with no seed (`lmcache.chunk_hash`), so it computes
the same digests from a prompt's token ids (and its ``cache_salt``) and walks them: the prefix the
server holds, which any instance attached to it can load instead of computing.

Held = stored in some tier and not removed since. The server publishes a chunk once per worker of
a model (tensor-parallel ranks share the digest), and a removal names the digest only, so a digest
stays held while any of its stores is not removed: with several ranks a prefix one rank evicted
still counts (an over-estimate the served hits then show). Bounded: at most `max_blocks` (medium,
digest) entries, the oldest stored dropped first (``evicted``); the chunk sizes a prompt is walked
at are those of the entries held (a ``BlockStored`` of no chunks adds none). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from lmcache.chunk_hash import chunk_digests
from lmcache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from lmcache.router.events import Event
from lmcache.router.index import DEFAULT_WEIGHT, Match

Key = tuple[str | None, bytes]  # (medium, chunk digest)


class SharedIndex:
    def __init__(self, max_blocks: int = 200_000, tier_weights: dict[str, float] | None = None) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks={max_blocks}: must be > 0")
        self.max_blocks = max_blocks
        self.tier_weights = dict(tier_weights or {})
        self.evicted = 0
        self._lock = threading.Lock()
        self._held: OrderedDict[Key, int] = OrderedDict()  # -> stores not removed
        self._size: dict[Key, int] = {}  # its chunk size
        self._media: dict[bytes, dict[str | None, None]] = {}  # digest -> the media holding it
        self._chunk_sizes: dict[int, int] = {}  # chunk size -> entries of that size

    def apply(self, events: list[Event]) -> None:
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        if isinstance(h, bytes):
                            self._store((event.medium, h), event.block_size)
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        if isinstance(h, bytes):
                            self._drop((event.medium, h))
                elif isinstance(event, AllBlocksCleared):
                    self._held.clear()
                    self._size.clear()
                    self._media.clear()
                    self._chunk_sizes.clear()

    def _store(self, key: Key, size: int) -> None:
        if key not in self._held:
            self._size[key] = size
            self._chunk_sizes[size] = self._chunk_sizes.get(size, 0) + 1
        self._held[key] = self._held.get(key, 0) + 1
        self._held.move_to_end(key)
        self._media.setdefault(key[1], {})[key[0]] = None
        while len(self._held) > self.max_blocks:
            self._drop(next(iter(self._held)), everything=True)
            self.evicted += 1

    def _drop(self, key: Key, everything: bool = False) -> None:
        left = self._held.get(key, 0) - 1
        if left > 0 and not everything:
            self._held[key] = left
            return
        if self._held.pop(key, None) is None:
            return
        size = self._size.pop(key)
        self._chunk_sizes[size] -= 1
        if not self._chunk_sizes[size]:
            del self._chunk_sizes[size]
        media = self._media[key[1]]
        del media[key[0]]
        if not media:
            del self._media[key[1]]

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def match(self, tokens: Sequence[int], extra_key: str | None = None) -> Match:
        """The longest prefix of `tokens` (whole chunks, of every chunk size held) the server holds,
        `extra_key` seeding the chain as the engines' (`lmcache.chunk_hash.extra_key_of`)."""
        with self._lock:
            sizes = list(self._chunk_sizes)
        return max((self._walk(tokens, extra_key, size) for size in sizes),
                   key=lambda m: (m.weighted, m.tokens), default=Match())

    def _walk(self, tokens: Sequence[int], extra_key: str | None, size: int) -> Match:
        found = Match(block_size=size)
        digests = chunk_digests(tokens, size, extra_key, whole_only=True)
        with self._lock:
            for digest in digests:
                media = self._media.get(digest)
                if not media:
                    break
                tier = max(media, key=lambda m: self.tier_weights.get(m or "GPU", DEFAULT_WEIGHT))
                found.tokens += size
                found.weighted += size * self.tier_weights.get(tier or "GPU", DEFAULT_WEIGHT)
                name = f"shared {tier}"
                found.by_tier[name] = found.by_tier.get(name, 0) + size
        return found
