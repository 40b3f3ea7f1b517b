"""HF transformers integration: prefix reuse (`PrefixCacheLM`) and CacheBlend (`CacheBlendLM`) for
`AutoModelForCausalLM` models with a `DynamicCache` (batch 1).

```python
engine = create_hf_engine(model, LMCacheEngineConfig.from_defaults(max_local_cpu_size=2))
lm = PrefixCacheLM(model, engine)
out = lm.generate(input_ids, max_new_tokens=32)   # reuses and stores the prompt's KV
```
"""

from lmcache.integration.transformers.blend import BlendPrefillOutput, CacheBlendLM
from lmcache.integration.transformers.connector import HFKVConnector
from lmcache.integration.transformers.engine import KVGeometry, create_hf_engine, hf_engine_metadata
from lmcache.integration.transformers.llama_blend import BlendForwardOutput, LlamaBlendForward
from lmcache.integration.transformers.prefix_cache import PrefillOutput, PrefixCacheLM
from lmcache.integration.transformers.rope import rotary_encoders

__all__ = [
    "BlendForwardOutput", "BlendPrefillOutput", "CacheBlendLM", "HFKVConnector", "KVGeometry",
    "LlamaBlendForward", "PrefillOutput", "PrefixCacheLM", "create_hf_engine", "hf_engine_metadata",
    "rotary_encoders",
]
