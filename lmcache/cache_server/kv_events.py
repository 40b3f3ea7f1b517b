"""The cache server's own KV events (`kv_events_endpoint` / ``lmcache cache-server --kv-events``).

Every `INTERVAL` seconds a thread takes what each model's tiers stored and dropped
(`StorageManager.take_published`) and publishes it as one batch in vLLM's format
(`lmcache.kv_events`): the L1 arena as medium "CPU", the tiers behind it (disk, remote) as
"STORAGE"; so a store, an eviction or a clear is published within `INTERVAL` seconds, busy or idle.

What a block is here. Each chunk is published as one block of `chunk_size` tokens: its hash is the
chunk's LMCache digest (the key's `chunk_hash`: the chained xxh3-128 over the chunk's tokens of
`lmcache.chunk_hash`, 16 bytes), its parent the digest of the chunk before it (None for a prompt's
first), `token_ids` its tokens, and the block's extra keys the rest of the key, ``(model, fmt,
world_size, worker_id, dtype)``. Engines send each chunk's text (`ChunkText`) with its commit;
the server keeps the texts of at most `MAX_TEXTS` chunks (least recently committed dropped first).
So a subscriber that reads vLLM's events (token ids, parent chain) reads these too, and a router
can also match a prompt by computing the same digests from its token ids and cache salt (no
seed): ``lmcache router --shared-kv-events`` (`lmcache.router.shared`). A trailing partial chunk
is not published (as vLLM does not publish a partial block), and a chunk whose text the server
does not know (committed without one, or dropped from its memory of texts) is published by its
digest alone: no parent, no token ids. The digests are not vLLM's block hashes (an engine's own
tiers are published with those, by the vLLM connector). Memory is bounded by each model's event
buffer, `MAX_TEXTS` and the socket's high-water mark.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from lmcache.cache_key import CacheEngineKey
from lmcache.chunk_hash import ChunkText
from lmcache.kv_events import ChunkBlocks, KVEventPublisher, to_kv_events
from lmcache.storage_backend.storage_manager import StorageManager

logger = logging.getLogger(__name__)
INTERVAL = 0.1
MAX_TEXTS = 65536  # chunks whose text the server remembers (about 2 KB each at 256 tokens)


def digest_of(chunk_hash: str) -> bytes:
    """A key's `chunk_hash` as a published block hash."""
    try:
        return bytes.fromhex(chunk_hash)
    except ValueError:  # not written by `ChunkedTokenDatabase`: its text is its identity
        return chunk_hash.encode()


def chunk_block(key: CacheEngineKey, chunk_size: int, text: ChunkText | None) -> ChunkBlocks:
    """`key`'s chunk, of which `text` (if known) is the text, as one published block (see the
    module doc)."""
    if text is not None and len(text.token_ids) != chunk_size:
        return ChunkBlocks([], None, [], chunk_size)  # a partial chunk: no block
    extra_keys: list[tuple[Any, ...] | None] = [(key.model_name, key.fmt, key.world_size, key.worker_id,
                                                 key.dtype)]
    if text is None:
        return ChunkBlocks([digest_of(key.chunk_hash)], None, [], chunk_size, extra_keys=extra_keys)
    parent = digest_of(text.parent) if text.parent is not None else None
    return ChunkBlocks([digest_of(key.chunk_hash)], parent, list(text.token_ids), chunk_size,
                       extra_keys=extra_keys)


class ChunkTexts:
    """The texts of the last `max_chunks` chunks committed (thread-safe; as the server's messages
    decode them: token ids in an ``array("q")``, 8 bytes each)."""

    def __init__(self, max_chunks: int = MAX_TEXTS) -> None:
        self.max_chunks = max_chunks
        self._texts: OrderedDict[CacheEngineKey, ChunkText] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: CacheEngineKey) -> ChunkText | None:
        with self._lock:
            return self._texts.get(key)

    def add(self, keys: Sequence[CacheEngineKey], texts: Sequence[ChunkText | None]) -> None:
        with self._lock:
            for key, text in zip(keys, texts, strict=True):
                if text is None:
                    continue
                self._texts[key] = text
                self._texts.move_to_end(key)
                if len(self._texts) > self.max_chunks:
                    self._texts.popitem(last=False)


class ServerEvents:
    """Publishes the tiers' events of the models `models()` returns on `endpoint` until `close`."""

    def __init__(self, endpoint: str, models: Callable[[], list[tuple[StorageManager, int]]],
                 interval: float = INTERVAL) -> None:
        """`models()`: each model's tiers (which keep their events: `StorageManager.publish_events`)
        and chunk size."""
        self.publisher = KVEventPublisher(endpoint)
        self.texts = ChunkTexts()
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
            def blocks_of(key: CacheEngineKey, chunk_size: int = chunk_size) -> ChunkBlocks:
                return chunk_block(key, chunk_size, self.texts.get(key))

            events += to_kv_events(storage.take_published(), blocks_of).events
        self.publisher.publish(events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.publisher.close()
