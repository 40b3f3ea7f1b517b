import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.token_database import ChunkedTokenDatabase


def make_db(chunk_size=4, model="org/model@v1", worker_id=0):
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=chunk_size)
    md = LMCacheEngineMetadata(model, 2, worker_id, "vllm", torch.bfloat16, (2, 2, chunk_size, 1, 4))
    return ChunkedTokenDatabase(cfg, md)


def test_chunks_cover_tokens_including_trailing_partial_chunk():
    db = make_db(4)
    ranges = [(s, e) for s, e, _ in db.process_tokens(torch.arange(10))]
    assert ranges == [(0, 4), (4, 8), (8, 10)]


def test_keys_carry_layout_model_world_size_worker_and_dtype():
    key = make_db(worker_id=1).process_tokens(torch.arange(4))[0][2]
    assert (key.fmt, key.model_name, key.world_size, key.worker_id, key.dtype) == (
        "kv_blob", "org/model@v1", 2, 1, "bfloat16")
    assert len(key.chunk_hash) == 32  # 128-bit hash


def test_key_string_form_round_trips_with_separators_in_fields():
    key = make_db().process_tokens(torch.arange(4))[0][2]
    assert CacheEngineKey.from_string(key.to_string()) == key
    assert key.to_string().count("@") == 5


@pytest.mark.parametrize("bad", ["a@b", "a@b@c@d@e@f@g", "f@m@x@0@h@d"])
def test_malformed_key_strings_raise(bad):
    with pytest.raises(ValueError):
        CacheEngineKey.from_string(bad)


def test_hash_chains_over_prefix():
    db = make_db(4)
    a = db.chunk_hashes(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]))
    b = db.chunk_hashes(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    c = db.chunk_hashes(torch.tensor([0, 2, 3, 4, 5, 6, 7, 8]))
    assert a == b[:2]
    assert a[1] != c[1]  # same second chunk, different history


def test_extra_key_separates_caches():
    db = make_db(4)
    t = torch.arange(8)
    assert db.chunk_hashes(t) != db.chunk_hashes(t, extra_key="salt")
    assert db.chunk_hashes(t, extra_key="salt") == db.chunk_hashes(t, extra_key="salt")


def test_hashes_are_the_same_in_another_process_with_another_hash_seed():
    db = make_db(4)
    here = db.chunk_hashes(torch.arange(12))
    code = (
        "import torch; from lmcache.config import *; from lmcache.token_database import *;"
        "c=LMCacheEngineConfig.from_defaults(chunk_size=4);"
        "m=LMCacheEngineMetadata('org/model@v1',2,0,'vllm',torch.bfloat16,(2,2,4,1,4));"
        "print(','.join(ChunkedTokenDatabase(c,m).chunk_hashes(torch.arange(12))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin"})
    assert out.stdout.strip().split(",") == here


def test_mask_skips_the_prefix_chunks():
    db = make_db(4)
    mask = torch.tensor([False] * 4 + [True] * 6)
    chunks = db.process_tokens(torch.arange(10), mask)
    assert [(s, e) for s, e, _ in chunks] == [(4, 8), (8, 10)]
    assert [k for _, _, k in chunks] == [k for _, _, k in db.process_tokens(torch.arange(10))][1:]


def test_mask_with_falses_not_a_multiple_of_chunk_size_raises():
    db = make_db(4)
    with pytest.raises(ValueError, match="3 leading Falses; must be a multiple of chunk_size=4"):
        db.process_tokens(torch.arange(10), torch.tensor([False] * 3 + [True] * 7))


@pytest.mark.parametrize("mask", [[True, False] + [True] * 8, [False] * 4 + [True] * 5 + [False]])
def test_mask_that_is_not_falses_then_trues_raises(mask):
    with pytest.raises(ValueError, match=r"F\.\.\.FT\.\.\.T"):
        make_db(4).process_tokens(torch.arange(10), torch.tensor(mask))


def test_mask_of_wrong_length_and_bad_tokens_raise():
    db = make_db(4)
    with pytest.raises(ValueError, match="mask"):
        db.process_tokens(torch.arange(10), torch.ones(9, dtype=torch.bool))
    with pytest.raises(ValueError, match="1-D"):
        db.process_tokens(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        db.process_tokens(torch.zeros(5))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=40), st.integers(1, 8), st.data())
def test_chunking_property(tokens, chunk_size, data):
    db = make_db(chunk_size)
    t = torch.tensor(tokens)
    n_false = data.draw(st.integers(0, (len(tokens) - 1) // chunk_size)) * chunk_size
    mask = torch.arange(len(tokens)) >= n_false
    chunks = db.process_tokens(t, mask)
    assert chunks[0][0] == n_false and chunks[-1][1] == len(tokens)
    assert all(e - s == chunk_size for s, e, _ in chunks[:-1])
    assert len({k for _, _, k in chunks}) == len(chunks)


@pytest.mark.parametrize("tokens", [torch.tensor([1 + 5j, 2 + 0j]), torch.tensor([True, False])])
def test_complex_and_bool_tokens_are_refused_not_cast(tokens):
    with pytest.raises(ValueError, match="integer"):
        make_db(2).process_tokens(tokens)
