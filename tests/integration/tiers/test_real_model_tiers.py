"""SmolLM2's real KV through the disk and Valkey tiers: a second engine retrieves it, and the
retrieved KV continues the prompt with the same logits as a full prefill."""

from __future__ import annotations

import pytest
import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import VLLMNestedTupleGPUConnector
from lmcache.memory_management import MixedMemoryAllocator
from lmcache.token_database import ChunkedTokenDatabase

pytestmark = pytest.mark.integration
CHUNK = 32


@pytest.fixture(scope="module")
def smollm2():
    transformers = pytest.importorskip("transformers")
    from lmcache.integration.local_model import local_model_path

    path = local_model_path("float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def engine(cfg: dict, model) -> LMCacheEngine:
    c = model.config
    heads, head = c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=0.05, **cfg)
    meta = LMCacheEngineMetadata("SmolLM2-135M-Instruct", 1, 0, "huggingface", torch.float32,
                                 (c.num_hidden_layers, 2, CHUNK, heads, head))
    return LMCacheEngine(config, meta, MixedMemoryAllocator(config.max_local_cpu_bytes),
                         ChunkedTokenDatabase(config, meta),
                         VLLMNestedTupleGPUConnector(heads * head, c.num_hidden_layers))


def test_real_kv_from_a_lower_tier_continues_the_prompt_like_a_full_prefill(smollm2, tmp_path, valkey):
    model, tokenizer = smollm2
    text = "LMCache stores the KV cache of long prompts on disk and in Valkey. " * 8
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : 2 * CHUNK + 20]
    prefix, last = ids[:, :-1], ids[:, -1:]
    with torch.no_grad():
        result = model(ids, use_cache=True)
    full = result.logits[0, -1]
    cache = result.past_key_values
    cache.crop(prefix.shape[1])  # the KV of the prefix: what a previous request would have stored
    # per layer (K, V), token dimension first: [T, kv_heads, head_size]
    kv = [(layer.keys[0].transpose(0, 1).contiguous(), layer.values[0].transpose(0, 1).contiguous())
          for layer in cache.layers]
    tokens = prefix[0]
    cfg = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.05, "remote_url": valkey.url}
    writer = engine(cfg, model)
    writer.store(tokens, kvcaches=kv)
    writer.close()  # flushes both lower tiers

    for tiers in ({"local_disk": cfg["local_disk"], "max_local_disk_size": 0.05},
                  {"remote_url": valkey.url}):
        reader = engine(tiers, model)
        out = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv]
        assert int(reader.retrieve(tokens, kvcaches=out).sum()) == tokens.numel()
        assert all(torch.equal(a, b) for pa, pb in zip(out, kv) for a, b in zip(pa, pb))
        from transformers import DynamicCache

        restored = DynamicCache()
        for i, (k, v) in enumerate(out):
            restored.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], i)
        with torch.no_grad():
            cont = model(last, past_key_values=restored).logits[0, -1]
        torch.testing.assert_close(cont, full, rtol=1e-4, atol=1e-4)
        reader.close()
