"""Per-group slot bookkeeping: where each KV cache group's tokens are read on a save and written on a
load (sliding windows, vLLM's null blocks, mixed block sizes)."""

import torch

from lmcache.integration.vllm.kv_groups import GroupKind, KVGroup
from lmcache.integration.vllm.metadata import RequestPlan
from lmcache.integration.vllm.transfer import load_slots, save_slots, slots_for

CHUNK = 256
FULL = KVGroup(0, GroupKind.FULL, 128, ("l.0",))
SLIDING = KVGroup(1, GroupKind.SLIDING, 128, ("l.1",), window=128)


def blocks(first_id, n):
    return list(range(first_id, first_id + n))


def test_slots_follow_the_block_table_and_the_null_block_holds_nothing():
    slots = slots_for([0, 7, 3], 300, 128)
    assert bool((slots[:128] == -1).all())
    assert torch.equal(slots[128:256], torch.arange(7 * 128, 8 * 128))
    assert torch.equal(slots[256:300], torch.arange(3 * 128, 3 * 128 + 44))
    assert bool((slots_for([5], 200, 128)[128:] == -1).all())  # no block allocated yet


def test_a_sliding_window_chunk_keeps_the_rows_a_hit_at_its_end_needs():
    """Window 128: a hit of e - 1 reads tokens from e - 128 on, so a chunk ending at e keeps the
    block holding token e - 128 onwards; a full-attention group keeps everything."""
    plan = RequestPlan("r", [], [blocks(1, 6), blocks(10, 6)], save_from=0, save_to=700)
    slots, first = save_slots([FULL, SLIDING], plan, CHUNK)
    assert first == 0
    assert bool((slots[0] >= 0).all())
    sliding = slots[1]
    for start, end in ((0, 256), (256, 512), (512, 700)):
        kept = SLIDING.first_kept(end)
        assert kept == (end - 128) // 128 * 128
        assert bool((sliding[start:kept] == -1).all()) and bool((sliding[kept:end] >= 0).all())


def test_a_window_wider_than_a_chunk_keeps_rows_of_earlier_tokens_too():
    wide = KVGroup(1, GroupKind.SLIDING, 128, ("l.1",), window=512)
    assert wide.first_kept(256) == 0 and wide.first_kept(768) == 256 and wide.first_kept(1024) == 512


def test_chunks_whose_kept_rows_vllm_no_longer_holds_are_not_stored():
    """vLLM's own prefix cache hands a request only the window's blocks of its hit (nulls before):
    the chunks of that hit whose kept rows fall in null blocks cannot be stored; later chunks can."""
    sliding_table = [0, 0, 0, 0, 0, 0, 7, 8, 9]  # a local hit of 896 tokens: only the last window held
    plan = RequestPlan("r", [], [blocks(1, 9), sliding_table], save_from=0, save_to=1100)
    slots, first = save_slots([FULL, SLIDING], plan, CHUNK)
    assert first == 768  # chunks ending at 256, 512, 768 need rows of null blocks
    assert bool((slots[1][896:1100] >= 0).all())


def test_a_load_writes_only_the_blocks_the_group_holds_beyond_vllms_own_hit():
    sliding_table = [0, 0, 0, 0, 21, 22, 23]  # vLLM allocated only the window's blocks of an 800-token hit
    plan = RequestPlan("r", [], [blocks(1, 7), sliding_table], load_from=128, load_to=800, retrieve_to=1024)
    slots = load_slots([FULL, SLIDING], plan)
    assert slots.shape == (2, 1024)
    assert bool((slots[0][:128] == -1).all()) and bool((slots[0][128:800] >= 0).all())
    assert bool((slots[1][:512] == -1).all()) and bool((slots[1][512:800] >= 0).all())
    assert bool((slots[:, 800:] == -1).all())  # vLLM computes these


def test_groups_with_different_block_sizes_each_use_their_own():
    small = KVGroup(1, GroupKind.FULL, 16, ("l.1",))
    plan = RequestPlan("r", [], [[4, 5], list(range(30, 46))], load_from=0, load_to=256, retrieve_to=256)
    slots = load_slots([FULL, small], plan)
    assert torch.equal(slots[0][:128], torch.arange(4 * 128, 5 * 128))
    assert torch.equal(slots[1][:16], torch.arange(30 * 16, 31 * 16))
    assert torch.equal(slots[1][240:256], torch.arange(45 * 16, 46 * 16))


def test_one_group_gives_a_one_dimensional_mapping():
    plan = RequestPlan("r", [], [blocks(1, 3)], load_from=0, load_to=300, retrieve_to=300)
    assert load_slots([FULL], plan).shape == (300,)


def test_a_model_of_sliding_windows_only_reads_no_chunk_below_the_window():
    """Every per-token group windowed: a hit of 1000 tokens (window 128) writes only tokens from
    the block holding token 873 on, so the load reads the chunk [768, 1024) and none before."""
    from lmcache.integration.vllm.transfer import load_plan
    from tests.helpers.paged_kv import PagedKV, build_engine

    engine = build_engine(256, cpu_bytes=16 << 20)
    kv = PagedKV(block_size=128, num_blocks=16)
    tokens = torch.randint(0, 1000, (1024,))
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=kv.slots_for(1024))
    window = KVGroup(0, GroupKind.SLIDING, 128, ("l.0",), window=128)
    table = [0, 0, 0, 0, 0, 0, 9, 10]  # vLLM allocated only the window's blocks of the hit
    plan = RequestPlan("r", tokens.tolist(), [table], load_from=0, load_to=1000, retrieve_to=1024)
    before = engine.stats.snapshot().get("retrieve_requested_tokens", 0)
    assert load_plan(engine, kv.empty_like().layers, plan, [window]) == 1000
    assert engine.stats.snapshot()["retrieve_requested_tokens"] - before == 1024 - 768
    engine.close()
