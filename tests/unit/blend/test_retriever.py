"""SPTBlendRetriever: splitting on the separator, position-independent per-segment retrieval from a
real engine, asynchronous loads, failures as misses."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from lmcache.blend.retriever import SPTBlendRetriever, split_segments
from lmcache.cache_engine import LMCacheEngine

from .conftest import NUM_LAYERS, random_kv, store_kv

SPT = torch.tensor([900, 901])


def toks(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def segment(seed: int, n: int) -> torch.Tensor:
    """`n` tokens ending with the separator; the other tokens never contain it."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, 800, (n - SPT.numel(),), generator=g), SPT])


# ---- splitting ----------------------------------------------------------------------------------


def test_split_follows_the_seed_example() -> None:
    # [x, x, x, spt, y, y, spt, z, z, z, z] -> [x, x, x, spt], [y, y, spt], [z, z, z, z]
    tokens = toks(1, 1, 1, 900, 901, 2, 2, 900, 901, 3, 3, 3, 3)
    assert split_segments(tokens, SPT) == [(0, 5), (5, 9), (9, 13)]


def test_an_input_ending_with_the_separator_has_no_empty_last_segment() -> None:
    assert split_segments(toks(1, 900, 901, 2, 900, 901), SPT) == [(0, 3), (3, 6)]


def test_an_input_without_separator_is_one_segment() -> None:
    assert split_segments(toks(1, 2, 900, 3), SPT) == [(0, 4)]


def test_overlapping_separator_matches_are_taken_leftmost_first() -> None:
    spt = toks(7, 7)
    assert split_segments(toks(1, 7, 7, 7, 2), spt) == [(0, 3), (3, 5)]


def test_an_empty_separator_is_rejected() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        split_segments(toks(1, 2), toks())


# ---- retrieval ----------------------------------------------------------------------------------


def test_each_segment_is_found_wherever_it_appears(engine: LMCacheEngine) -> None:
    a, b, c = segment(1, 40), segment(2, 21), segment(3, 33)
    kv = {0: random_kv(40, 10), 1: random_kv(21, 11), 2: random_kv(33, 12)}
    for seg, i in ((a, 0), (b, 1), (c, 2)):
        store_kv(engine, seg, kv[i])  # each precomputed alone, from position 0
    query = toks(5, 6, 7, 8, 9)
    tokens = torch.cat([c, a, b, query])  # another order, plus an uncached query
    retriever = SPTBlendRetriever(SPT, engine, engine.metadata)
    task = retriever.new_request(tokens, torch.tensor([0, tokens.numel()]))
    offsets = {2: 0, 0: 33, 1: 73}
    for layer in range(NUM_LAYERS):
        res = task.result(layer)
        assert res.k is not None and res.v is not None
        assert res.k.shape == (tokens.numel(), 16)
        for i, start in offsets.items():
            n = kv[i].shape[2]
            assert torch.equal(res.k[start:start + n], kv[i][0, layer])
            assert torch.equal(res.v[start:start + n], kv[i][1, layer])
    res = task.result(0)
    assert res.valid_mask.dtype == torch.bool and res.valid_mask.device.type == "cpu"
    assert res.valid_mask.tolist() == [True] * 94 + [False] * 5
    expected = list(range(33)) + list(range(40)) + list(range(21)) + [0] * 5
    assert res.original_positions.tolist() == expected
    assert task.num_retrieved_tokens == 94
    retriever.close()


def test_keys_do_not_chain_across_segments(engine: LMCacheEngine) -> None:
    a, b = segment(1, 20), segment(2, 20)
    store_kv(engine, torch.cat([a, b]), random_kv(40, 1))  # stored as one sequence: b chains on a
    retriever = SPTBlendRetriever(SPT, engine, engine.metadata)
    res = retriever.new_request(torch.cat([a, b]), torch.tensor([0, 40])).result(0)
    # a alone is a prefix of what was stored (its first 16-token chunk is); b alone was never stored
    assert res.valid_mask.tolist() == [True] * 16 + [False] * 24
    retriever.close()


def test_a_partly_cached_segment_is_valid_on_its_cached_prefix(engine: LMCacheEngine) -> None:
    a = segment(4, 40)
    store_kv(engine, a[:32], random_kv(32, 2))  # two full chunks of the segment
    retriever = SPTBlendRetriever(SPT, engine, engine.metadata)
    res = retriever.new_request(a, torch.tensor([0, 40])).result(1)
    assert res.valid_mask.tolist() == [True] * 32 + [False] * 8
    assert res.original_positions.tolist() == list(range(32)) + [0] * 8
    retriever.close()


def test_nothing_cached_gives_no_kv(engine: LMCacheEngine) -> None:
    retriever = SPTBlendRetriever(SPT, engine, engine.metadata)
    res = retriever.new_request(segment(9, 20), torch.tensor([0, 20])).result(0)
    assert res.k is None and res.v is None and not res.valid_mask.any()
    retriever.close()


def test_requests_in_a_batch_are_split_separately(engine: LMCacheEngine) -> None:
    a, b = segment(1, 18), segment(2, 18)
    store_kv(engine, a, random_kv(18, 1))
    store_kv(engine, b, random_kv(18, 2))
    # request 0 = [a, x], request 1 = [b]; the tail x of request 0 must not join b
    x = toks(3, 4, 5)
    tokens = torch.cat([a, x, b])
    retriever = SPTBlendRetriever(SPT, engine, engine.metadata)
    task = retriever.new_request(tokens, torch.tensor([0, 21, 39]))
    assert [s.numel() for s in task.token_segments] == [18, 3, 18]
    assert task.result(0).valid_mask.tolist() == [True] * 18 + [False] * 3 + [True] * 18
    retriever.close()


def test_result_rejects_a_layer_out_of_range(engine: LMCacheEngine) -> None:
    retriever = SPTBlendRetriever(SPT, engine, engine.metadata)
    task = retriever.new_request(segment(1, 20), torch.tensor([0, 20]))
    with pytest.raises(ValueError, match="layer_id=3"):
        task.result(NUM_LAYERS)
    retriever.close()


def test_bad_query_start_loc_is_rejected(engine: LMCacheEngine) -> None:
    retriever = SPTBlendRetriever(SPT, engine, engine.metadata)
    with pytest.raises(ValueError, match="query_start_loc"):
        retriever.new_request(segment(1, 20), torch.tensor([0, 19]))
    retriever.close()


class GatedEngine:
    """Delegates to a real engine, but each retrieve waits for `gate` (and may fail on purpose)."""

    def __init__(self, engine: LMCacheEngine, fail_first_token: int | None = None) -> None:
        self.engine = engine
        self.gate = threading.Event()
        self.fail_first_token = fail_first_token
        self.threads: set[str] = set()
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def retrieve(self, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        with self._lock:
            self.threads.add(threading.current_thread().name)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            assert self.gate.wait(10)
            if self.fail_first_token is not None and int(tokens[0]) == self.fail_first_token:
                raise OSError("injected storage failure")
            return self.engine.retrieve(tokens, **kwargs)
        finally:
            with self._lock:
                self.in_flight -= 1


def test_new_request_returns_before_the_loads_finish_and_result_waits_for_them(
        engine: LMCacheEngine) -> None:
    segs = [segment(i, 20) for i in range(3)]
    for i, s in enumerate(segs):
        store_kv(engine, s, random_kv(20, i))
    gated = GatedEngine(engine)
    retriever = SPTBlendRetriever(SPT, gated, engine.metadata)  # type: ignore[arg-type]
    tokens = torch.cat(segs)
    task = retriever.new_request(tokens, torch.tensor([0, 60]))
    assert not any(f.done() for f in task.tasks)  # the loads are in flight, not done
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(task.result(0)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # result() blocks while the loads wait
    deadline = time.monotonic() + 5
    while gated.in_flight < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gated.max_in_flight == 3  # all three segments load concurrently
    gated.gate.set()
    waiter.join(5)
    assert got and bool(got[0].valid_mask.all())
    assert len(gated.threads) == 3
    retriever.close()


def test_a_segment_whose_load_fails_is_a_miss_and_the_others_are_served(engine: LMCacheEngine) -> None:
    a, b = segment(1, 20), segment(2, 20)
    store_kv(engine, a, random_kv(20, 1))
    store_kv(engine, b, random_kv(20, 2))
    gated = GatedEngine(engine, fail_first_token=int(b[0]))
    gated.gate.set()
    retriever = SPTBlendRetriever(SPT, gated, engine.metadata)  # type: ignore[arg-type]
    res = retriever.new_request(torch.cat([a, b]), torch.tensor([0, 40])).result(2)
    assert res.valid_mask.tolist() == [True] * 20 + [False] * 20
    retriever.close()
