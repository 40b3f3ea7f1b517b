"""`PDBackend` ("PDBackend", alias "PD"): KV a prefill instance sent this decode instance.

Built when the config has ``enable_pd`` and ``pd_role: receiver``. It owns a receive buffer of
`pd_buffer_size` bytes (reserved whole, its pages touched as it fills) and the KV channel's
listener (`lmcache.pd.receiver`, on ``pd_peer_host:pd_peer_init_port + rank``). Senders reserve
room for chunks (`reserve`), write them, and `commit` them: only then does the tier hold them, so
a half-written chunk is never visible; `abort` frees the room of a transfer that broke.

Chunks received wait here for the request that needs them; lookups find them like any other
tier's. A read hands them over once: with the hot tier on (``local_cpu``) they are copied into
the engine's arena and kept there as cached KV (`promote_hits`); without it, the receive buffer's
own object is handed out and freed when the load is done. Room is made by dropping chunks nobody
claimed for `UNCLAIMED_TTL` seconds (oldest first; chunks a lookup pinned never); when none can
go, `reserve` answers "no room" and the sender waits, then skips (the decoder computes the rest).
Chunks received, dropped to make room, handed over and removed are reported as events (`events`;
the receiver's threads' too: the storage manager takes them on its next call).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from lmcache.cache_key import CacheEngineKey
from lmcache.memory_management import MemoryObj, release_all
from lmcache.memory_management.allocators import HostMemoryAllocator
from lmcache.observability import Counters, TierStats
from lmcache.pd.receiver import ReceiverServer
from lmcache.pd.wire import FOREIGN, HAVE, Chunk
from lmcache.storage_backend.abstract_backend import StorageBackendInterface, TierContext
from lmcache.storage_backend.events import RemovalReason, TierEvents
from lmcache.storage_backend.registry import register_tier
from lmcache.storage_backend.serde.seal import create_sealer

UNCLAIMED_TTL = 60.0  # seconds received KV is kept for its request before it may make room


@register_tier
class PDBackend(StorageBackendInterface):
    name = "PDBackend"
    aliases = ("PD",)
    lookup_order = 5
    is_local = True
    may_fail = False

    def __init__(self, ctx: TierContext, clock: Callable[[], float] = time.monotonic) -> None:
        config, md = ctx.config, ctx.metadata
        self.ctx = ctx
        self.events: TierEvents = TierEvents(self.name)
        self.promote_hits = config.local_cpu
        self.allocator = HostMemoryAllocator(config.pd_buffer_size)
        self._clock = clock
        self._lock = threading.Lock()
        self._objs: OrderedDict[CacheEngineKey, tuple[MemoryObj, float]] = OrderedDict()  # oldest first
        self._reserved: set[CacheEngineKey] = set()
        from lmcache.token_database import ChunkedTokenDatabase

        ours = ChunkedTokenDatabase(config, md).make_key("")
        self._ours = (ours.model_name, ours.world_size, ours.worker_id, ours.dtype)
        self._formats = {md.layout, md.state_layout} - {""}
        self.counts = Counters()  # received_chunks/_bytes, no_room, expired, foreign, handed_over
        assert config.pd_peer_init_port is not None  # the config checks it for a receiver
        port = config.pd_peer_init_port + max(md.worker_id, 0)
        try:
            self.server = ReceiverServer(config.pd_peer_host, port, self, config.transfer_channel,
                                         config.nixl_backends, create_sealer(config.kv_encryption_key))
        except BaseException:
            self.allocator.close()
            raise

    @classmethod
    def create(cls, ctx: TierContext) -> PDBackend | None:
        if not (ctx.config.enable_pd and ctx.config.pd_role == "receiver"):
            return None
        return cls(ctx)

    # ---- the channel's side ---------------------------------------------------------------------

    @property
    def buffer(self) -> torch.Tensor:
        """The receive buffer (registered with NIXL by the receiver)."""
        return self.allocator.buffer

    def reserve(self, chunks: Sequence[Chunk]) -> list[MemoryObj | str | None]:
        """Room for each chunk, in order: an object in the receive buffer (reserved, invisible
        until `commit`), HAVE when it is held already (here or in another local tier) or being
        received, FOREIGN when it is not this engine's KV, None when there is no room for it (nor
        then for any chunk after it). If it raises, nothing stays reserved."""
        out: list[MemoryObj | str | None] = []
        room = True
        try:
            for chunk in chunks:
                got = self._reserve_one(chunk, room)
                room = room and got is not None
                out.append(got)
        except BaseException:
            taken = [(chunk, got) for chunk, got in zip(chunks, out) if isinstance(got, MemoryObj)]
            self.abort([chunk for chunk, _ in taken], [got for _, got in taken])
            raise
        return out

    def _reserve_one(self, chunk: Chunk, room: bool) -> MemoryObj | str | None:
        if not self._is_ours(chunk):
            self.counts.add("foreign")
            return FOREIGN
        if self.ctx.has_local(chunk.key):
            return HAVE
        with self._lock:  # claimed before allocating: a concurrent offer of it is answered HAVE
            if chunk.key in self._reserved or chunk.key in self._objs:
                return HAVE
            self._reserved.add(chunk.key)
        obj: MemoryObj | None = None
        try:
            obj = self._allocate(chunk) if room else None
        finally:
            if obj is None:
                with self._lock:
                    self._reserved.discard(chunk.key)
        if obj is None:
            self.counts.add("no_room")
        return obj

    def _is_ours(self, chunk: Chunk) -> bool:
        k = chunk.key
        return (k.model_name, k.world_size, k.worker_id, k.dtype) == self._ours and k.fmt in self._formats

    def _allocate(self, chunk: Chunk) -> MemoryObj | None:
        obj = self.allocator.allocate(chunk.shape, chunk.dtype, chunk.fmt)
        while obj is None and self._expire_one():
            obj = self.allocator.allocate(chunk.shape, chunk.dtype, chunk.fmt)
        return obj

    def _expire_one(self) -> bool:
        """Drop the oldest chunk unclaimed for UNCLAIMED_TTL s and not pinned; False if none."""
        now = self._clock()
        victim: tuple[CacheEngineKey, MemoryObj] | None = None
        with self._lock:
            for key, (obj, received) in self._objs.items():
                if now - received < UNCLAIMED_TTL:
                    break  # the rest came later
                if not self.ctx.pins.is_pinned(key) and obj.get_ref_count() == 1:
                    victim = key, obj
                    break
            if victim is not None:
                del self._objs[victim[0]]
        if victim is None:
            return False
        victim[1].ref_count_down()
        self.counts.add("expired")
        self.events.removed([victim[0]], RemovalReason.EVICTED)
        return True

    def commit(self, chunks: Sequence[Chunk], objs: Sequence[MemoryObj]) -> int:
        """The reserved chunks' bytes are written: they become visible."""
        now = self._clock()
        with self._lock:
            for chunk, obj in zip(chunks, objs, strict=True):
                self._reserved.discard(chunk.key)
                self._objs[chunk.key] = (obj, now)
                self.counts.add("received_chunks")
                self.counts.add("received_bytes", chunk.nbytes)
        self.events.stored([chunk.key for chunk in chunks])
        return len(objs)

    def abort(self, chunks: Sequence[Chunk], objs: Sequence[MemoryObj]) -> None:
        """A transfer broke: its reservations go, never seen (their bytes are freed first, so a
        reader that sees no reservation sees their room free too)."""
        release_all(list(objs))
        with self._lock:
            for chunk in chunks:
                self._reserved.discard(chunk.key)

    # ---- the tier -------------------------------------------------------------------------------

    def contains(self, key: CacheEngineKey) -> bool:
        return key in self._objs

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False

    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj) -> Future | None:
        return None  # only a sender fills this tier

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        """Hand the chunk over (it leaves this tier): a copy in the engine's arena when the hot
        tier keeps it (None, and the chunk stays, if the arena has no room), else the object."""
        with self._lock:
            held = self._objs.get(key)
            if held is None:
                return None
            if self.promote_hits:
                held[0].ref_count_up()  # ours while copying, even if the chunk is dropped meanwhile
            else:
                del self._objs[key]
        obj: MemoryObj | None = held[0]
        left = True  # whether the chunk left this tier now (not dropped by another thread meanwhile)
        if self.promote_hits:
            try:
                obj = self._copy_to_arena(held[0])
            finally:
                held[0].ref_count_down()
            if obj is None:
                return None
            left = self._drop(key)
        if left:
            self.events.removed([key], RemovalReason.HANDED_OVER)
        self.counts.add("handed_over")
        return obj

    def _copy_to_arena(self, obj: MemoryObj) -> MemoryObj | None:
        src = obj.tensor
        assert src is not None
        copy = self.ctx.allocate(src.shape, src.dtype, obj.metadata.fmt)
        if copy is not None:
            dst = copy.tensor
            assert dst is not None
            dst.copy_(src)
        return copy

    def remove(self, key: CacheEngineKey) -> bool:
        if not self._drop(key):
            return False
        self.events.removed([key], RemovalReason.DELETED)
        return True

    def _drop(self, key: CacheEngineKey) -> bool:
        """Forget `key` and free its room; the caller reports it."""
        with self._lock:
            held = self._objs.pop(key, None)
        if held is None:
            return False
        held[0].ref_count_down()
        return True

    def clear(self) -> int:
        with self._lock:
            keys = list(self._objs)
        dropped = [k for k in keys if self._drop(k)]
        self.events.cleared(dropped)
        return len(dropped)

    def stats(self) -> TierStats:
        with self._lock:
            chunks = len(self._objs)
        counters = {**self.counts.snapshot(), "forged": self.server.num_forged}
        return TierStats(counters, {"chunks": chunks, "bytes_used": self.allocator.used_bytes,
                                             "reserved": len(self._reserved)})

    def check_integrity(self, at_rest: bool = False) -> None:
        """The receive buffer's books balance and hold exactly the chunks (`at_rest`: and the
        reservations of transfers in flight: none)."""
        self.allocator.check_integrity()
        with self._lock:
            if at_rest and self._reserved:
                raise AssertionError(f"{len(self._reserved)} chunks still reserved")
            for key, (obj, _) in self._objs.items():
                if not obj.valid or obj.get_ref_count() < 1:
                    raise AssertionError(f"the receive buffer holds a released object for {key}")
                if at_rest and obj.get_ref_count() != 1:
                    raise AssertionError(f"{key} has {obj.get_ref_count()} references at rest")
            if at_rest and not self._reserved:
                held = sum(obj.metadata.phy_size for obj, _ in self._objs.values())
                if held != self.allocator.used_bytes:
                    raise AssertionError(f"the receive buffer uses {self.allocator.used_bytes} bytes, "
                                         f"its chunks {held}")

    def close(self) -> None:
        self.server.close()
        self.clear()
        self.allocator.close()
