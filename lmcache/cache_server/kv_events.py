"""The cache server's own KV events (`kv_events_endpoint` / ``lmcache cache-server --kv-events``).

Every `INTERVAL` seconds a thread takes what each model's tiers stored and dropped
(`StorageManager.take_published`) and publishes it as one batch in vLLM's format
(`lmcache.kv_events`): the L1 arena as medium "CPU", the tiers behind it (disk, remote) as
"STORAGE"; so a store, an eviction or a clear is published within `INTERVAL` seconds, busy or idle.

What a block is here. Engines send the server chunk keys, never tokens, and no vLLM block hashes,
so each chunk is published as one block: its hash is the chunk's LMCache hash (the key's
`chunk_hash`, the chained xxh3-128 over the chunk's tokens of `lmcache.chunk_hash`, 16 bytes),
`parent_block_hash` is None, `token_ids` is empty, `block_size` is the model's chunk size, and the
block's extra keys are the rest of the key, ``(model, fmt, world_size, worker_id, dtype)``. A
router matches a prompt by computing the same chunk digests from its token ids and cache salt
(`lmcache.chunk_hash`, no seed): ``lmcache router --shared-kv-events`` (`lmcache.router.shared`).
The digests are not vLLM's block hashes (an engine's own tiers are published with those, by the
vLLM connector), and a subscriber that needs token ids in ``BlockStored`` cannot use this stream.
Memory is bounded by each model's event buffer and the socket's high-water mark.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial

from lmcache.cache_key import CacheEngineKey
from lmcache.kv_events import ChunkBlocks, KVEventPublisher, to_kv_events
from lmcache.storage_backend.storage_manager import StorageManager

logger = logging.getLogger(__name__)
INTERVAL = 0.1


def chunk_block(key: CacheEngineKey, chunk_size: int) -> ChunkBlocks:
    """`key`'s chunk as one published block (see the module doc)."""
    try:
        digest = bytes.fromhex(key.chunk_hash)
    except ValueError:  # not written by `ChunkedTokenDatabase`: its text is its identity
        digest = key.chunk_hash.encode()
    return ChunkBlocks([digest], None, [], chunk_size,
                       extra_keys=[(key.model_name, key.fmt, key.world_size, key.worker_id, key.dtype)])


class ServerEvents:
    """Publishes the tiers' events of the models `models()` returns on `endpoint` until `close`."""

    def __init__(self, endpoint: str, models: Callable[[], list[tuple[StorageManager, int]]],
                 interval: float = INTERVAL) -> None:
        """`models()`: each model's tiers (which keep their events: `StorageManager.publish_events`)
        and chunk size."""
        self.publisher = KVEventPublisher(endpoint)
        self._models = models
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lmcache-kv-events")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.publish_once()
            except Exception:
                logger.exception("publishing the cache server's KV events failed")

    def publish_once(self) -> None:
        events = []
        for storage, chunk_size in self._models():
            blocks_of = partial(chunk_block, chunk_size=chunk_size)
            events += to_kv_events(storage.take_published(), blocks_of).events
        self.publisher.publish(events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.publisher.close()
