"""The encoder and serde classes check their arguments at construction (specific ValueErrors)."""

from __future__ import annotations

import pytest
import torch

from lmcache.cachegen.config import CacheGenConfig
from lmcache.cachegen.encoder import CacheGenEncoderImpl
from lmcache.cachegen.serde import CacheGenDeserializer, CacheGenSerializer
from lmcache.config import LMCacheEngineMetadata

BINS = [16, 16]


def test_encoder_impl_codes_kv_or_fp_k_and_fp_v_alike(make_kv) -> None:
    kv = make_kv(2, 24, 8)
    whole = CacheGenEncoderImpl(kv=kv, key_bins=BINS, value_bins=BINS).code()
    halves = CacheGenEncoderImpl(fp_k=kv[0], fp_v=kv[1], key_bins=BINS, value_bins=BINS).code()
    assert whole.encoded.payload == halves.encoded.payload


@pytest.mark.parametrize("kwargs, match", [
    ({}, "needs kv"),
    ({"fp_k": torch.zeros(2, 4, 8)}, "needs kv"),
    ({"fp_k": torch.zeros(2, 4, 8), "fp_v": torch.zeros(2, 5, 8)}, "differ in shape"),
    ({"kv": torch.zeros(2, 2, 4, 8), "fp_k": torch.zeros(2, 4, 8)}, "not both"),
    ({"kv": torch.zeros(3, 2, 4, 8)}, r"\[2, L, T, C\]"),
    ({"kv": torch.zeros(2, 2, 4, 8, dtype=torch.int32)}, "floating-point"),
    ({"kv": torch.zeros(2, 3, 4, 8)}, "key_bins has 2 entries for 3 layers"),
    ({"kv": torch.zeros(2, 2, 4, 8), "key_bins": [16, 1]}, r"must each be in \[2, 1024\]"),
    ({"kv": torch.zeros(2, 2, 4, 8), "block_tokens": [3]}, "add up to T=4"),
    ({"kv": torch.zeros(2, 2, 4, 8), "block_tokens": [4, 0]}, ">= 1 each"),
])
def test_encoder_impl_rejects_arguments_that_do_not_fit_together(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CacheGenEncoderImpl(**{"key_bins": BINS, "value_bins": BINS, **kwargs})


def test_serializer_rejects_a_cachegen_config_of_another_layer_count(engine_config, metadata,
                                                                     dims) -> None:
    other = CacheGenConfig.uniform(dims["nlayers"] + 1, 16, 16)
    with pytest.raises(ValueError, match=f"covers {dims['nlayers'] + 1} layers"):
        CacheGenSerializer(engine_config, metadata, cachegen_config=other)


def test_deserializer_rejects_a_non_float_dtype_and_mla_latents(engine_config, metadata) -> None:
    with pytest.raises(ValueError, match="float dtype"):
        CacheGenDeserializer(engine_config, metadata, torch.int8)
    mla = LMCacheEngineMetadata("ds", 1, 0, "vllm", torch.bfloat16, (3, 1, engine_config.chunk_size, 1, 576))
    with pytest.raises(ValueError, match="one latent per token and layer"):
        CacheGenDeserializer(engine_config, mla, torch.bfloat16)
