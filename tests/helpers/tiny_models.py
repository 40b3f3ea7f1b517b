"""Small random-weight checkpoints of today's model families, built locally for vLLM-CPU tests and
benchmarks (nothing downloaded): transformers' config classes, seeded random weights and the local
SmolLM2 tokenizer. Each is a few MB and builds in seconds; the folder is cached by its spec.

`tiny_model_path(arch)` -> a local HF folder vLLM serves. The architectures (`ARCHS`):

- ``llama``: Llama (full attention everywhere), 4 layers.
- ``gemma3``: Gemma 3, sliding window 512 on 5 of every 6 layers (6 layers), fp32.
- ``gpt_oss``: gpt-oss, alternating sliding window 128 / full attention with sinks, MoE (4 layers), fp32.
- ``deepseek_v2``: DeepSeek-V2, MLA with a 512 + 64 latent, MoE after the first layer, bf16.
- ``qwen3_next``: Qwen3-Next, gated-delta-net linear attention on 3 of every 4 layers, MoE, bf16
  (vLLM-CPU's gated-delta-net kernel needs bf16).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TinySpec:
    config_class: str
    model_type: str  # the config's model_type, as vLLM names the model
    dtype: str
    fields: dict[str, Any] = field(default_factory=dict)


_COMMON = {"vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": False,
           "initializer_range": 0.08}

ARCHS: dict[str, TinySpec] = {
    "llama": TinySpec("LlamaConfig", "llama", "float32", {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}),
    "gemma3": TinySpec("Gemma3TextConfig", "gemma3_text", "float32", {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "sliding_window": 512, "query_pre_attn_scalar": 64}),
    "gpt_oss": TinySpec("GptOssConfig", "gpt_oss", "float32", {
        "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "sliding_window": 128, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v2": TinySpec("DeepseekV2Config", "deepseek_v2", "bfloat16", {
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
        "v_head_dim": 64, "head_dim": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "greedy"}),
    "qwen3_next": TinySpec("Qwen3NextConfig", "qwen3_next", "bfloat16", {
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2}),
}


def _root() -> Path:
    env = os.environ.get("LMCACHE_MODEL_DIR")
    base = Path(env) if env else Path.home() / ".cache" / "lmcache" / "models"
    return base / "tiny"


def tiny_model_path(arch: str, seed: int = 0) -> str:
    """A local HF folder with a random-weight `arch` checkpoint (built once, then reused)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(ARCHS)}")
    spec = ARCHS[arch]
    ident = json.dumps([spec.config_class, spec.dtype, spec.fields, _COMMON, seed], sort_keys=True)
    dst = _root() / f"{arch}-{hashlib.sha256(ident.encode()).hexdigest()[:10]}"
    if (dst / "config.json").is_file() and (dst / "model.safetensors").is_file():
        return str(dst)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcache.integration.local_model import local_model_path

    tokenizer = AutoTokenizer.from_pretrained(local_model_path("float32"))
    config = getattr(transformers, spec.config_class)(
        **_COMMON, **spec.fields, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".tmp-", dir=dst.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, dst)
        except OSError:  # another process built it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)
