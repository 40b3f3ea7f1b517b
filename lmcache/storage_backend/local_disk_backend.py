"""`LocalDiskBackend` ("LocalDiskBackend"): KV chunks as files in `config.local_disk`.

One file per chunk, named by the xxh3-128 of the key string; the format, the atomic write and the
verified read are in `disk_file`. This module keeps the index:
- Writes run on the put workers (`LowerTierBackend`) through `disk_file.write_atomic`
  (temporary file, optional fsync per `local_disk_fsync`, atomic rename): several processes
  (tensor-parallel ranks, two engines) may share the directory, and a writer killed halfway leaves
  at most a temporary file, which `load_disk` removes once its writer is gone.
- The directory is the persistent index: `load_disk` (run at start-up) scans it and rebuilds the
  in-memory LRU index from file sizes and modification times; `contains` also finds files that
  other processes wrote since (one `stat`).
- `max_local_disk_size` bounds the bytes this process knows of; room for a new file is made by
  unlinking least recently used files (safe while another process still reads them), never a
  file whose key a lookup lease pins. A chunk larger than the whole tier, or one that fits only
  if pinned files went, is not written (the put queue counts it in ``too_large`` / ``no_room``,
  and ``puts_dropped``), and then nothing is evicted for it.
- A batch of reads (`batched_get`) runs concurrently on the tier's load pool.
- Reads verify the key and the checksum; a truncated, bit-flipped or foreign file is removed and
  counted (`num_corrupt`) and the read is a miss. With sealing on (`kv_encryption_key`) files are
  sealed (`serde.seal`); one that does not open is removed and counted in `num_forged` too.
  With a raw serde (`naive`, `fast`) the payload is
  read straight into the buffer from `allocate`, with no intermediate copy.
- What it writes and drops (evicted, removed, corrupt, found gone, cleared) it reports as events
  (`events`) for the keys this process knows, also from the put workers; the storage manager
  takes them on its next call.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.failures import NoRoom, TooLarge
from lmcache.memory_management import MemoryObj
from lmcache.observability import TierStats, add_counts
from lmcache.storage_backend import disk_file
from lmcache.storage_backend.abstract_backend import TierContext
from lmcache.storage_backend.disk_file import SUFFIX, TMP_SUFFIX, unlink_quietly
from lmcache.storage_backend.events import RemovalReason, TierEvents
from lmcache.storage_backend.leases import PinTable
from lmcache.storage_backend.lower_tier import LowerTierBackend, TierPools, gather_all
from lmcache.storage_backend.registry import register_tier
from lmcache.storage_backend.serde import CorruptBlobError, ForeignSerdeError, create_serde, keyed_blob
from lmcache.storage_backend.serde.blob import SERDE_IDS
from lmcache.storage_backend.serde.seal import ForgedBlobError, create_sealer, sealed_parts
from lmcache.storage_backend.serde.serde import AllocateFn
from lmcache.write_parts import nbytes_of, prefixed

logger = logging.getLogger(__name__)


@register_tier
class LocalDiskBackend(LowerTierBackend):
    name = "LocalDiskBackend"
    lookup_order = 10
    is_local = True
    medium = "STORAGE"
    may_fail = True

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                 allocate: AllocateFn, pools: TierPools | None = None,
                 pins: PinTable | None = None) -> None:
        if config.local_disk is None:
            raise ValueError("LocalDiskBackend needs config.local_disk (a directory)")
        if config.max_local_disk_bytes <= 0:
            raise ValueError(f"max_local_disk_size={config.max_local_disk_size} GB: the disk tier "
                             f"at {config.local_disk!r} needs a size limit > 0")
        self.path = os.path.abspath(config.local_disk)
        os.makedirs(self.path, exist_ok=True)
        self.max_bytes = config.max_local_disk_bytes
        self.fsync = config.local_disk_fsync
        self.serde_name = config.local_disk_serde
        self.serializer, self.deserializer = create_serde(self.serde_name, config, metadata)
        self.lossy = self.deserializer.lossy
        self.sealer = create_sealer(config.kv_encryption_key)
        self.pins = pins if pins is not None else PinTable()
        self.events: TierEvents = TierEvents(self.name)
        pools = pools or TierPools()
        super().__init__(allocate, pools)
        self._loads = ThreadPoolExecutor(pools.load_workers, thread_name_prefix=f"lmcache-{self.name}-load")
        self._index: OrderedDict[str, int] = OrderedDict()  # file stem -> bytes, LRU first
        self._keys: dict[str, CacheEngineKey] = {}  # file stem -> key, for the keys this process saw
        self._index_lock = threading.Lock()
        self.used_bytes = 0
        self._reserved_bytes = 0
        self.num_corrupt = 0
        self.num_forged = 0
        self.num_evicted = 0
        self.load_disk()

    @classmethod
    def create(cls, ctx: TierContext) -> LocalDiskBackend | None:
        if ctx.config.local_disk is None:
            return None
        return cls(ctx.config, ctx.metadata, ctx.allocate, pins=ctx.pins)

    # ---- naming ---------------------------------------------------------------------------------

    @staticmethod
    def _stem(key: CacheEngineKey) -> str:
        return xxhash.xxh3_128_hexdigest(key.to_string().encode())

    def _key_to_path(self, key: CacheEngineKey) -> str:
        return os.path.join(self.path, self._stem(key) + SUFFIX)

    def _seen(self, key: CacheEngineKey) -> str:
        """`key`'s stem, remembering the key (so that dropping its file can be reported)."""
        stem = self._stem(key)
        self._keys[stem] = key
        return stem

    def _dropped(self, stems: list[str], reason: RemovalReason | None) -> None:
        """Report the files of `stems` gone (`reason` None: cleared), for the keys this process saw."""
        keys = [k for k in (self._keys.pop(s, None) for s in stems) if k is not None]
        if reason is None:
            self.events.cleared(keys)
        else:
            self.events.removed(keys, reason)

    # ---- index ----------------------------------------------------------------------------------

    def contains(self, key: CacheEngineKey) -> bool:
        stem = self._stem(key)
        with self._index_lock:
            if stem in self._index:
                return True
        try:  # written by another process sharing the directory?
            size = os.stat(os.path.join(self.path, stem + SUFFIX)).st_size
        except FileNotFoundError:
            return False
        self._insert_stem(self._seen(key), size)
        return True

    def _insert_stem(self, stem: str, size: int) -> None:
        with self._index_lock:
            self.used_bytes += size - self._index.pop(stem, 0)
            self._index[stem] = size
            victims = self._take_victims(0, keep=stem)
        self._unlink_all(victims, RemovalReason.EVICTED)

    def _touch(self, stem: str) -> None:
        with self._index_lock:
            if stem in self._index:
                self._index.move_to_end(stem)

    def _forget(self, stem: str, reason: RemovalReason) -> None:
        with self._index_lock:
            self.used_bytes -= self._index.pop(stem, 0)
        self._dropped([stem], reason)

    def _take_victims(self, incoming: int, keep: str | None = None) -> list[str]:
        """Under the index lock: drop LRU entries (never `keep` or a pinned key's) until
        `incoming` more bytes fit, or all that may go are gone."""
        victims, _ = self._choose_victims(incoming, keep)
        self._evict(victims)
        return victims

    def _choose_victims(self, incoming: int, keep: str | None = None) -> tuple[list[str], bool]:
        """Under the index lock: the LRU entries (never `keep` or a pinned key's) to drop so that
        `incoming` more bytes fit, and whether dropping them is enough."""
        over = self.used_bytes + self._reserved_bytes + incoming - self.max_bytes
        victims: list[str] = []
        pinned: set[str] | None = None
        for stem, size in self._index.items():
            if over <= 0:
                break
            if pinned is None:
                pinned = {self._stem(k) for k in self.pins.pinned()}
            if stem == keep or stem in pinned:
                continue
            victims.append(stem)
            over -= size
        return victims, over <= 0

    def _evict(self, victims: list[str]) -> None:
        """Under the index lock: drop `victims` from the index (their files are unlinked after)."""
        for stem in victims:
            self.used_bytes -= self._index.pop(stem)
        self.num_evicted += len(victims)

    def _unlink_all(self, stems: list[str], reason: RemovalReason | None) -> None:
        for stem in stems:
            try:
                os.unlink(os.path.join(self.path, stem + SUFFIX))
            except FileNotFoundError:
                pass
        self._dropped(stems, reason)

    def stats(self) -> TierStats:
        base = super().stats()
        with self._index_lock:
            own = {"evicted": self.num_evicted, "corrupt": self.num_corrupt, "forged": self.num_forged}
            return TierStats(add_counts(base.counters, own),
                             {**base.gauges, "files": len(self._index), "bytes_used": self.used_bytes})

    def clear(self) -> int:
        """Finish the writes in flight, then delete every chunk file this tier indexes."""
        self.puts.flush(self.close_timeout)
        with self._index_lock:
            stems = list(self._index)
            self._index.clear()
            self.used_bytes = 0
        self._unlink_all(stems, None)
        return len(stems)

    def remove(self, key: CacheEngineKey) -> bool:
        """Delete `key`'s file; whether there was one. Its removal is reported if there was, or
        if this process knew the key (its file was deleted by another process meanwhile)."""
        stem = self._stem(key)
        try:
            os.unlink(os.path.join(self.path, stem + SUFFIX))
        except FileNotFoundError:
            self._forget(stem, RemovalReason.DELETED)
            return False
        self._forget(self._seen(key), RemovalReason.DELETED)
        return True

    def load_disk(self) -> int:
        """Rebuild the index from the directory (oldest modification first = first to evict) and
        remove temporary files whose writer is gone; returns the number of entries found."""
        found: list[tuple[float, str, int]] = []
        for entry in os.scandir(self.path):
            name = entry.name
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if name.endswith(SUFFIX):
                if st.st_size < disk_file.MIN_FILE_SIZE:
                    unlink_quietly(entry.path)  # cannot even hold a header: a foreign or torn file
                    continue
                found.append((st.st_mtime, name[: -len(SUFFIX)], st.st_size))
            elif name.endswith(TMP_SUFFIX) and disk_file.is_stale_tmp(name, st.st_mtime):
                unlink_quietly(entry.path)
        found.sort()
        with self._index_lock:
            for _, stem, size in found:
                self.used_bytes += size - self._index.pop(stem, 0)
                self._index[stem] = size
            victims = self._take_victims(0)
        self._unlink_all(victims, RemovalReason.EVICTED)
        return len(self._index)

    # ---- writes ---------------------------------------------------------------------------------

    def _should_put(self, key: CacheEngineKey) -> bool:
        return not self.contains(key)

    def _write(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        self.async_save_bytes_to_disk(key, obj)

    def async_save_bytes_to_disk(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Write `memory_obj` as `key`'s file (temporary file + atomic rename); runs on a put
        worker. Raises TooLarge if the file is larger than `max_local_disk_size`, NoRoom if it
        fits only once files that lookups pin are gone (nothing is written or evicted then)."""
        tensor = memory_obj.tensor
        if tensor is None:
            raise ValueError(f"the disk tier stores tensors; got a {memory_obj.get_memory_format()} object")
        chunk_key = key.to_string().encode()
        parts = prefixed(keyed_blob.keyed_head(chunk_key),
                         sealed_parts(self.sealer, chunk_key, self.serializer.to_parts(tensor)))
        size = nbytes_of(parts)
        self._reserve(size)
        stem = self._seen(key)
        try:
            disk_file.write_atomic(self.path, stem, parts, self.fsync)
        finally:
            with self._index_lock:
                self._reserved_bytes -= size
        self._insert_stem(stem, size)
        self.events.stored([key])

    def _reserve(self, size: int) -> None:
        """Make room for a file of `size` bytes (evicting) and reserve it, or raise TooLarge /
        NoRoom (then nothing is evicted)."""
        with self._index_lock:
            if size > self.max_bytes:
                raise TooLarge(f"a chunk file of {size} bytes is larger than max_local_disk_size "
                               f"({self.max_bytes} bytes)")
            victims, fits = self._choose_victims(size)
            if not fits:
                raise NoRoom(f"no room for a chunk file of {size} bytes: lookups pin the files that "
                             f"would have to be evicted")
            self._evict(victims)
            self._reserved_bytes += size
        self._unlink_all(victims, RemovalReason.EVICTED)

    # ---- reads ----------------------------------------------------------------------------------

    def _read(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.load_bytes_from_disk(key)

    def _read_many(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        if len(keys) <= 1:
            return [self._read(k) for k in keys]
        return gather_all([self._loads.submit(self._read, k) for k in keys])

    def _close(self) -> None:
        self._loads.shutdown(wait=True, cancel_futures=True)

    def load_bytes_from_disk(self, key: CacheEngineKey) -> MemoryObj | None:
        """`key`'s chunk in a buffer from `allocate` (reference owned by the caller), or None if
        it is not on disk, is corrupt (then the file is removed) or `allocate` has no room."""
        stem = self._stem(key)
        path = os.path.join(self.path, stem + SUFFIX)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            self._forget(stem, RemovalReason.DELETED)
            return None
        try:
            with f:
                obj = disk_file.read_chunk(f, key.to_string().encode(), SERDE_IDS[self.serde_name],
                                           self.deserializer, self.allocate, self.sealer)
        except ForeignSerdeError:
            return None  # written by a process with another local_disk_serde: a miss, kept
        except CorruptBlobError as e:
            logger.warning("removing corrupt disk cache file %s: %s", path, e)
            with self._index_lock:
                self.num_corrupt += 1
                self.num_forged += isinstance(e, ForgedBlobError)
            self._forget(stem, RemovalReason.CORRUPT)
            unlink_quietly(path)
            return None
        if obj is not None:
            self._seen(key)
            self._touch(stem)
        return obj
