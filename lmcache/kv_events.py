"""KV events in vLLM's format: what LMCache's tiers gain and lose, for KV-aware routers.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in msgpack batches over
ZMQ (`vllm/distributed/kv_events.py`); routers (llm-d, Dynamo, production-stack) subscribe to learn
which instance holds which prefix. LMCache's tiers report `TierEvent`s (`storage_backend.events`);
this module turns them into those events:

- `to_kv_events(published, blocks_of, types)`: a chunk the tier stored becomes one ``BlockStored``
  of the blocks `blocks_of(key)` says the chunk covers (`ChunkBlocks`), with the tier's `medium`
  ("CPU" for a hot tier / a cache server's L1, "STORAGE" for disk and remote tiers; never "GPU",
  vLLM's own medium); chunks removed or cleared become one ``BlockRemoved`` per event with their
  blocks' hashes. A clear is not ``AllBlocksCleared``: that event names no medium, so a
  subscriber would also drop vLLM's own blocks and the other tiers'. A chunk `blocks_of` knows
  nothing about is left out and counted (`Translated.unknown`); one that covers no whole block
  (a short trailing chunk) is left out too.
- The same structs as vLLM's (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `KVEventBatch`:
  same names, fields and msgspec options, so vLLM's decoder reads them) for a process without
  vLLM (the cache server); `VLLM_TYPES` picks vLLM's own classes where vLLM is loaded.
- `KVEventPublisher(endpoint, topic)`: vLLM's `ZmqEventPublisher` framing, a PUB socket sending
  ``(topic, 8-byte big-endian sequence, msgpack KVEventBatch)``; ``tcp://*:PORT`` binds, another
  ``tcp://HOST:PORT`` connects. A subscriber that falls behind costs at most `hwm` batches (ZMQ
  drops the rest for it; `send` never blocks). No replay socket. `check_endpoints`: the endpoint
  forms events travel on (the routers' configs check theirs with it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any, NamedTuple

import msgspec
import zmq

from lmcache.cache_key import CacheEngineKey
from lmcache.storage_backend.events import EventKind, PublishedEvent

BlockHash = bytes | int  # vLLM's ExternalBlockHash


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the events (vLLM's wire format: a map tagged ``"type": <class name>``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class EventTypes(NamedTuple):
    """The classes events are built from (LMCache's or vLLM's own)."""

    stored: Callable[..., Any]
    removed: Callable[..., Any]


OWN_TYPES = EventTypes(BlockStored, BlockRemoved)


def vllm_types() -> EventTypes:
    """vLLM's own event classes (imports vLLM)."""
    from vllm.distributed import kv_events

    return EventTypes(kv_events.BlockStored, kv_events.BlockRemoved)


@dataclass(frozen=True)
class ChunkBlocks:
    """The engine blocks one stored chunk covers: their hashes (chained: `parent_block_hash` is the
    hash of the block before the first), tokens (``len == len(block_hashes) * block_size``) and,
    per block, vLLM's extra keys (LoRA name, cache salt, multimodal ids)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


@dataclass
class Translated:
    """The events built, and how many chunks were left out because their blocks were unknown."""

    events: list[Any] = field(default_factory=list)
    unknown: int = 0


def to_kv_events(published: Iterable[PublishedEvent],
                 blocks_of: Callable[[CacheEngineKey], ChunkBlocks | None],
                 types: EventTypes = OWN_TYPES) -> Translated:
    out = Translated()
    for medium, event in published:
        if event.kind is EventKind.STORED:
            for key in event.keys:
                info = blocks_of(key)
                if info is None:
                    out.unknown += 1
                if info is None or not info.block_hashes:
                    continue
                out.events.append(types.stored(
                    block_hashes=list(info.block_hashes), parent_block_hash=info.parent_block_hash,
                    token_ids=list(info.token_ids), block_size=info.block_size, lora_id=info.lora_id,
                    medium=medium, lora_name=info.lora_name, extra_keys=info.extra_keys))
            continue
        hashes: list[BlockHash] = []
        for key in event.keys:
            info = blocks_of(key)
            if info is None:
                out.unknown += 1
            else:
                hashes.extend(info.block_hashes)
        if hashes:
            out.events.append(types.removed(block_hashes=hashes, medium=medium))
    return out


def check_endpoints(endpoints: Sequence[str], connect: bool = False) -> None:
    """ValueError unless each of `endpoints` is a ZMQ endpoint events can travel on: ``tcp://HOST:PORT``
    (HOST ``*``: bound on every interface; not for a subscriber, `connect`), ``ipc://PATH`` or
    ``inproc://NAME``."""
    for endpoint in endpoints:
        if endpoint.startswith(("ipc://", "inproc://")):
            continue
        if not endpoint.startswith("tcp://"):
            raise ValueError(f"KV events endpoint {endpoint!r}: expected tcp://HOST:PORT (or ipc://, inproc://)")
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if not (host and ((port.isdigit() and int(port) < 65536) or port == "*")):
            raise ValueError(f"KV events endpoint {endpoint!r}: expected tcp://HOST:PORT")
        if connect and host == "*":
            raise ValueError(f"KV events endpoint {endpoint!r}: a subscriber connects to the publisher's "
                             "HOST:PORT (tcp://*:PORT is where the publisher binds)")


class KVEventPublisher:
    """Publish `KVEventBatch`es on `endpoint` (see the module doc). Not thread-safe: one thread
    publishes."""

    def __init__(self, endpoint: str, topic: str = "", hwm: int = 10_000) -> None:
        check_endpoints([endpoint])
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"cannot publish KV events on {endpoint!r}: {e}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._topic = topic.encode()
        self._seq = count()
        self._encoder = msgspec.msgpack.Encoder()
        self.num_batches = 0
        self.num_unsent = 0  # batches ZMQ refused (would have blocked)

    def publish(self, events: Sequence[Any]) -> None:
        """Send one batch of `events` (nothing when empty); never blocks."""
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=list(events)))
        seq = next(self._seq).to_bytes(8, "big")
        try:
            self._pub.send_multipart((self._topic, seq, payload), zmq.NOBLOCK)
            self.num_batches += 1
        except zmq.Again:
            self.num_unsent += 1

    def close(self) -> None:
        self._pub.close(0)
        self._ctx.term()
