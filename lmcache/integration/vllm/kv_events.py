"""LMCache's tiers in vLLM's KV events (on only when vLLM's `kv_events_config.enable_kv_cache_events` is).

Where each part runs. The tiers live in the workers, so their events (`StorageManager.
take_published`) are taken there after every step (`get_kv_connector_kv_cache_events`) and travel
to the EngineCore in vLLM's `KVConnectorOutput.kv_cache_events` (`LMCacheKVEvents`); the scheduler
side collects them (`update_connector_output`) and vLLM's scheduler publishes what `take_events`
yields with its own events, in the same batch on the same ZMQ socket. So events leave with an
engine step: an idle engine publishes them with its next step, as it does its own.

A chunk key names no vLLM block, and the worker sees no block hashes: the scheduler side sends,
with every plan that saves or loads, the request's vLLM block hashes, LoRA and extra keys
(`PlanBlocks`, `plan_blocks`); the worker keeps, per chunk key, the blocks that chunk covers
(`BlockIndex`: bounded, least recently recorded dropped first). A chunk ``[s, e)`` covers the blocks
that end inside it (``s < end <= e``), so a trailing partial block (which vLLM does not hash
either) is never reported. A chunk whose blocks the worker does not know (one loaded from disk
after a restart, or recorded too long ago) is left out of the events and counted
(``kv_events_unknown_chunks``): a subscriber learns only about chunks it can name, and is told of
their removal as long as the index still knows them.

With several ranks (tensor parallelism) a chunk is published as stored once every rank has
reported storing it, in that step or an earlier one (each rank's lower tiers write at their own
pace), and as removed when any rank reported removing it (`SchedulerEvents`): a prefix one rank
does not hold is of no use. A rank with no events in a step sends none, and vLLM merges the others'
into the first that sent any, so each worker's events carry its rank (`RankEvents`) and the
scheduler side counts the ranks itself. Only models with one KV cache group are reported (vLLM's
block hashes are those of that group).
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent, KVConnectorKVEvents

from lmcache.cache_engine import LMCacheEngine
from lmcache.cache_key import CacheEngineKey
from lmcache.kv_events import BlockHash, ChunkBlocks, to_kv_events, vllm_types
from lmcache.storage_backend.events import MAX_EVENTS, EventBuffer

MAX_CHUNKS = 16384  # chunk keys whose blocks a worker remembers (about 1 KB each at 256 tokens)


def events_enabled(vllm_config: Any) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


@dataclass
class PlanBlocks:
    """A request's vLLM blocks over a plan's tokens (``token_ids[: len(block_hashes) * block_size]``):
    their hashes as vLLM publishes them, one extra-keys entry per block (or None)."""

    block_hashes: list[BlockHash]
    block_size: int
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


def plan_blocks(request: Any, num_tokens: int, block_size: int) -> PlanBlocks:
    """The blocks of `request` (a vLLM `Request`) that lie within its first `num_tokens` tokens."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
        to_event_extra_keys,
    )

    hashes = request.block_hashes[: num_tokens // block_size]
    extra: list[tuple[Any, ...] | None] = []
    mm = 0
    for i in range(len(hashes)):
        keys, mm = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm)
        extra.append(keys)
    lora = request.lora_request
    return PlanBlocks([maybe_convert_block_hash(h) for h in hashes], block_size,
                      lora.name if lora is not None else None, lora.adapter_id if lora is not None else None,
                      to_event_extra_keys(extra))


class BlockIndex:
    """Chunk key -> the blocks it covers (`ChunkBlocks`), for at most `max_chunks` keys."""

    def __init__(self, max_chunks: int = MAX_CHUNKS) -> None:
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[CacheEngineKey, ChunkBlocks] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, key: CacheEngineKey) -> ChunkBlocks | None:
        return self._chunks.get(key)

    def record(self, spans: Iterable[tuple[int, int, CacheEngineKey]], token_ids: Sequence[int],
               blocks: PlanBlocks) -> None:
        """Remember the blocks each chunk ``(start, end, key)`` of `spans` covers."""
        bs, hashes = blocks.block_size, blocks.block_hashes
        for start, end, key in spans:
            first, last = start // bs, min(end // bs, len(hashes))
            last = max(first, last)  # a chunk inside one block covers none: it is never reported
            extra = blocks.extra_keys[first:last] if blocks.extra_keys else None
            self._chunks[key] = ChunkBlocks(
                hashes[first:last], hashes[first - 1] if first > 0 else None,
                array("q", token_ids[first * bs : last * bs]),  # type: ignore[arg-type]
                bs, blocks.lora_name, blocks.lora_id,
                extra if extra and any(e is not None for e in extra) else None)
            self._chunks.move_to_end(key)
            if len(self._chunks) > self.max_chunks:
                self._chunks.popitem(last=False)


class RankEvents(list[KVCacheEvent]):
    """A worker's events and its rank: vLLM hands one worker's `get_all_events()` to another's
    `add_events`, and the rank travels with the list."""

    def __init__(self, rank: int, events: Iterable[KVCacheEvent] = ()) -> None:
        super().__init__(events)
        self.rank = rank


class LMCacheKVEvents(KVConnectorKVEvents):
    """One step's events of each worker that sent any (vLLM merges them into the first one's)."""

    def __init__(self, events: Iterable[KVCacheEvent] = (), rank: int = 0) -> None:
        self.by_worker: list[RankEvents] = [RankEvents(rank, events)]

    def add_events(self, events: list[KVCacheEvent]) -> None:
        """Another worker's events (vLLM then calls `increment_workers`, counted here already); a
        plain list is taken as the next rank's."""
        rank = events.rank if isinstance(events, RankEvents) else len(self.by_worker)
        self.by_worker.append(RankEvents(rank, events))

    def increment_workers(self, count: int = 1) -> None:
        return

    def get_number_of_workers(self) -> int:
        return len(self.by_worker)

    def get_all_events(self) -> list[KVCacheEvent]:
        if len(self.by_worker) == 1:
            return self.by_worker[0]
        return [e for events in self.by_worker for e in events]

    def clear_events(self) -> None:
        self.by_worker = [RankEvents(self.by_worker[0].rank)]

    def aggregate(self) -> LMCacheKVEvents:
        """The ranks' events are matched across steps by the scheduler side (`SchedulerEvents`)."""
        return self


class SchedulerEvents:
    """The scheduler side: the workers' events of each step, until vLLM takes them (bounded: the
    oldest are dropped and counted when vLLM does not take them). A store is passed on once each
    of `num_workers` ranks has reported it (as many times as the rank that reported it least); the
    stores waiting for other ranks are bounded by `max_events` too (the oldest let go). A removal is
    passed on when any rank reports it (as often, in a step, as the rank that reported it most), and
    ends the waiting store of that rank's copy."""

    def __init__(self, num_workers: int = 1, max_events: int = MAX_EVENTS) -> None:
        """`num_workers`: the workers (ranks) whose events vLLM merges each step."""
        self.num_workers = num_workers
        self.max_waiting = max_events
        self._events: EventBuffer[KVCacheEvent] = EventBuffer("connector KV", max_events)
        # per block (hashes, medium): the store to pass on, and how many each rank reported
        self._waiting: OrderedDict[tuple[Any, ...], tuple[KVCacheEvent, list[int]]] = OrderedDict()

    @property
    def num_dropped(self) -> int:
        return self._events.num_dropped

    def add(self, step: Any) -> None:
        if not isinstance(step, LMCacheKVEvents):
            return
        removals = Counter[KVCacheEvent]()
        for events in step.by_worker:
            for removal, n in Counter(e for e in events if isinstance(e, BlockRemoved)).items():
                removals[removal] = max(removals[removal], n)
        for events in step.by_worker:
            for event in events:
                if isinstance(event, BlockRemoved):
                    self._forget(events.rank, event)
                    if removals[event] > 0:
                        removals[event] -= 1
                        self._events.append(event)
                elif isinstance(event, AllBlocksCleared):
                    self._waiting.clear()
                    self._events.append(event)
                else:
                    self._stored(events.rank, event)

    def take(self) -> list[KVCacheEvent]:
        return self._events.take()

    def _stored(self, rank: int, event: KVCacheEvent) -> None:
        if self.num_workers == 1:
            self._events.append(event)
            return
        key = _block(event)
        _, counts = self._waiting.setdefault(key, (event, [0] * self.num_workers))
        if 0 <= rank < self.num_workers:
            counts[rank] += 1
        if all(counts):
            for r in range(self.num_workers):
                counts[r] -= 1
            self._events.append(event)
        if not any(counts):
            del self._waiting[key]
        elif len(self._waiting) > self.max_waiting:
            self._waiting.popitem(last=False)

    def _forget(self, rank: int, removal: BlockRemoved) -> None:
        waiting = self._waiting.get(_block(removal))
        if waiting is not None and 0 <= rank < self.num_workers:
            waiting[1][rank] = 0
            if not any(waiting[1]):
                del self._waiting[_block(removal)]


def _block(event: Any) -> tuple[Any, ...]:
    """What a store and the removal of its blocks have in common."""
    return tuple(event.block_hashes), event.medium


class WorkerEvents:
    """The worker side: block info recorded from the plans, the tiers' events turned into vLLM's."""

    def __init__(self, engine: LMCacheEngine, max_chunks: int = MAX_CHUNKS) -> None:
        self.engine = engine
        self.index = BlockIndex(max_chunks)
        self._types = vllm_types()
        engine.storage_manager.publish_events()

    def record(self, token_ids: Sequence[int], extra_key: str | None, blocks: PlanBlocks,
               from_token: int) -> None:
        """Remember the blocks of the chunks of `token_ids` (the keys the engine stores them
        under) that end after `from_token` (a chunk that ends no block too: it is then known to
        have none to report, not unknown)."""
        tokens = torch.tensor(token_ids, dtype=torch.int64)
        spans = self.engine.token_database.process_tokens(tokens, extra_key=extra_key)
        self.index.record([s for s in spans if s[1] > from_token], token_ids, blocks)

    def take(self) -> LMCacheKVEvents | None:
        translated = to_kv_events(self.engine.storage_manager.take_published(), self.index.get, self._types)
        if translated.unknown:
            self.engine.stats.add("kv_events_unknown_chunks", translated.unknown)
        if not translated.events:
            return None
        return LMCacheKVEvents(translated.events, self.engine.metadata.worker_id)
