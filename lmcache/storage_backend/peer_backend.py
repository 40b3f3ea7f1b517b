"""`PeerBackend` ("PeerBackend", alias "P2PBackend"): chunks that other instances computed
(`enable_p2p`), pulled straight from them; the last tier asked.

Each instance runs:
- a `PeerServer` at `distributed_url` serving its own local chunks read-only over lm:// (with the
  shared secret ``LMCACHE_AUTH_TOKEN`` if set), bound to the host given there (loopback unless
  configured otherwise; port 0 = any free port);
- a `LookupService` registration at `lookup_url`: the keys its local tiers hold, updated as they
  are stored, promoted and evicted (`local_keys_changed`), with a heartbeat so that a dead
  instance's entries expire `p2p_ttl` seconds after its last one.

As a tier: `batched_contains` asks the lookup service which live peers hold each key (one
round trip); `batched_get` pulls the keys in one pipelined batch per peer (peers in parallel,
each key from the peer holding most of the batch, a second round from other holders for what
failed). Every value is a keyed blob (sealed for its key with sealing on, `serde.seal`): a
value for a key that was not asked for (a confused or
lying peer) or that does not verify makes the whole batch from that peer a miss. A dead, slow or
lying peer is a miss within `remote_timeout`, caught by that peer's failure domain (the tier's
``failures``; logged once per incident) and then left alone for a backoff delay (a batch routed
around it counts one ``skipped``); the lookup service's faults are its own domain, counted in the
tier's numbers too. Requests never fail because of a peer. Nothing is written to peers
(`submit_put_task` does nothing: they pull what they need).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.failures import FailureDomains
from lmcache.memory_management import MemoryObj, release_all
from lmcache.observability import TierStats, add_counts
from lmcache.p2p.lookup_service import LookupService
from lmcache.p2p.peer_server import PeerServer
from lmcache.server.client import LMCacheClient
from lmcache.server.server import ServerThread
from lmcache.storage_backend.abstract_backend import StorageBackendInterface, TierContext
from lmcache.storage_backend.registry import register_tier
from lmcache.storage_backend.serde import CorruptBlobError, create_serde, keyed_blob
from lmcache.storage_backend.serde.blob import SERDE_IDS
from lmcache.storage_backend.serde.blob_stream import ReadStream
from lmcache.storage_backend.serde.seal import ForgedBlobError, create_sealer, read_blob_sealed
from lmcache.storage_backend.serde.serde import AllocateFn

logger = logging.getLogger(__name__)
PULL_WORKERS = 4
SERDE = "naive"


@register_tier
class PeerBackend(StorageBackendInterface):
    name = "PeerBackend"
    aliases = ("P2PBackend",)
    lookup_order = 30
    is_local = False
    may_fail = True
    publishes_local_keys = True

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata, allocate: AllocateFn,
                 read_local: Callable[[CacheEngineKey], MemoryObj | None],
                 has_local: Callable[[CacheEngineKey], bool]) -> None:
        if config.lookup_url is None or config.distributed_url is None:
            raise ValueError("PeerBackend needs config.lookup_url and config.distributed_url")
        self.allocate = allocate
        self.timeout = config.remote_timeout
        self._token = os.environ.get("LMCACHE_AUTH_TOKEN") or None
        serializer, self._deserializer = create_serde(SERDE, config, metadata)
        self._sealer = create_sealer(config.kv_encryption_key)
        host, _, port = config.distributed_url.rpartition(":")
        peer_server = PeerServer(read_local, has_local, serializer, self._sealer, auth_token=self._token,
                                 frame_timeout=max(self.timeout, 1.0))
        try:
            self.server = ServerThread(peer_server, host, int(port))
        except OSError as e:
            raise ValueError(f"distributed_url {config.distributed_url!r}: cannot serve peers there: "
                             f"{e}") from e
        self.address = f"{advertised_host(host)}:{self.server.port}"
        try:
            self.lookup = LookupService(config.lookup_url, self.address, config.p2p_ttl, self.timeout)
        except BaseException:
            self.server.close()
            raise
        self._peers = FailureDomains(lambda peer: f"peer {peer}")
        self._clients: dict[str, LMCacheClient] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(PULL_WORKERS, thread_name_prefix="lmcache-peer-pull")
        self.num_rejected = 0  # batches dropped because a value did not verify
        self.num_forged = 0  # of those, batches with a value that did not open (sealing on)
        logger.info("peer-to-peer sharing: serving chunks on %s, lookups at %s", self.address,
                    config.lookup_url)

    @classmethod
    def create(cls, ctx: TierContext) -> PeerBackend | None:
        if not ctx.config.enable_p2p:
            return None
        return cls(ctx.config, ctx.metadata, ctx.allocate, ctx.read_local, ctx.has_local)

    # ---- what this instance holds -------------------------------------------------------------------

    def local_keys_changed(self, added: Sequence[CacheEngineKey], removed: Sequence[CacheEngineKey]) -> None:
        if added:
            self.lookup.add(added)
        if removed:
            self.lookup.remove(removed)

    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj) -> Future | None:
        return None

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False

    def remove(self, key: CacheEngineKey) -> bool:
        return False  # peers' chunks are theirs

    # ---- reads ------------------------------------------------------------------------------------

    def _usable(self, holders: list[list[str]]) -> list[list[str]]:
        """`holders` without the peers being backed off from (each counted once as skipped)."""
        ready = {peer: self._peers.admit(peer) for peer in {p for h in holders for p in h}}
        return [[p for p in h if ready[p]] for h in holders]

    def contains(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key])[0]

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        return [bool(h) for h in self._usable(self._holders(keys))]

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.batched_get([key])[0]

    def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        holders = self._usable(self._holders(keys))
        out: list[MemoryObj | None] = [None] * len(keys)
        tried: set[str] = set()
        try:
            for _ in range(2):  # a second round from other holders for what the first did not get
                plan = _assign([[p for p in h if p not in tried] if out[i] is None else []
                                for i, h in enumerate(holders)])
                if not plan:
                    break
                pulls = {peer: self._pool.submit(self._pull, peer, [keys[i] for i in idx])
                         for peer, idx in plan.items()}
                tried.update(plan)
                for peer, idx in plan.items():
                    for i, obj in zip(idx, pulls[peer].result(), strict=True):
                        out[i] = obj
        except BaseException:
            release_all(out)
            raise
        return out

    def _pull(self, peer: str, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """`keys` from `peer` in one pipelined batch; all misses if the peer fails or lies."""
        names = [k.to_string() for k in keys]
        index = {name.encode(): i for i, name in enumerate(names)}
        out: list[MemoryObj | None] = [None] * len(keys)

        def read(_: int, stream: ReadStream, length: int) -> None:
            found, blob_len = keyed_blob.read_key(stream, length)
            i = index.get(found)
            if i is None:
                raise CorruptBlobError(f"peer {peer} sent a chunk that was not asked for")
            obj = read_blob_sealed(stream, blob_len, found, self._sealer, SERDE_IDS[SERDE],
                                   self._deserializer, self.allocate)
            if out[i] is not None:  # a retried exchange: keep the newer copy
                out[i].ref_count_down()  # type: ignore[union-attr]
            out[i] = obj

        def pull() -> bool:
            try:
                self._client(peer).get_many_into(names, read)
            except CorruptBlobError as e:
                with self._lock:
                    self.num_rejected += 1
                    self.num_forged += isinstance(e, ForgedBlobError)
                raise
            return True

        if not self._peers.call(peer, pull, False):
            release_all(out)
            return [None] * len(keys)
        return out

    def _holders(self, keys: Sequence[CacheEngineKey]) -> list[list[str]]:
        """`lookup.holders(keys)`, and the connections to peers no longer alive closed (a dead
        peer's idle connections would otherwise wait in CLOSE_WAIT for ever)."""
        holders = self.lookup.holders(keys)
        live = set(self.lookup.peers)
        with self._lock:
            gone = [self._clients.pop(peer) for peer in [p for p in self._clients if p not in live]]
        for client in gone:
            client.close()
        return holders

    def _client(self, peer: str) -> LMCacheClient:
        with self._lock:
            client = self._clients.get(peer)
            if client is None:
                host, _, port = peer.rpartition(":")
                client = self._clients[peer] = LMCacheClient(host, int(port), timeout=self.timeout,
                                                             auth_token=self._token)
            return client

    def healthy(self) -> bool:
        return self.lookup.healthy

    def stats(self) -> TierStats:
        with self._lock:
            rejected, forged = self.num_rejected, self.num_forged
        return TierStats(add_counts({"corrupt": rejected, "forged": forged,
                                     "registrations_dropped": self.lookup.num_dropped},
                                    self._peers.counts(), self.lookup.fault_counts()))

    def close(self) -> None:
        self.lookup.close()
        self.server.close()
        self._pool.shutdown(wait=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def _assign(holders: list[list[str]]) -> dict[str, list[int]]:
    """Each key (index) to one of its holders, preferring the peers that hold most keys, so
    that a batch touches as few peers as possible."""
    counts: dict[str, int] = {}
    for h in holders:
        for peer in h:
            counts[peer] = counts.get(peer, 0) + 1
    plan: dict[str, list[int]] = {}
    for i, h in enumerate(holders):
        if h:
            plan.setdefault(max(h, key=lambda p: (counts[p], p)), []).append(i)
    return plan


def advertised_host(bind_host: str) -> str:
    """The address peers reach a server bound to `bind_host` at (a wildcard bind advertises this
    machine's primary address)."""
    if bind_host in ("", "0.0.0.0", "::", "[::]"):
        return socket.gethostbyname(socket.gethostname())
    return bind_host.strip("[]")
