"""A cache server every instance shares, as the router sees it: its events (chunk digests, with or
without token ids) in a `SharedIndex`, a prompt matched by the digests the engines compute, and
kv-aware routing that counts the shared prefix on every instance."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.cache_key import CacheEngineKey
from lmcache.cache_server.kv_events import ChunkTexts, chunk_block
from lmcache.chunk_hash import ChunkText, chunk_digests, extra_key_of
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, to_kv_events
from lmcache.router import shared as shared_module
from lmcache.router.events import decode_batch
from lmcache.router.index import Match, RequestKeys
from lmcache.router.policies import REQUEST_COST, Instance, KVAware, Routed
from lmcache.router.shared import SharedIndex
from lmcache.router.watch import KVWatch
from lmcache.storage_backend.events import EventKind, PublishedEvent, TierEvent
from lmcache.token_database import ChunkedTokenDatabase

CHUNK = 16
DOC = list(range(3000, 3000 + 6 * CHUNK))


def database(chunk: int = CHUNK) -> ChunkedTokenDatabase:
    config = LMCacheEngineConfig.from_defaults(chunk_size=chunk)
    metadata = LMCacheEngineMetadata("m", 1, 0, "vllm", torch.float32, (2, 2, chunk, 1, 4))
    return ChunkedTokenDatabase(config, metadata)


def server_events(kind: EventKind, keys: list[CacheEngineKey], medium: str = "CPU", chunk: int = CHUNK,
                  texts: dict[CacheEngineKey, ChunkText] | None = None) -> list:
    """What a cache server publishes for `keys` (its own translation; `texts`: the chunks' texts it
    knows), through the wire and back as the router decodes it."""
    published = [PublishedEvent(medium, TierEvent(kind, "Hot", tuple(keys)))]
    events = to_kv_events(published, lambda k: chunk_block(k, chunk, (texts or {}).get(k))).events
    payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events))
    return decode_batch(payload, token_ids=False)


def keys_of(tokens: list[int], salt: str | None = None, chunk: int = CHUNK) -> list[CacheEngineKey]:
    spans = database(chunk).process_tokens(torch.tensor(tokens), extra_key=extra_key_of(salt))
    return [s.key for s in spans]


def texts_of(tokens: list[int], salt: str | None = None) -> dict[CacheEngineKey, ChunkText]:
    """The texts an engine commits with the chunks of `tokens`."""
    keys = keys_of(tokens, salt)
    parents = [None, *(k.chunk_hash for k in keys)]
    return {k: ChunkText(parents[i], tokens[i * CHUNK : (i + 1) * CHUNK]) for i, k in enumerate(keys)}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=70), st.sampled_from([None, "a", "b|c"]),
       st.sampled_from([1, 7, 16]))
def test_the_routers_chunk_digests_are_the_engines_chunk_hashes(tokens, salt, chunk):
    engine = database(chunk).chunk_hashes(torch.tensor(tokens, dtype=torch.int64), extra_key=salt)
    assert [d.hex() for d in chunk_digests(tokens, chunk, salt)] == engine
    assert chunk_digests(tokens, chunk, salt, whole_only=True) == \
        [bytes.fromhex(h) for h in engine[: len(tokens) // chunk]]


def test_a_requests_salt_seeds_the_chain_as_the_vllm_connector_seeds_it():
    pytest.importorskip("vllm")
    from lmcache.integration.vllm.utils import extra_key

    request = SimpleNamespace(cache_salt="tenant-a", lora_request=None)
    assert extra_key(request) == extra_key_of("tenant-a")
    assert extra_key(SimpleNamespace(cache_salt=None, lora_request=SimpleNamespace(lora_int_id=3))) == \
        extra_key_of(None, 3)


def test_a_server_batch_decodes_only_as_a_server_stream():
    events = server_events(EventKind.STORED, keys_of(DOC)[:1])
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events))
    with pytest.raises(ValueError, match="token_ids"):
        decode_batch(payload)  # an instance's stream must name its tokens
    (stored,) = decode_batch(payload, token_ids=False)
    assert stored.block_hashes == [bytes.fromhex(keys_of(DOC)[0].chunk_hash)]
    bad = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [7], "token_ids": [],
                                         "parent_block_hash": None, "block_size": 16, "lora_id": None,
                                         "medium": "CPU", "lora_name": None}], None])
    with pytest.raises(ValueError, match="digests"):
        decode_batch(bad, token_ids=False)


def test_a_servers_chunks_with_their_texts_chain_as_an_instances_blocks_and_a_partial_one_is_none():
    tokens = DOC[: 2 * CHUNK + 5]
    keys = keys_of(tokens)
    events = server_events(EventKind.STORED, keys, texts=texts_of(tokens))
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events))
    first, second = decode_batch(payload)  # as an instance's stream: token ids of every block
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == \
        ([bytes.fromhex(keys[0].chunk_hash)], None, DOC[:CHUNK])
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == \
        ([bytes.fromhex(keys[1].chunk_hash)], first.block_hashes[0], DOC[CHUNK : 2 * CHUNK])
    assert second.block_size == CHUNK and second.extra_keys == [("m", "kv_blob", 1, 0, "float32")]
    assert server_events(EventKind.REMOVED, keys[2:], texts=texts_of(tokens)) == []  # the partial chunk
    shared = SharedIndex(tier_weights={"CPU": 0.8})
    shared.apply(events)
    assert shared.match(DOC).tokens == 2 * CHUNK


def test_the_server_keeps_the_texts_of_its_last_chunks_and_publishes_an_older_one_by_its_digest():
    keys, texts = keys_of(DOC)[:3], ChunkTexts(max_chunks=2)
    texts.add(keys, [texts_of(DOC)[k] for k in keys])
    assert [texts.get(k) is not None for k in keys] == [False, True, True]
    known = {k: text for k in keys if (text := texts.get(k)) is not None}
    first, second = server_events(EventKind.STORED, keys[:2], texts=known)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == \
        ([bytes.fromhex(keys[0].chunk_hash)], None, [])
    assert second.token_ids == DOC[CHUNK : 2 * CHUNK]


def test_the_shared_prefix_is_the_whole_chunks_the_server_holds_of_a_prompt():
    shared = SharedIndex(tier_weights={"CPU": 0.8, "STORAGE": 0.5})
    shared.apply(server_events(EventKind.STORED, keys_of(DOC)))
    assert shared.match(DOC).tokens == len(DOC)
    assert shared.match(DOC).weighted == pytest.approx(0.8 * len(DOC))
    assert shared.match(DOC[:40]).tokens == 32  # the partial chunk is other tokens
    assert shared.match(DOC + [1] * 30).tokens == len(DOC)
    assert shared.match([0, *DOC[1:]]).tokens == 0
    assert shared.match(DOC, extra_key_of("another tenant")).tokens == 0

    salted = list(range(100, 100 + 3 * CHUNK))
    shared.apply(server_events(EventKind.STORED, keys_of(salted, "t1"), medium="STORAGE"))
    assert shared.match(salted, extra_key_of("t1")).by_tier == {"shared STORAGE": 3 * CHUNK}
    assert shared.match(salted).tokens == 0

    shared.apply(server_events(EventKind.REMOVED, keys_of(DOC)[2:3]))
    assert shared.match(DOC).tokens == 2 * CHUNK  # the prefix ends where a chunk was evicted
    shared.apply([AllBlocksCleared()])
    assert shared.match(salted, extra_key_of("t1")).tokens == 0 and len(shared) == 0


def test_a_digest_stays_held_until_every_store_of_it_is_removed_and_the_best_tier_counts():
    shared = SharedIndex(tier_weights={"CPU": 0.8, "STORAGE": 0.5})
    first = keys_of(DOC)[:1]
    shared.apply(server_events(EventKind.STORED, first) * 2)  # two ranks (the same digest)
    shared.apply(server_events(EventKind.STORED, first, medium="STORAGE"))
    shared.apply(server_events(EventKind.REMOVED, first))
    assert shared.match(DOC).by_tier == {"shared CPU": CHUNK}
    shared.apply(server_events(EventKind.REMOVED, first))
    assert shared.match(DOC).by_tier == {"shared STORAGE": CHUNK}


def test_the_index_is_bounded_oldest_stored_first():
    shared = SharedIndex(max_blocks=4)
    shared.apply(server_events(EventKind.STORED, keys_of(DOC)))
    assert len(shared) == 4 and shared.evicted == 2
    assert shared.match(DOC).tokens == 0  # its first chunks went first
    with pytest.raises(ValueError):
        SharedIndex(max_blocks=0)


def test_every_chunk_size_the_server_published_is_walked():
    shared = SharedIndex()
    other = list(range(7000, 7000 + 4 * 32))
    shared.apply(server_events(EventKind.STORED, keys_of(DOC)))
    shared.apply(server_events(EventKind.STORED, keys_of(other, chunk=32), chunk=32))
    assert (shared.match(DOC).tokens, shared.match(DOC).block_size) == (len(DOC), CHUNK)
    assert (shared.match(other).tokens, shared.match(other).block_size) == (len(other), 32)


def test_a_prompt_is_walked_only_at_the_chunk_sizes_of_the_chunks_held(monkeypatch):
    """Chunk sizes come and go with the chunks of that size: a stream of stores of no chunks, or of
    chunks evicted or cleared since, costs a match nothing (100k such sizes took 4.7 s a match)."""
    walked: list[int] = []

    def walking(tokens, size, *args, **kwargs):
        walked.append(size)
        return chunk_digests(tokens, size, *args, **kwargs)

    monkeypatch.setattr(shared_module, "chunk_digests", walking)
    shared = SharedIndex(max_blocks=2)
    shared.apply([BlockStored([], None, [], size, None, "CPU", None) for size in range(1, 1000)])
    shared.apply(server_events(EventKind.STORED, keys_of(DOC)))  # 6 chunks: the first 4 evicted
    shared.apply([BlockStored([bytes([i]) * 16], None, [], 5 + i, None, "CPU", None) for i in range(3)])
    assert shared.match(DOC).tokens == 0 and sorted(walked) == [6, 7]
    shared.apply([AllBlocksCleared()])
    walked.clear()
    assert shared.match(DOC).tokens == 0 and walked == []


def test_an_instances_own_prefix_goes_on_with_what_the_shared_server_holds_beyond_it():
    own = Match(32, 32.0, {"GPU": 32}, 16)
    assert own.then(Match(16, 12.8, {"shared CPU": 16}, 16)) is own
    both = own.then(Match(96, 76.8, {"shared CPU": 96}, 32))
    assert (both.tokens, both.weighted, both.by_tier, both.block_size) == \
        (96, pytest.approx(32 + 64 * 0.8), {"GPU": 32, "shared": 64}, 32)


def test_a_shared_prefix_covering_the_whole_prompt_is_served_up_to_its_last_token_but_one():
    """The shared chunks beyond an instance's own prefix are loaded by LMCache's connector, which
    serves ``min(cached, prompt - 1)`` tokens: a prompt wholly on the server is served but its last
    token, never less than the instance's own prefix (which vLLM cuts to whole blocks)."""
    own = Match(496, 496.0, {"GPU": 496}, 16)
    assert own.servable(512) == 496
    assert own.then(Match(512, 486.4, {"shared CPU": 512}, 256)).servable(512) == 511
    assert own.then(Match(480, 456.0, {"shared CPU": 480}, 16)).servable(512) == 496  # not beyond: own
    assert Match().then(Match(256, 243.2, {"shared CPU": 256}, 256)).servable(300) == 256
    whole = Match(512, 512.0, {"GPU": 512}, 16)
    assert whole.servable(512) == 496 and whole.then(Match(512, 486.4, {}, 256)).servable(512) == 496


def test_kv_aware_counts_the_shared_prefix_on_every_instance_and_sends_to_the_less_loaded():
    watch = KVWatch((), (), None)
    tokens = DOC + list(range(50, 60))
    watch.index.apply("http://a", [])
    policy = KVAware(watch, request_cost=64)
    a, b = Instance("http://a"), Instance("http://b")
    with a.serving(60):  # a is a little busy; nothing is cached anywhere: b
        assert policy.rank(Routed(tokens=tokens), [a, b])[0] is b
    watch.shared.apply(server_events(EventKind.STORED, keys_of(DOC)))
    for inst in (a, b):
        assert watch.match(inst.url, tokens).tokens == len(DOC)
    assert watch.match("http://a", tokens, RequestKeys("other")).tokens == 0
    with b.serving(60):  # both can load the document from the server: the less busy one
        assert policy.rank(Routed(tokens=tokens), [a, b])[0] is a


CACHED = DOC * 8  # 768 tokens
PROMPT = CACHED + list(range(50, 60))


def prefix_on_a_and_the_server(tier_weights: dict[str, float] | None = None) -> KVWatch:
    """A watch where instance a holds PROMPT's first 768 tokens in vLLM's own cache and the cache
    server every instance shares holds them too."""
    watch = KVWatch((), (), None, tier_weights=tier_weights)
    watch.index.apply("http://a", [
        BlockStored([1000 + i], None if i == 0 else 999 + i, CACHED[i * CHUNK:(i + 1) * CHUNK], CHUNK,
                    None, None, None) for i in range(len(CACHED) // CHUNK)])
    watch.shared.apply(server_events(EventKind.STORED, keys_of(CACHED)))
    assert watch.match("http://a", PROMPT).by_tier == {"GPU": len(CACHED)}
    assert watch.match("http://b", PROMPT).by_tier == {"shared": len(CACHED)}
    return watch


def test_kv_aware_starts_a_prompt_on_an_idle_instance_that_can_load_it_from_the_server_rather_than_queue_it():
    """Instance a holds the prompt's prefix in vLLM's own cache, but another prompt is being
    prefilled there; the cache server every instance shares holds the prefix too. With the default
    tier weights the prompt goes to idle b, which loads the prefix instead of waiting (with the
    earlier default, "CPU" 0.8, it queued on a)."""
    def policy(tier_weights: dict[str, float] | None) -> KVAware:
        return KVAware(prefix_on_a_and_the_server(tier_weights), request_cost=64)

    a, b = Instance("http://a"), Instance("http://b")
    default = policy(None)
    assert default.rank(Routed(tokens=PROMPT), [a, b])[0] is a  # a is idle: its own cache wins
    with a.serving(60):  # the prompt of another user's next round is being prefilled on a
        assert default.rank(Routed(tokens=PROMPT), [a, b])[0] is b
        assert policy({"GPU": 1.0, "CPU": 0.8}).rank(Routed(tokens=PROMPT), [a, b])[0] is a


def test_a_request_past_its_prompt_weighs_little_against_a_prompt_still_being_computed():
    """Instance a holds the prompt's prefix and is computing another user's prompt; b, which can load
    the prefix from the shared server, is only decoding two answers (their prompts computed). A
    prompt joining b's steps waits for decodes, one joining a's for a prefill: with the default
    `REQUEST_COST` it goes to b; at 64 tokens a request (the earlier default) it queued on a."""
    watch = prefix_on_a_and_the_server()
    a, b = Instance("http://a"), Instance("http://b")
    with a.serving(60), b.serving(100) as first, b.serving(100) as second:
        first()
        second()  # both answers are being decoded
        assert (a.backlog, b.backlog, b.in_flight) == (60, 0, 2)
        assert KVAware(watch, REQUEST_COST).rank(Routed(tokens=PROMPT), [a, b])[0] is b
        assert KVAware(watch, 64).rank(Routed(tokens=PROMPT), [a, b])[0] is a
