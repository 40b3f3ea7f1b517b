"""`CacheServerBackend` ("CacheServer"): the tier of an engine attached to a cache server
(`config.cache_server_url`; see `lmcache.cache_server`). The server's tiers (its shared-memory L1
and whatever lies behind it) answer for this one, in one request per call: which keys it holds,
the cached prefix (chunks the engine's connector copies out of the shared arena), and stored
chunks (`batched_put` commits the arena slots the engine's connector filled: nothing is copied
again; the chunks' texts go along, for the server's KV events). Lookup leases are taken on the
server, which also starts loading the leased chunks from its lower tiers into L1.

The client guards its own exchanges (`CacheServerClient`: one failure domain for the server, one
warning per outage, misses while the server is away, attaching again by itself), so this tier
never raises for an outage; its ``failures`` / ``skipped`` are that guard's counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from lmcache.cache_key import CacheEngineKey
from lmcache.chunk_hash import ChunkText
from lmcache.memory_management import MemoryObj
from lmcache.observability import TierStats, add_counts
from lmcache.storage_backend.abstract_backend import StorageBackendInterface, TierContext
from lmcache.storage_backend.registry import register_tier

if TYPE_CHECKING:  # the client imports zmq: only engines on a cache server load it
    from lmcache.cache_server.client import CacheServerClient


@register_tier
class CacheServerBackend(StorageBackendInterface):
    name = "CacheServer"
    lookup_order = 3  # after the hot tier (which an engine on a server has not), before PD
    is_local = True  # on this host: a store skips what the server holds
    may_fail = False  # the client's own failure domain turns outages into misses
    promote_hits = False  # there is no hot tier in the engine: the server's L1 is it

    def __init__(self, client: CacheServerClient) -> None:
        self.client = client

    @classmethod
    def create(cls, ctx: TierContext) -> CacheServerBackend | None:
        if ctx.config.cache_server_url is None:
            return None
        from lmcache.cache_server.client import CacheServerClient

        if not isinstance(ctx.allocator, CacheServerClient):
            raise ValueError("an engine with cache_server_url allocates from the server: its allocator "
                             "must be the CacheServerClient (LMCacheEngineBuilder builds it)")
        return cls(ctx.allocator)

    def contains(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key])[0]

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        reply = self.client.call("contains", keys=[k.to_string() for k in keys])
        hits = reply.get("hits") if reply is not None else None
        if not isinstance(hits, list) or len(hits) != len(keys):
            return [False] * len(keys)
        return [hit is True for hit in hits]

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False

    @property
    def takes_texts(self) -> bool:  # type: ignore[override]
        return self.client.wants_texts

    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj) -> Future | None:
        self.client.commit([key], [memory_obj])
        return None

    def batched_put(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj],
                    texts: Sequence[ChunkText | None] | None = None) -> None:
        self.client.commit(keys, objs, texts)

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        got = self.batched_get([key])
        return got[0]

    def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        found: list[MemoryObj | None] = list(self.client.get(keys))
        return found + [None] * (len(keys) - len(found))

    def lease(self, lease_id: str, keys: Sequence[CacheEngineKey], ttl: float) -> None:
        if keys:
            self.client.call("lease", lease=lease_id, keys=[k.to_string() for k in keys], ttl=ttl)

    def end_lease(self, lease_id: str) -> None:
        attachment = self.client.attachment
        if attachment is not None:
            self.client.notify(attachment, "unlease", lease=lease_id)

    def remove(self, key: CacheEngineKey) -> bool:
        return False  # the server's chunks are shared: an engine does not drop them

    def clear(self) -> int:
        raise ValueError("the cache server's tiers are shared by its engines: clear them on the server "
                         "(lmcache clear --url <its operations endpoint>)")

    def healthy(self) -> bool:
        return self.client.attached

    def stats(self) -> TierStats:
        return TierStats(add_counts(self.client.counts.snapshot(), self.client.faults.counts()),
                         {"attached": float(self.client.attached)})

    def close(self) -> None:
        pass  # the client is the engine's allocator: the engine closes it last

