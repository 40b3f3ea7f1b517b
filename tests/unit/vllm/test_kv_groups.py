"""Reading vLLM's KV cache groups: what the connector stores, and what it refuses (with vLLM's own
spec classes, no engine)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

from lmcache.integration.vllm.kv_groups import GroupKind, UnsupportedModel, layer_index, model_kv


def vllm_config(model_type="llama"):
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type)))


def kv_config(*groups):
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(layers), spec) for layers, spec in groups])


def full(block_size=128, **kw):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float32, **kw)


def test_one_full_attention_group_is_stored_per_token_in_layer_order():
    kv = model_kv(vllm_config(), kv_config((["model.layers.10.attn", "model.layers.2.attn"], full())), 256)
    assert [g.kind for g in kv.groups] == [GroupKind.FULL]
    assert kv.token_layers == ("model.layers.2.attn", "model.layers.10.attn")
    assert (kv.num_kv_heads, kv.head_size, kv.dtype) == (2, 64, torch.float32)


def test_a_group_kind_the_connector_does_not_store_is_refused_naming_the_model_type():
    local = ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                      attention_chunk_size=512)
    with pytest.raises(UnsupportedModel, match=r"cannot serve llama4 models exactly: KV cache group 1 "
                                               r"is a ChunkedLocalAttentionSpec.*connector is inactive"):
        model_kv(vllm_config("llama4"), kv_config((["l.0"], full()), (["l.1"], local)), 256)


def test_a_chunk_size_that_is_not_a_multiple_of_the_block_size_is_refused():
    with pytest.raises(UnsupportedModel, match=r"chunk_size=100 is not a multiple of vLLM's block size 128"):
        model_kv(vllm_config(), kv_config((["l.0"], full())), 100)


def test_no_kv_cache_configuration_is_refused():
    with pytest.raises(UnsupportedModel, match="no KV cache configuration"):
        model_kv(vllm_config(), None, 256)


def test_layer_names_sort_by_their_first_number():
    assert sorted(["m.layers.10.a", "m.layers.9.a", "m.layers.9"], key=layer_index) == [
        "m.layers.9", "m.layers.9.a", "m.layers.10.a"]
