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
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from lmcache.config import LMCacheEngineConfig
from lmcache.integration.vllm.kv_groups import GroupKind, UnsupportedModel, layer_index, model_kv


def vllm_config(model_type="llama"):
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type)))


def kv_config(*groups):
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(layers), spec) for layers, spec in groups])


def config(chunk_size=256, **fields):
    return LMCacheEngineConfig.from_defaults(chunk_size=chunk_size, **fields)


def full(block_size=128, **kw):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float32, **kw)


def sliding(window, block_size=128):
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float32,
                             sliding_window=window)


def mla(block_size=16, **kw):
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, **kw)


def test_one_full_attention_group_is_stored_per_token_in_layer_order_in_the_canonical_layout():
    groups = kv_config((["model.layers.10.attn", "model.layers.2.attn"], full()))
    kv = model_kv(vllm_config(), groups, config())
    assert [g.kind for g in kv.groups] == [GroupKind.FULL]
    assert kv.token_layers == ("model.layers.2.attn", "model.layers.10.attn")
    assert (kv.num_kv_heads, kv.head_size, kv.dtype, kv.kv_count) == (2, 64, torch.float32, 2)
    assert kv.layout() == "kv_blob"  # shared with every engine and HF transformers


def test_sliding_window_and_full_groups_map_each_layer_to_its_group_and_name_the_structure():
    even, odd = ["m.layers.0.attn", "m.layers.2.attn"], ["m.layers.1.attn", "m.layers.3.attn"]

    def alternating(window, windowed=even, full_layers=odd):
        return model_kv(vllm_config("gpt_oss"), kv_config((windowed, sliding(window)), (full_layers, full())),
                        config())

    kv = alternating(128)
    assert [g.kind for g in kv.groups] == [GroupKind.SLIDING, GroupKind.FULL]
    assert kv.groups[0].window == 128
    assert kv.layer_groups == (0, 1, 0, 1)
    layouts = {kv.layout(), alternating(256).layout(), alternating(128, odd, even).layout(), "kv_blob"}
    assert len(layouts) == 4  # a cache written for one layer structure never serves another


def test_mla_is_stored_as_one_latent_per_token_and_layer():
    kv = model_kv(vllm_config("deepseek_v2"), kv_config((["l.0", "l.1", "l.2"], mla())), config())
    assert (kv.kv_count, kv.num_kv_heads, kv.head_size, kv.dtype) == (1, 1, 576, torch.bfloat16)
    assert kv.layout() == "mla_latent"


def test_mla_beside_other_attention_or_with_cachegen_is_refused():
    with pytest.raises(UnsupportedModel, match="MLA layers beside other kinds of attention"):
        model_kv(vllm_config("x"), kv_config((["l.0"], mla()), (["l.1"], full(block_size=16))), config())
    with pytest.raises(UnsupportedModel, match=r"CacheGen .* not MLA latents"):
        model_kv(vllm_config("deepseek_v2"), kv_config((["l.0"], mla())),
                 config(remote_url="lm://127.0.0.1:1", remote_serde="cachegen"))


def test_a_quantized_kv_cache_is_refused():
    with pytest.raises(UnsupportedModel, match="quantized KV cache"):
        model_kv(vllm_config("deepseek_v2"), kv_config((["l.0"], mla(cache_dtype_str="fp8"))), config())


def test_hybrid_models_on_a_gpu_are_refused():
    cuda = vllm_config("gpt_oss")
    cuda.device_config = SimpleNamespace(device_type="cuda")
    with pytest.raises(UnsupportedModel, match="2 KV cache groups on cuda"):
        model_kv(cuda, kv_config((["l.0"], sliding(128)), (["l.1"], full())), config())
    assert model_kv(cuda, kv_config((["l.0"], full())), config()).uniform


def test_a_group_kind_the_connector_does_not_store_is_refused_naming_the_model_type():
    local = ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                      attention_chunk_size=512)
    with pytest.raises(UnsupportedModel, match=r"cannot serve llama4 models exactly: KV cache group 1 "
                                               r"is a ChunkedLocalAttentionSpec.*connector is inactive"):
        model_kv(vllm_config("llama4"), kv_config((["l.0"], full()), (["l.1"], local)), config())


def test_a_chunk_size_that_is_not_a_multiple_of_the_block_size_is_refused():
    with pytest.raises(UnsupportedModel, match=r"chunk_size=100 is not a multiple of vLLM's block size 128"):
        model_kv(vllm_config(), kv_config((["l.0"], full())), config(100))


def test_no_kv_cache_configuration_is_refused():
    with pytest.raises(UnsupportedModel, match="no KV cache configuration"):
        model_kv(vllm_config(), None, config())


def test_layer_names_sort_by_their_first_number():
    assert sorted(["m.layers.10.a", "m.layers.9.a", "m.layers.9"], key=layer_index) == [
        "m.layers.9", "m.layers.9.a", "m.layers.10.a"]


def mamba(mode="align", block_size=256, **kw):
    return MambaSpec(block_size=block_size, shapes=((3, 512), (4, 64, 64)),
                     dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode, **kw)


def test_recurrent_layers_keep_a_state_beside_the_attention_chunks():
    groups = kv_config((["m.layers.0.linear_attn"], mamba()), (["m.layers.1.linear_attn"], mamba()),
                       (["m.layers.2.self_attn"], full(block_size=256)))
    kv = model_kv(vllm_config("qwen3_next"), groups, config())
    assert [g.kind for g in kv.groups] == [GroupKind.STATE, GroupKind.STATE, GroupKind.FULL]
    assert kv.token_layers == ("m.layers.2.self_attn",) and kv.layer_groups == (0,)
    assert [name for name, _ in kv.state_layers] == ["m.layers.0.linear_attn", "m.layers.1.linear_attn"]
    assert kv.state_groups[0].state_block(768) == 2  # vLLM keeps the state after 768 tokens in block 2
    assert kv.state_groups[0].state_block(640) == 2  # ... and one after 640 there too
    assert kv.resume_points(4000) == [3840, 3968, 3984]  # a prefill step may stop at 3999 // g * g
    assert kv.state_layout().startswith("state+") and kv.layout() != "kv_blob"
    assert kv.state_layout() != model_kv(vllm_config("qwen3_next"), kv_config(
        (["m.layers.0.linear_attn"], mamba()), (["m.layers.2.self_attn"], full(block_size=256))),
        config()).state_layout()


def test_recurrent_state_vllm_keeps_only_for_the_running_request_is_refused():
    groups = kv_config((["l.0"], mamba(mode="none")), (["l.1"], full(block_size=256)))
    with pytest.raises(UnsupportedModel, match="enable vLLM's prefix caching"):
        model_kv(vllm_config("qwen3_next"), groups, config())
    with pytest.raises(UnsupportedModel, match="no attention layers"):
        model_kv(vllm_config("mamba2"), kv_config((["l.0"], mamba())), config())
    with pytest.raises(UnsupportedModel, match="not recurrent states"):
        model_kv(vllm_config("qwen3_next"), kv_config((["l.0"], mamba()), (["l.1"], full(block_size=256))),
                 config(local_disk="/tmp/x", local_disk_serde="cachegen"))
