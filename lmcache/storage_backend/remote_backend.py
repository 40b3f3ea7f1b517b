"""`RemoteBackend` ("RemoteBackend"): KV chunks in a shared remote store, chosen by `remote_url`.

The store is reached through a `RemoteConnector` (lm://, redis://, rediss://, valkey://,
redis-sentinel://, redis-cluster://; see `connectors/url.py`); chunks are serialized with
`remote_serde`, and every blob carries the checksummed header, so a truncated or foreign value is
a miss (and is deleted, so that it can be stored again). With sealing on (`kv_encryption_key`)
values are sealed for their chunk key (`serde.seal`); one that does not open is a miss, deleted and
counted as ``forged`` (and ``corrupt``).

What this process writes, removes and deletes as corrupt it reports as events (`events`); the
store's own evictions (a Valkey `maxmemory` policy, an lm:// server's LRU) and other instances'
writes are invisible from here and are never reported.

Failure is a miss. The failing part is the connector's `failure_domain` of a key: the whole
server, or one node of a cluster; the tier guards each one (`FailureDomains`, `backoff` /
`max_backoff` URL options), because one batch spans several nodes and a dead node must cost only
its share of the keys. A fault is caught, counted (the tier's ``failures`` / ``skipped``) and
logged once per incident there, and nowhere else: a read (`_call`) answers its default (not found)
for that node's keys; a write raises the `DomainFault` to the put queue, which counts the put as
failed (or not attempted) and never as written. A value the store refuses as larger than its
capacity (lm://'s TOO_LARGE) is capacity, not a fault: no backoff, the put is counted in
``too_large`` (and ``puts_dropped``).
Batches (`batched_get`, `batched_contains`) cost one pipelined round trip per failure domain (with
sealing on, a batched get's keys go over `SEALED_READ_STREAMS` connections at once, so that
opening values on one core overlaps reading them on the other; unsealed values are read at the
socket's speed by one, which two only slowed, `benchmarks/RESULTS.md`); the
values of a batched get are read off the socket straight into arena buffers, or, for a serde that
decodes (CacheGen), read whole and decoded on the tier's decode thread while the next values
arrive, so transfer and decode overlap instead of adding up. A write is a plain
SET (no EXISTS first: the value for a key never changes, so writing it again is harmless).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import TypeVar

from lmcache.backoff import Clock
from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.failures import FailureDomains
from lmcache.memory_management import MemoryObj, release_all
from lmcache.observability import TierStats, add_counts
from lmcache.storage_backend.abstract_backend import TierContext
from lmcache.storage_backend.connectors import RemoteConnector, create_connector, parse_remote_url
from lmcache.storage_backend.events import RemovalReason, TierEvents
from lmcache.storage_backend.lower_tier import LowerTierBackend, TierPools
from lmcache.storage_backend.registry import register_tier
from lmcache.storage_backend.serde import CorruptBlobError, ForeignSerdeError, create_serde
from lmcache.storage_backend.serde.blob import SERDE_IDS
from lmcache.storage_backend.serde.blob_stream import ReadStream
from lmcache.storage_backend.serde.seal import (
    ForgedBlobError,
    create_sealer,
    read_blob_sealed,
    read_whole_sealed,
    sealed_parts,
)
from lmcache.storage_backend.serde.serde import AllocateFn

logger = logging.getLogger(__name__)
T = TypeVar("T")
SEALED_READ_STREAMS = 2  # connections a sealed batch of one failure domain is read over at once


def _split(batch: list[T], n: int) -> list[list[T]]:
    """`batch` in at most `n` contiguous slices of near-equal length."""
    size = -(-len(batch) // n)
    return [batch[i:i + size] for i in range(0, len(batch), size)]


@register_tier
class RemoteBackend(LowerTierBackend):
    name = "RemoteBackend"
    lookup_order = 20
    is_local = False
    may_fail = True
    medium = "STORAGE"

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata, allocate: AllocateFn,
                 pools: TierPools | None = None, connector: RemoteConnector | None = None,
                 clock: Clock = time.monotonic) -> None:
        """`clock` times the backoff of failing parts of the store (injectable for tests)."""
        if config.remote_url is None:
            raise ValueError("RemoteBackend needs config.remote_url")
        self.url = parse_remote_url(config.remote_url)
        self._domains = FailureDomains(self._domain_label, self.url.float_option("backoff", 0.5),
                                       self.url.float_option("max_backoff", 30.0),
                                       passthrough=(CorruptBlobError,), clock=clock)
        self.connector = connector or create_connector(self.url, config.remote_timeout)
        super().__init__(allocate, pools)
        self.serde_name = config.remote_serde or "naive"
        self.serializer, self.deserializer = create_serde(self.serde_name, config, metadata)
        self.lossy = self.deserializer.lossy
        self.events: TierEvents = TierEvents(self.name)
        self.sealer = create_sealer(config.kv_encryption_key)
        self._count_lock = threading.Lock()
        self.num_corrupt = 0
        self.num_forged = 0
        self.num_foreign = 0  # valid values written with another remote_serde: misses, kept
        # decodes of a batch's values run here while the connector reads the next ones
        self._decodes = None if self.deserializer.raw_payload else \
            ThreadPoolExecutor(1, thread_name_prefix="lmcache-remote-decode")
        # connections a batched get of one failure domain is read over at once; the others than
        # the caller's thread's are read here
        self.read_streams = 1 if self.sealer is None else SEALED_READ_STREAMS
        self._streams = ThreadPoolExecutor(SEALED_READ_STREAMS - 1, thread_name_prefix="lmcache-remote-read")

    @classmethod
    def create(cls, ctx: TierContext) -> RemoteBackend | None:
        if ctx.config.remote_url is None:
            return None
        return cls(ctx.config, ctx.metadata, ctx.allocate)

    def _remote_key(self, key: CacheEngineKey) -> str:
        ns = self.url.namespace
        return f"{ns}:{key.to_string()}" if ns else key.to_string()

    def _key_of(self, remote_key: str) -> CacheEngineKey:
        ns = self.url.namespace
        return CacheEngineKey.from_string(remote_key.removeprefix(f"{ns}:") if ns else remote_key)

    def _domain_label(self, name: str) -> str:
        return f"remote store {self.url.url}" + ("" if name == "*" else f" node {name}")

    def _call(self, remote_key: str, fn: Callable[[], T], default: T) -> T:
        """`fn()` against `remote_key`'s failure domain (see `FailureDomains`); a CorruptBlobError
        means the store answered with a bad value and is raised (the caller deletes it)."""
        return self._domains.call(self.connector.failure_domain(remote_key), fn, default)

    def _run(self, remote_key: str, fn: Callable[[], T]) -> T:
        """`_call` that raises the `DomainFault` instead of answering a default."""
        return self._domains.run(self.connector.failure_domain(remote_key), fn)

    @property
    def num_skipped(self) -> int:
        """Calls not made because the store was backing off."""
        return self._domains.num_skipped

    def healthy(self) -> bool:
        return self.available

    def stats(self) -> TierStats:
        base = super().stats()
        with self._count_lock:
            counts = {"corrupt": self.num_corrupt, "forged": self.num_forged, "foreign": self.num_foreign}
        return TierStats(add_counts(base.counters, counts, self._domains.counts()), base.gauges)

    @property
    def available(self) -> bool:
        """False while some part of the store is failing (being backed off from)."""
        return not self._domains.failing()

    # ---- interface ------------------------------------------------------------------------------

    def contains(self, key: CacheEngineKey) -> bool:
        rk = self._remote_key(key)
        return self._call(rk, lambda: self.connector.exists(rk), False)

    def remove(self, key: CacheEngineKey) -> bool:
        rk = self._remote_key(key)
        removed = self._call(rk, lambda: self.connector.delete(rk), False)
        if removed:
            self.events.removed([key], RemovalReason.DELETED)
        return removed

    def _write(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        tensor = obj.tensor
        if tensor is None:
            raise ValueError(f"the remote tier stores tensors; got a {obj.get_memory_format()} object")
        rk = self._remote_key(key)
        parts = sealed_parts(self.sealer, key.to_string().encode(), self.serializer.to_parts(tensor))
        self._run(rk, lambda: self.connector.put(rk, parts))
        self.events.stored([key])

    def _read(self, key: CacheEngineKey) -> MemoryObj | None:
        """The value is read into an arena buffer as it arrives (`blob_stream.read_blob`); a
        transport fault is a miss (also one after the value was read: its buffer is released),
        a value that does not verify is deleted."""
        rk = self._remote_key(key)
        made: list[MemoryObj] = []

        def read(stream: ReadStream, length: int) -> MemoryObj | None:
            return _noted(made, self._read_blob(key.to_string().encode(), stream, length))

        obj = None
        try:
            obj = self._verified(rk, lambda: self._call(rk, lambda: self.connector.get_into(rk, read), None))
        finally:
            _release_unkept(made, [obj])
        return obj

    def _by_domain(self, keys: Sequence[CacheEngineKey]) -> list[list[tuple[int, str]]]:
        """(index, remote key) of `keys`, grouped by failure domain."""
        groups: dict[str, list[tuple[int, str]]] = {}
        for i, key in enumerate(keys):
            rk = self._remote_key(key)
            groups.setdefault(self.connector.failure_domain(rk), []).append((i, rk))
        return list(groups.values())

    def _contains_many(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        out = [False] * len(keys)
        for group in self._by_domain(keys):
            rks = [rk for _, rk in group]
            hits = self._call(rks[0], partial(self.connector.exists_many, rks), [False] * len(rks))
            for (i, _), hit in zip(group, hits, strict=True):
                out[i] = hit
        return out

    def _read_many(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """Pipelined requests, `read_streams` at once per failure domain over as many connections;
        values stream into arena buffers (or are decoded on the decode thread as they arrive, see
        the module doc)."""
        out: list[MemoryObj | None] = [None] * len(keys)
        made: list[MemoryObj] = []  # every object read, also by an attempt that failed later
        decoding: list[Future[BlobRead]] = []

        def settle(make: Callable[[], MemoryObj | None]) -> BlobRead:
            try:
                return _noted(made, make())
            except (CorruptBlobError, ForeignSerdeError) as e:
                return e

        def read(chunk_keys: list[bytes], i: int, stream: ReadStream,
                 length: int) -> BlobRead | Future[BlobRead]:
            if self._decodes is None:
                return settle(partial(self._read_blob, chunk_keys[i], stream, length))
            try:
                whole = read_whole_sealed(stream, length, chunk_keys[i], self.sealer)
            except CorruptBlobError as e:
                return e
            decode = partial(self.deserializer.from_bytes_to, whole, self.allocate)
            decoding.append(self._decodes.submit(settle, decode))
            return decoding[-1]

        def fetch(batch: list[tuple[int, str]]) -> None:
            rks = [rk for _, rk in batch]
            chunk_keys = [keys[i].to_string().encode() for i, _ in batch]
            misses: list[BlobRead | Future[BlobRead]] = [None] * len(rks)
            get = partial(self.connector.get_many_into, rks, partial(read, chunk_keys))
            values = self._call(rks[0], get, misses)
            for (i, rk), value in zip(batch, values, strict=True):
                out[i] = self._verified(rk, partial(_unwrap, value))

        batches = [b for group in self._by_domain(keys) for b in _split(group, self.read_streams)]
        done = False
        try:
            others = [self._streams.submit(fetch, b) for b in batches[1:]]
            try:
                if batches:
                    fetch(batches[0])
            finally:
                wait(others)
            for f in others:
                f.result()  # the first failure, if any, raises here
            done = True
        finally:
            wait(decoding)  # also those of a batch that failed: their objects are released below
            _release_unkept(made, out if done else [])
        return out

    def _read_blob(self, chunk_key: bytes, stream: ReadStream, length: int) -> MemoryObj | None:
        return read_blob_sealed(stream, length, chunk_key, self.sealer, SERDE_IDS[self.serde_name],
                                self.deserializer, self.allocate)

    def _verified(self, remote_key: str, read: Callable[[], MemoryObj | None]) -> MemoryObj | None:
        """`read()`; a value that does not verify is a miss (a corrupt one is deleted, one written
        with another serde is kept)."""
        try:
            return read()
        except ForeignSerdeError:
            with self._count_lock:
                self.num_foreign += 1
            return None
        except CorruptBlobError as e:
            self._drop_corrupt(remote_key, e)
            return None

    def _drop_corrupt(self, remote_key: str, error: CorruptBlobError) -> None:
        with self._count_lock:
            self.num_corrupt += 1
            self.num_forged += isinstance(error, ForgedBlobError)
        logger.warning("deleting corrupt remote value %r: %s", remote_key, error)
        self._call(remote_key, lambda: self.connector.delete(remote_key), False)
        self.events.removed([self._key_of(remote_key)], RemovalReason.CORRUPT)

    def _close(self) -> None:
        self._streams.shutdown(wait=True)
        if self._decodes is not None:
            self._decodes.shutdown(wait=True)
        self.connector.close()


def _noted(made: list[MemoryObj], obj: MemoryObj | None) -> MemoryObj | None:
    """`obj`, appended to `made` (the objects a request read) unless None."""
    if obj is not None:
        made.append(obj)
    return obj


def _release_unkept(made: list[MemoryObj], kept: Sequence[MemoryObj | None]) -> None:
    """Release the objects of `made` that are not in `kept`: those a request read before it
    failed (a connection lost after a value, before the rest of the reply), which no caller
    will ever see."""
    ids = {id(obj) for obj in kept if obj is not None}
    release_all([obj for obj in made if id(obj) not in ids])


BlobError = CorruptBlobError | ForeignSerdeError
BlobRead = MemoryObj | BlobError | None  # what reading one value gives


def _unwrap(value: BlobRead | Future[BlobRead]) -> MemoryObj | None:
    got = value.result() if isinstance(value, Future) else value  # a decode's own failure
    if isinstance(got, (CorruptBlobError, ForeignSerdeError)):   # (not a bad blob) raises here
        raise got
    return got
