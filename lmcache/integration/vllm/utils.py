"""What the vLLM integration derives from vLLM's configuration: the LMCache config, the engine
metadata (model identity, world size, rank, KV dtype and shape) and the engine's name."""

from __future__ import annotations

import logging
from typing import Any

import torch

from lmcache.chunk_hash import extra_key_of
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.integration.checkpoint import checkpoint_fingerprint, model_name
from lmcache.integration.vllm.kv_groups import CANONICAL_LAYOUT, ModelKV

logger = logging.getLogger(__name__)

ENGINE_NAME = "vllm-instance"
EXTRA_PREFIX = "lmcache."


def lmcache_config_from_vllm(vllm_config: Any) -> LMCacheEngineConfig:
    """LMCache config for a vLLM engine: `kv_connector_extra_config` keys ``lmcache.<field>``
    over ``LMCACHE_*`` env over ``LMCACHE_CONFIG_FILE`` over defaults. Raises ValueError for an
    unknown or invalid field (whether the chunk size suits vLLM's block sizes is the model's
    question: `kv_groups.model_kv`). The connector always runs with ``error_handling=True``: a
    cache fault never fails a request."""
    transfer = vllm_config.kv_transfer_config
    extra: dict[str, Any] = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    overrides = {}
    for name, value in extra.items():
        if not name.startswith(EXTRA_PREFIX):
            raise ValueError(f"kv_connector_extra_config key {name!r}: LMCache keys are "
                             f"'{EXTRA_PREFIX}<field>' (e.g. 'lmcache.chunk_size')")
        overrides[name[len(EXTRA_PREFIX):]] = value
    try:
        config = LMCacheEngineConfig.load(overrides)
    except ValueError as e:
        raise ValueError(f"LMCache kv_connector_extra_config: {e}") from e
    if not config.error_handling:
        config.error_handling = True
    role = getattr(transfer, "kv_role", None)
    if config.enable_pd and (role, config.pd_role) in (("kv_consumer", "sender"),
                                                       ("kv_producer", "receiver")):
        raise ValueError(f"LMCache pd_role={config.pd_role!r} cannot work with kv_role={role!r}: a sender "
                         "stores (kv_producer or kv_both), a receiver loads (kv_consumer or kv_both)")
    return config


def engine_metadata(vllm_config: Any, config: LMCacheEngineConfig, kv_dtype: torch.dtype,
                    rank: int, model: ModelKV | None = None) -> LMCacheEngineMetadata:
    """The engine's metadata: the KV shape of the layers `model` stores per token (by default
    every layer of the model, K and V of each) and its stored layout."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if model is not None:
        num_layers, num_kv_heads, head_size = len(model.token_layers), model.num_kv_heads, model.head_size
        layout, state_layout, kv_count = model.layout(), model.state_layout(), model.kv_count
    else:
        num_layers = model_config.get_num_layers(parallel)
        num_kv_heads = model_config.get_num_kv_heads(parallel)
        head_size = model_config.get_head_size()
        layout, state_layout, kv_count = CANONICAL_LAYOUT, "", 2
    return LMCacheEngineMetadata(
        model_name=model_name(model_config.model),
        world_size=parallel.world_size,
        worker_id=rank,
        fmt="vllm",
        kv_dtype=kv_dtype,
        kv_shape=(num_layers, kv_count, config.chunk_size, num_kv_heads, head_size),
        layout=layout,
        state_layout=state_layout,
        model_fingerprint=checkpoint_fingerprint(model_config.model),
    )


def extra_key(request: Any) -> str | None:
    """What separates caches of the same tokens: vLLM's cache_salt, the LoRA adapter and the
    multimodal inputs (an image's placeholder tokens are the same whatever the image: its
    identifier and position name it)."""
    lora = getattr(request, "lora_request", None)
    media = [f"{f.identifier}@{f.mm_position.offset}" for f in getattr(request, "mm_features", None) or ()]
    return extra_key_of(getattr(request, "cache_salt", None), lora.lora_int_id if lora is not None else None,
                        media)


def tokens_name_kv(request: Any) -> bool:
    """False for a prompt given as embeddings: its token ids are placeholders, the same whatever
    the embeddings (the connector neither loads nor stores such a request's KV)."""
    return getattr(request, "prompt_embeds", None) is None
