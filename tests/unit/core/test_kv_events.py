"""KV events in vLLM's format (`lmcache.kv_events`, `integration.vllm.kv_events`): the translation
of tier events, what vLLM's decoder reads, the bounds (event buffers, the chunk index, a subscriber
that falls behind), and events off by default."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq

from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.kv_events import ChunkBlocks, KVEventPublisher, to_kv_events
from lmcache.memory_management import MixedMemoryAllocator
from lmcache.storage_backend.events import EventKind, PublishedEvent, RemovalReason, TierEvent
from lmcache.storage_backend.storage_manager import StorageManager

vllm_events = pytest.importorskip("vllm.distributed.kv_events")


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("kv_blob", "m", 1, 0, f"{i:032x}", "float32")


def blocks(i: int) -> ChunkBlocks:
    return ChunkBlocks([bytes([i, 1]), bytes([i, 2])], bytes([i - 1, 2]) if i else None,
                       list(range(4 * i, 4 * i + 4)), 2, lora_name="ad", lora_id=3)


def test_stored_removed_and_cleared_chunks_become_block_events_with_their_tiers_medium():
    known = {key(i): blocks(i) for i in range(3)}
    published = [PublishedEvent("CPU", TierEvent(EventKind.STORED, "Hot", (key(0), key(1), key(9)))),
                 PublishedEvent("STORAGE", TierEvent(EventKind.REMOVED, "LocalDiskBackend", (key(2), key(9)),
                                                     RemovalReason.EVICTED)),
                 PublishedEvent("CPU", TierEvent(EventKind.CLEARED, "Hot", (key(0), key(1))))]
    out = to_kv_events(published, known.get)
    assert out.unknown == 2  # key(9): never recorded
    stored0, stored1, removed, cleared = out.events
    assert (stored0.block_hashes, stored0.parent_block_hash, stored0.token_ids, stored0.medium) == \
        ([b"\0\1", b"\0\2"], None, [0, 1, 2, 3], "CPU")
    assert (stored1.parent_block_hash, stored1.lora_name, stored1.lora_id) == (b"\0\2", "ad", 3)
    assert type(removed).__name__ == "BlockRemoved"
    assert (removed.block_hashes, removed.medium) == ([b"\2\1", b"\2\2"], "STORAGE")
    assert cleared.block_hashes == [b"\0\1", b"\0\2", b"\1\1", b"\1\2"] and cleared.medium == "CPU"
    # LMCache's own structs are vLLM's wire format
    batch = vllm_events.KVEventBatch
    from lmcache.kv_events import KVEventBatch

    decoded = msgspec.msgpack.Decoder(type=batch).decode(msgspec.msgpack.encode(KVEventBatch(ts=1.0,
                                                                                            events=out.events)))
    assert [type(e) for e in decoded.events] == [vllm_events.BlockStored] * 2 + [vllm_events.BlockRemoved] * 2
    assert decoded.events[0].block_hashes == [b"\0\1", b"\0\2"] and decoded.events[3].medium == "CPU"


def test_a_chunk_covers_the_blocks_that_end_inside_it_and_the_index_is_bounded():
    from lmcache.integration.vllm.kv_events import BlockIndex, PlanBlocks

    plan = PlanBlocks([bytes([i]) for i in range(5)], block_size=100, extra_keys=[None] * 4 + [("salt",)])
    tokens = list(range(560))
    index = BlockIndex(max_chunks=2)
    index.record([(0, 256, key(0)), (256, 512, key(1)), (512, 560, key(2))], tokens, plan)
    assert len(index) == 2 and index.get(key(0)) is None  # the least recently recorded went first
    one, two = index.get(key(1)), index.get(key(2))
    assert one is not None and two is not None
    # blocks ending in (256, 512]: [200, 300), [300, 400), [400, 500)
    assert (one.block_hashes, one.parent_block_hash, list(one.token_ids)) == \
        ([b"\2", b"\3", b"\4"], b"\1", list(range(200, 500)))
    assert one.extra_keys == [None, None, ("salt",)]
    assert two.block_hashes == []  # [512, 560) ends no block: never reported, never "unknown"
    assert to_kv_events([PublishedEvent("CPU", TierEvent(EventKind.STORED, "Hot", (key(2),)))],
                        index.get).unknown == 0


def test_a_saved_tail_that_ends_no_block_is_neither_reported_nor_counted_unknown(engine):
    """A request's last save may be a tail that ends no block (vLLM hashes whole blocks only): its
    chunk is left out of the events, and is not one whose blocks the worker does not know."""
    from lmcache.integration.vllm.kv_events import PlanBlocks, WorkerEvents

    events = WorkerEvents(engine)  # chunks of 8 tokens (`build_engine`); blocks of 4 here
    tokens = list(range(18))
    events.record(tokens, None, PlanBlocks([bytes([i]) for i in range(4)], block_size=4), from_token=16)
    spans = {start: k for start, _, k in engine.token_database.process_tokens(torch.tensor(tokens))}
    out = to_kv_events([PublishedEvent("CPU", TierEvent(EventKind.STORED, "Hot", (spans[16],)))],
                       events.index.get)
    assert (out.events, out.unknown) == ([], 0)


def _stored(i: int, medium: str = "CPU"):
    return vllm_events.BlockStored(block_hashes=[bytes([i])], parent_block_hash=None, token_ids=[i, i],
                                   block_size=2, lora_id=None, medium=medium, lora_name=None)


def _step(*by_rank):
    """One step's events as vLLM merges them: the first rank that sent any, then the others'
    `get_all_events()` added (`by_rank`: (rank, events) pairs, a rank that sent none left out)."""
    from lmcache.integration.vllm.kv_events import LMCacheKVEvents

    (rank, events), *others = by_rank
    step = LMCacheKVEvents(events, rank=rank)
    for rank, events in others:
        step.add_events(LMCacheKVEvents(events, rank=rank).get_all_events())
        step.increment_workers(1)
    return step


def test_stored_events_count_once_every_rank_reported_them_in_order():
    from lmcache.integration.vllm.kv_events import SchedulerEvents

    a, b, c = (_stored(i) for i in range(3))
    step = _step((0, [a, b, a]), (1, [a, b]))
    assert step.get_number_of_workers() == 2
    two = SchedulerEvents(num_workers=2)
    two.add(step)
    assert two.take() == [a, b]  # the second `a` only rank 0 reported
    one = SchedulerEvents()
    one.add(_step((0, [a, c, a])))
    assert one.take() == [a, c, a]  # one rank: all, in order

    pending = SchedulerEvents(max_events=2)  # one worker
    pending.add(_step((0, [a, b, c])))
    pending.add(None)
    assert pending.take() == [b, c] and pending.num_dropped == 1 and pending.take() == []


def test_a_block_is_published_stored_once_every_rank_stored_it_and_removed_once_any_rank_removed_it():
    """Two ranks: a chunk one rank stored is not held by every rank until the other stores it too,
    in that step or a later one (their lower tiers write at their own pace); a chunk one rank
    dropped is no longer held by every rank (published, whatever the other reported)."""
    from lmcache.integration.vllm.kv_events import SchedulerEvents

    stored, late = _stored(1), _stored(4, medium="STORAGE")
    gone, other = (vllm_events.BlockRemoved(block_hashes=[bytes([i])], medium="CPU") for i in (2, 3))
    pending = SchedulerEvents(num_workers=2)
    pending.add(_step((0, [stored, gone, late])))  # rank 1 sent none this step
    assert pending.take() == [gone]
    pending.add(_step((0, [gone]), (1, [other, gone])))
    assert pending.take() == [gone, other]
    pending.add(_step((1, [late])))  # rank 1's disk write finished a step later
    assert pending.take() == [late]
    pending.add(_step((1, [stored])))
    assert pending.take() == [stored]


def test_a_store_is_matched_by_rank_not_by_the_order_vllm_merged_the_ranks_in():
    """vLLM merges a step's events into the first rank's that sent any: rank 1 storing a chunk
    twice (stored, stored again) while rank 0 never did is not every rank's; a rank that removed its
    copy before the other stored must store it again."""
    from lmcache.integration.vllm.kv_events import SchedulerEvents

    a, b = _stored(1), _stored(2)
    gone_a = vllm_events.BlockRemoved(block_hashes=a.block_hashes, medium="CPU")
    pending = SchedulerEvents(num_workers=2)
    pending.add(_step((1, [a])))
    pending.add(_step((1, [a, b])))
    assert pending.take() == []
    pending.add(_step((0, [b, gone_a])))
    assert pending.take() == [b, gone_a]
    pending.add(_step((0, [a])))  # rank 1 dropped nothing, but rank 0's copy came and went
    assert pending.take() == [a]
    pending.add(_step((1, [gone_a])))
    pending.add(_step((0, [a])))
    assert pending.take() == [gone_a]  # rank 1's copy is gone: rank 0's alone is not published


def test_stores_waiting_for_other_ranks_are_bounded():
    from lmcache.integration.vllm.kv_events import SchedulerEvents

    pending = SchedulerEvents(num_workers=2, max_events=2)
    pending.add(_step((0, [_stored(i) for i in range(5)])))  # rank 1 never stores them
    pending.add(_step((1, [_stored(i) for i in (3, 4, 0)])))
    assert pending.take() == [_stored(3), _stored(4)]  # the oldest waiting ones were let go


def test_kv_events_are_off_unless_vllms_are_on():
    from lmcache.integration.vllm.kv_events import events_enabled

    off = SimpleNamespace(enable_kv_cache_events=False)
    assert not events_enabled(SimpleNamespace(kv_events_config=None))
    assert not events_enabled(SimpleNamespace(kv_events_config=off))
    assert events_enabled(SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True)))


def _manager() -> StorageManager:
    meta = LMCacheEngineMetadata("m", 1, 0, "test", torch.float32, (1, 2, 4, 1, 2))
    return StorageManager(LMCacheEngineConfig(chunk_size=4, max_local_cpu_size=0.001), meta,
                          MixedMemoryAllocator(1 << 20))


def test_a_storage_manager_keeps_no_events_for_subscribers_until_asked_and_then_a_bounded_number():
    sm = _manager()
    try:
        def store(i: int) -> None:
            obj = sm.allocate(torch.Size([2, 1, 4, 2]), torch.float32)
            assert obj is not None
            sm.put(key(i), obj)
            obj.ref_count_down()

        store(0)
        assert sm.take_published() == []  # off by default
        sm.publish_events(max_events=3)
        for i in range(1, 6):
            store(i)
        sm.clear("hot")
        got = sm.take_published()
        assert [(p.medium, p.event.kind, p.event.keys) for p in got] == [
            ("CPU", EventKind.STORED, (key(4),)), ("CPU", EventKind.STORED, (key(5),)),
            ("CPU", EventKind.CLEARED, tuple(key(i) for i in range(6)))]
        assert sm.published is not None and sm.published.num_dropped == 3
    finally:
        sm.close()


def test_a_publisher_never_blocks_on_a_subscriber_that_falls_behind_and_what_arrives_decodes():
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 10)
    sub.bind("tcp://127.0.0.1:0")
    pub = KVEventPublisher(sub.getsockopt_string(zmq.LAST_ENDPOINT), topic="kv", hwm=10)
    try:
        event = ChunkBlocks([b"h" * 16], None, list(range(20_000)), 20_000)
        events = to_kv_events([PublishedEvent("CPU", TierEvent(EventKind.STORED, "Hot", (key(0),)))],
                              lambda k: event).events
        for _ in range(100):  # until the subscription reached the publisher (the SUB sends it as it polls)
            pub.publish(events)
            if sub.poll(50):
                break
        while sub.poll(200):
            sub.recv_multipart()
        start = time.monotonic()
        for _ in range(2000):  # ~100 KB each: 200 MB if it were all kept
            pub.publish(events)
        assert time.monotonic() - start < 10
        decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
        seqs = []
        while sub.poll(500):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and decoder.decode(payload).events[0].token_ids[-1] == 19_999
            seqs.append(int.from_bytes(seq, "big"))
        assert 0 < len(seqs) < 1000 and seqs == sorted(seqs)  # the rest was dropped for it
    finally:
        pub.close()
        sub.close(0)
        ctx.term()
