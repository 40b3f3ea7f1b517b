"""Recurrent states of hybrid models: kept at chunk boundaries beside the KV chunks, and a lookup
that ends only where a state is held."""

import pytest
import torch

from tests.helpers import WRITE_WAIT
from tests.helpers.paged_kv import PagedKV, build_engine

CHUNK = 8
STATE_BYTES = 300  # not a multiple of the KV dtype's size: padded in the object, exact in and out


def state_bytes(seed):
    rng = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (STATE_BYTES,), dtype=torch.uint8, generator=rng)


def keep(engine, tokens, n, seed):
    return engine.store_state(tokens[:n], STATE_BYTES, lambda buf: buf.copy_(state_bytes(seed)) is not None)


@pytest.fixture
def stateful():
    engine = build_engine(CHUNK, state_layout="state+test")
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (36,))
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=kv.slots_for(36))  # 4 full chunks + 4 tokens
    yield engine, tokens
    engine.close()


def test_a_lookup_ends_at_the_last_boundary_whose_state_is_held(stateful):
    engine, tokens = stateful
    assert engine.lookup(tokens) == 0  # KV without a state resumes nothing
    assert keep(engine, tokens, 8, 1) and keep(engine, tokens, 24, 2)
    assert engine.lookup(tokens) == 24
    assert engine.lookup(tokens[:23]) == 8  # only boundaries within the tokens asked about
    assert keep(engine, tokens, 32, 3)
    assert engine.lookup(tokens) == 32


def test_a_state_comes_back_bit_for_bit_and_only_at_its_boundary(stateful):
    engine, tokens = stateful
    keep(engine, tokens, 16, 7)
    assert not keep(engine, tokens, 16, 8)  # held already
    obj = engine.retrieve_state(tokens[:16])
    assert torch.equal(obj.tensor.view(torch.uint8)[:STATE_BYTES], state_bytes(7))
    obj.ref_count_down()
    assert engine.retrieve_state(tokens[:24]) is None
    other = tokens.clone()
    other[3] += 1
    assert engine.retrieve_state(other[:16]) is None  # a different prefix


def test_a_state_kept_mid_chunk_is_found_where_the_lookup_names_it(stateful):
    """A serving engine may keep a state between chunk boundaries (where it stopped a prefill
    step): resuming there needs the prefix's trailing partial chunk and that state."""
    engine, tokens = stateful
    keep(engine, tokens, 8, 1)
    keep(engine, tokens, 28, 2)
    assert engine.lookup(tokens[:35]) == 8  # 28 is not named
    assert engine.lookup(tokens[:35], state_ends=[28, 30]) == 8  # no chunk [24, 28) is cached
    kv = PagedKV()
    engine.store(tokens[:28], kvcaches=kv.layers, slot_mapping=kv.slots_for(28))  # stores [24, 28)
    assert engine.lookup(tokens[:35], state_ends=[28, 30]) == 28
    assert engine.lookup(tokens[:35], state_ends=[28, 34]) == 28  # 34: no state there
    assert engine.lookup(tokens[:27], state_ends=[28]) == 8  # beyond the tokens asked about
    obj = engine.retrieve_state(tokens[:28])
    assert torch.equal(obj.tensor.view(torch.uint8)[:STATE_BYTES], state_bytes(2))
    obj.ref_count_down()


def test_nothing_is_kept_when_the_state_cannot_be_read(stateful):
    engine, tokens = stateful
    assert not engine.store_state(tokens[:16], STATE_BYTES, lambda buf: False)
    assert engine.retrieve_state(tokens[:16]) is None


def test_an_engine_without_states_refuses_to_keep_one():
    engine = build_engine(CHUNK)
    with pytest.raises(ValueError, match="keeps no recurrent state"):
        engine.store_state(torch.arange(8), 4, lambda buf: True)
    engine.close()


def test_a_lease_pins_the_state_it_counted():
    chunk_bytes = 2 * 2 * CHUNK * 8 * 2
    engine = build_engine(CHUNK, cpu_bytes=3 * chunk_bytes, state_layout="state+test")
    kv = PagedKV()
    a, b = torch.randint(0, 1000, (16,)), torch.randint(0, 1000, (16,))
    engine.store(a, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
    keep(engine, a, 16, 1)
    assert engine.lookup(a, lease_id="req") == 16
    engine.store(b, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))  # would evict a's chunks and state
    assert engine.lookup(a) == 16
    engine.release("req")
    engine.store(b, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
    assert engine.lookup(a) == 0
    engine.close()


def test_a_state_survives_the_disk_tier_bit_for_bit(tmp_path):
    engine = build_engine(CHUNK, state_layout="state+test", local_disk=str(tmp_path),
                          max_local_disk_size=0.01)
    kv = PagedKV()
    tokens = torch.randint(0, 1000, (16,))
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=kv.slots_for(16))
    keep(engine, tokens, 16, 5)
    assert engine.storage_manager.backends["LocalDiskBackend"].puts.flush(WRITE_WAIT)
    engine.storage_manager.clear("hot")
    assert engine.lookup(tokens, "LocalDiskBackend") == 16
    obj = engine.retrieve_state(tokens)
    assert torch.equal(obj.tensor.view(torch.uint8)[:STATE_BYTES], state_bytes(5))
    obj.ref_count_down()
    engine.close()


def test_held_prefix_gives_back_what_it_took_when_it_fails_midway(stateful, monkeypatch):
    """`held_prefix` takes a reference per object as it goes: an error after the chunks were
    taken (here: reading a state) must not leave them referenced for ever."""
    engine, tokens = stateful
    keep(engine, tokens, 8, 1)
    get_prefix = engine.storage_manager.get_prefix
    calls = []

    def failing_on_the_state(keys):
        calls.append(keys)
        if len(calls) > 1:
            raise RuntimeError("injected")
        return get_prefix(keys)

    monkeypatch.setattr(engine.storage_manager, "get_prefix", failing_on_the_state)
    with pytest.raises(RuntimeError, match="injected"):
        engine.held_prefix(tokens)
    monkeypatch.undo()
    engine.check_integrity()  # every chunk held by the hot tier alone again
