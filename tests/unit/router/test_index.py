"""`KVIndex` over decoded KV events: the router's own chained hash matches a prompt however its
blocks were reported and only under the keys (cache salt, LoRA adapter) vLLM hashed them with,
removal and clear forget blocks, tiers are weighted, memory is bounded."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from lmcache.router.index import KVIndex, RequestKeys

B = 4  # block size


def stored(hashes: list[int], parent: int | None, tokens: list[int],
           medium: str | None = None) -> BlockStored:
    return BlockStored(hashes, parent, tokens, B, None, medium, None)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=B, max_size=12 * B), st.data(), st.integers(0, 2**40))
def test_a_prompt_matches_its_blocks_however_the_events_split_them(tokens, data, seed):
    blocks = len(tokens) // B
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, blocks - 1)), max_size=blocks)) - {blocks})
    index = KVIndex()
    start = 0
    for end in [*cuts, blocks]:
        if end <= start:
            continue
        hashes = [seed + i for i in range(start, end)]  # vLLM's hashes: any values, here seeded
        parent = None if start == 0 else seed + start - 1
        index.apply("a", [stored(hashes, parent, tokens[start * B:end * B])])
        start = end
    match = index.match("a", [*tokens, 7])
    assert match.tokens == blocks * B and match.by_tier == {"GPU": blocks * B}
    assert index.match("a", [t + 1 for t in tokens[:B]] + tokens[B:]).tokens == 0  # first block differs
    assert index.match("b", tokens).tokens == 0


def test_removal_cuts_the_prefix_and_clear_empties_the_instance():
    tokens = list(range(4 * B))
    index = KVIndex()
    index.apply("a", [stored([10, 11, 12, 13], None, tokens)])
    index.apply("a", [BlockRemoved([12], None)])
    assert index.match("a", tokens).tokens == 2 * B
    index.apply("a", [BlockRemoved([12, 999], "CPU")])  # unknown: ignored
    assert index.blocks("a") == 3
    index.apply("a", [AllBlocksCleared()])
    assert index.match("a", tokens).tokens == 0 and index.blocks("a") == 0


def test_vllms_prefix_cache_reset_keeps_what_lmcaches_tiers_hold():
    """``AllBlocksCleared`` comes from vLLM's own block pool (LMCache never sends it): the
    instance's LMCache tiers still hold their chunks, and a later block chains onto them."""
    tokens = list(range(4 * B))
    index = KVIndex()
    index.apply("a", [stored([1, 2], None, tokens[:2 * B], "CPU"),
                      stored([3], 2, tokens[2 * B:3 * B], "STORAGE"),
                      stored([11, 12, 13, 14], None, tokens, "GPU")])
    assert index.match("a", tokens).by_tier == {"GPU": 4 * B}
    index.apply("a", [AllBlocksCleared()])
    match = index.match("a", tokens)
    assert (match.tokens, match.by_tier) == (3 * B, {"CPU": 2 * B, "STORAGE": B})
    assert index.blocks("a") == 3
    index.apply("a", [stored([4], 3, tokens[3 * B:], "STORAGE")])
    assert index.match("a", tokens).by_tier == {"CPU": 2 * B, "STORAGE": 2 * B}


def test_a_block_in_several_tiers_weighs_as_its_best_and_its_parent_may_be_in_another_tier():
    tokens = list(range(3 * B))
    index = KVIndex(tier_weights={"GPU": 1.0, "CPU": 0.5})
    index.apply("a", [stored([1, 2], None, tokens[:2 * B], "CPU"), stored([3], 2, tokens[2 * B:], None)])
    index.apply("a", [stored([1], None, tokens[:B], None)])
    match = index.match("a", tokens)
    assert match.tokens == 3 * B and match.by_tier == {"GPU": 2 * B, "CPU": B}
    assert match.weighted == 2 * B + 0.5 * B
    index.apply("a", [BlockRemoved([2], "CPU")])
    assert index.match("a", tokens).tokens == B


def test_an_unknown_parent_is_an_orphan_and_the_oldest_blocks_go_beyond_the_cap():
    index = KVIndex(max_blocks=3)
    index.apply("a", [stored([5], 404, list(range(B)))])
    assert index.orphans == 1 and index.blocks("a") == 0
    for i in range(5):
        index.apply("a", [stored([i], None, [i] * B)])
    assert index.blocks("a") == 3 and index.evicted == 2
    assert index.match("a", [0] * B).tokens == 0 and index.match("a", [4] * B).tokens == B


def test_a_prefix_covering_the_whole_prompt_leaves_its_last_block_to_compute():
    index = KVIndex()
    index.apply("a", [stored([1, 2], None, list(range(2 * B)))])
    assert index.match("a", list(range(2 * B))).servable(2 * B) == B
    assert index.match("a", list(range(2 * B + 1))).servable(2 * B + 1) == 2 * B


def test_instances_are_separate_and_forget_drops_one():
    index = KVIndex()
    index.apply("a", [stored([1], None, list(range(B)))])
    index.apply("b", [stored([1], None, list(range(B)))])
    index.forget("a")
    assert index.match("a", list(range(B))).tokens == 0 and index.match("b", list(range(B))).tokens == B


def test_a_prompt_in_flight_counts_as_held_by_vllm_on_its_instance_until_its_answer_ended():
    """vLLM caches a prompt's blocks when it schedules it, before their events: a prompt sent to an
    instance counts there (whole blocks, at the block size of vLLM's own events) while in flight."""
    index = KVIndex(tier_weights={"GPU": 1.0, "CPU": 0.5})
    system, doc, other = list(range(2 * B)), list(range(100, 100 + 2 * B + 1)), list(range(200, 200 + 3 * B))
    with index.sending("a", system + doc):  # no event from "a" yet: its block size is unknown
        assert index.match("a", system + doc).tokens == 0
    index.apply("a", [stored([1], None, list(range(500, 500 + B)), "CPU")])  # LMCache's: not vLLM's size
    with index.sending("a", system + doc):
        assert index.match("a", system).tokens == 0
    index.apply("a", [stored([2], None, other[:B])])  # vLLM's own block: size B
    with index.sending("a", system + doc):
        with index.sending("a", system + other):
            match = index.match("a", system + other + [7])
            assert (match.tokens, match.weighted, match.by_tier) == (5 * B, 5 * B, {"GPU": 5 * B})
            assert index.match("a", system + doc + [7]).tokens == 4 * B  # its last, partial block: no
            assert index.match("b", system + doc).tokens == 0
        assert index.match("a", system + other).tokens == 2 * B  # the other prompt's answer ended
        index.apply("a", [AllBlocksCleared()])  # it stores its blocks again: still counted
        assert index.match("a", system + doc).tokens == 4 * B
    assert index.match("a", system + doc).tokens == 0
    assert index.match("a", other).tokens == 0  # cleared


def test_the_index_keeps_nothing_beyond_its_blocks():
    """What it learns besides the blocks (media, block sizes, adapters) goes with the last block
    that had it: any number of such events leaves an index of `max_blocks` blocks its size."""
    index = KVIndex(max_blocks=10)
    index.apply("a", [BlockStored([0], None, [1, 2], 2, None, "GPU", None)])
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for n in range(1, 10_001):  # each a valid block in a new medium, size and adapter, evicted soon
            index.apply("a", [BlockStored([n], None, [1] * (n % 50 + 1), n % 50 + 1, None, f"medium-{n}",
                                          f"lora-{n}"), BlockStored([], None, [], n, None, "GPU", None)])
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert index.blocks("a") == 10 and index.evicted == 9_991
    assert grown < 100_000, f"{grown} bytes kept for 10 blocks"


def test_blocks_match_only_a_request_with_the_keys_vllm_hashed_them_with():
    """vLLM hashes a request's ``cache_salt`` into its first block and its LoRA adapter into every
    block, and publishes both in the events (``extra_keys``, ``lora_name``): a block stored under
    other keys (another tenant's salt, an adapter, multimodal inputs) is never a request's, and a
    request's model counts as an adapter where the instance holds that adapter's blocks."""
    index = KVIndex()
    tokens = list(range(3 * B))
    index.apply("a", [BlockStored([1, 2, 3], None, tokens, B, None, None, None,
                                  extra_keys=[("tenant-a",), None, None])])
    index.apply("b", [BlockStored([1, 2, 3], None, tokens, B, 7, None, "sql",
                                  extra_keys=[("sql", "tenant-a"), ("sql",), ("sql",)])])
    index.apply("c", [BlockStored([1], None, tokens[:B], B, None, None, None, extra_keys=[(("img", 0),)])])
    salt_a, salt_b = RequestKeys("tenant-a", "base"), RequestKeys("tenant-b", "base")
    assert [index.match("a", tokens, k).tokens for k in (salt_a, salt_b, RequestKeys())] == [3 * B, 0, 0]
    assert index.match("b", tokens, RequestKeys("tenant-a", "sql")).tokens == 3 * B
    assert index.match("b", tokens, salt_a).tokens == 0  # "base" is no adapter: the base model's blocks
    assert index.match("b", tokens, RequestKeys(None, "sql")).tokens == 0
    assert index.match("c", tokens).tokens == 0
    index.apply("a", [BlockStored([4], 1, tokens[B:2 * B], B, None, "CPU", None)])  # a later block: no salt
    assert index.match("a", tokens, salt_a).by_tier == {"GPU": 3 * B}
    with index.sending("a", [*tokens, *range(100, 100 + B)], salt_b):  # in flight: under its own salt
        assert index.match("a", tokens, salt_b).tokens == 3 * B
        assert index.match("a", tokens, RequestKeys("tenant-c")).tokens == 0


def test_the_request_keys_are_the_extra_keys_vllm_publishes():
    """A salted LoRA request's blocks, published as vLLM's block pool publishes them
    (`generate_block_hash_extra_keys`, `to_event_extra_keys`), match that request's `RequestKeys`."""
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    lora = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql", name="sql", adapter_id=3)
    request = SimpleNamespace(cache_salt="tenant-a", lora_request=lora, mm_features=None, prompt_embeds=None)
    tokens = list(range(3 * B))
    extra = [generate_block_hash_extra_keys(request, i * B, (i + 1) * B, 0)[0] for i in range(3)]
    index = KVIndex()
    index.apply("a", [BlockStored([1, 2, 3], None, tokens, B, lora.adapter_id, "GPU", lora.name,
                                  extra_keys=to_event_extra_keys(extra))])
    assert index.match("a", tokens, RequestKeys("tenant-a", "sql")).tokens == 3 * B
    assert index.match("a", tokens, RequestKeys("tenant-a")).tokens == 0
