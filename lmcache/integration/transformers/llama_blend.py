"""`LlamaBlendForward`: a layer-by-layer prefill of an HF Llama-family model (Llama, Mistral
without sliding window, Qwen2, SmolLM, ...; batch 1) that uses CacheBlend.

For each decoder layer: Q/K/V of the tokens still computed are projected and RoPE'd at their
positions; the executor returns the short Q and the long blended K/V (before the check layer all
tokens are computed: full KV recompute; at the check layer it keeps the tokens to recompute); the
attention of the short Q over the long K/V (causal by position), the output projection and the MLP
then run for those tokens only. The blended K/V of every layer go into a `DynamicCache`, so
decoding continues from it with the unmodified model.

Tokens marked in `force_recompute` (the query after the last segment, and always the last token)
are treated as having no valid retrieved KV, so they are computed in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from lmcache.blend.executor import CacheBlendImpl
from lmcache.blend.interfaces import BlendRetrieverTask
from lmcache.integration.transformers.engine import KVGeometry
from lmcache.integration.transformers.rope import rotary_encoders

_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
QUERY_BUCKETS = 4


@dataclass
class BlendForwardOutput:
    """logits: ``[vocab]`` next-token logits after the last input token. past_key_values: the
    blended KV of all T input tokens. recomputed: input indices of the tokens computed in the last
    layer (ascending)."""

    logits: torch.Tensor
    past_key_values: DynamicCache
    recomputed: torch.Tensor


def check_llama_family(model: Any) -> None:
    """Raise ValueError unless `model` has the Llama decoder structure this forward replicates."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    parts = ("embed_tokens", "norm", "rotary_emb")
    if base is None or layers is None or not all(hasattr(base, a) for a in parts) \
            or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} is not a Llama-family causal LM "
                         "(model.model.{embed_tokens, layers, norm, rotary_emb} and lm_head)")
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if not all(hasattr(layer, p) for p in _LAYER_PARTS) or not all(hasattr(attn, p) for p in _ATTN_PARTS):
            raise ValueError(f"{type(layer).__name__} is not a Llama-style decoder layer")
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            raise ValueError(f"{type(attn).__name__} normalises Q/K; not supported by the blend forward")
    cfg = model.config.get_text_config(decoder=True)
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", bool(getattr(cfg, "sliding_window", None))) or any(
            t != "full_attention" for t in layer_types):
        raise ValueError("sliding-window attention is not supported by the blend forward")


class LlamaBlendForward:
    def __init__(self, model: Any, executor: CacheBlendImpl) -> None:
        check_llama_family(model)
        self.model = model
        self.executor = executor
        self.geometry = KVGeometry.of(model)
        beyond = [layer for layer in executor.check_layers if layer >= self.geometry.num_layers]
        if beyond:
            raise ValueError(f"check layers {beyond} (blend_check_layers) are beyond the model's "
                             f"{self.geometry.num_layers} layers: no token would ever be selected")
        self.encode, reverse = rotary_encoders(model)
        executor.set_positional_encoder(self.encode)
        executor.set_reverse_positional_encoder(reverse)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, task: BlendRetrieverTask,
                 force_recompute: torch.Tensor | None = None) -> BlendForwardOutput:
        """input_ids: ``[T]``. task: the retrieval of these tokens' KV. force_recompute: CPU bool
        ``[T]`` of tokens whose retrieved KV must not be used (the last token always is)."""
        base = self.model.model
        device = base.embed_tokens.weight.device
        num_tokens = input_ids.numel()
        if input_ids.dim() != 1 or num_tokens == 0:
            raise ValueError(f"input_ids must be non-empty token ids of shape [T], got shape "
                             f"{tuple(input_ids.shape)}")
        forced = torch.zeros(num_tokens, dtype=torch.bool)
        if force_recompute is not None:
            if force_recompute.shape != (num_tokens,):
                raise ValueError(f"force_recompute must be a bool mask of shape ({num_tokens},), got "
                                 f"shape {tuple(force_recompute.shape)}")
            forced |= force_recompute.to("cpu", torch.bool)
        forced[-1] = True
        no_kv = torch.zeros(num_tokens, dtype=torch.bool)
        query_start_loc = torch.tensor([0, num_tokens], device=device)
        positions = torch.arange(num_tokens, device=device)
        hidden = base.embed_tokens(input_ids.to(device))
        cache = DynamicCache(config=self.model.config)
        for layer_id, layer in enumerate(base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q, k = self.encode(positions, attn.q_proj(x), attn.k_proj(x))
            v = attn.v_proj(x)
            if self.executor.uses_retrieved_kv(layer_id):
                got = task.result(layer_id)
                rk, rv, valid, orig = got.k, got.v, got.valid_mask & ~forced, got.original_positions
            else:
                rk, rv, valid, orig = None, None, no_kv, positions
            out = self.executor.blend(layer_id, rk, rv, valid, orig, q, k, v, positions,
                                      query_start_loc, 0)
            if out.local_indices.numel() != hidden.shape[0]:
                hidden = hidden.index_select(0, out.local_indices)
            positions = out.positions
            attended = self._attention(attn, out.q, out.k, out.v, positions)
            hidden = hidden + attn.o_proj(attended)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            cache.update(self._hf_layout(out.k), self._hf_layout(out.v), layer_id)
        if int(positions[-1]) != num_tokens - 1:
            raise RuntimeError("the executor dropped the last input token; it must always be recomputed")
        logits = self.model.lm_head(base.norm(hidden[-1:]))[0]
        return BlendForwardOutput(logits, cache, positions.clone())

    def _attention(self, attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_positions: torch.Tensor) -> torch.Tensor:
        """Causal attention of the short ``q [S, Hq*D]`` (at ascending `q_positions`) over the
        long ``k, v [T, Hk*D]`` (token t at position t) -> ``[S, Hq*D]``. Scattered queries are
        cut into `QUERY_BUCKETS` runs, each reading only the keys up to its last position, which
        roughly halves the work of one masked pass over all T keys."""
        geo = self.geometry
        s, t, d = q.shape[0], k.shape[0], geo.head_size
        q4 = q.view(s, geo.num_heads, d).transpose(0, 1).unsqueeze(0)
        k4 = k.view(t, geo.num_kv_heads, d).transpose(0, 1).unsqueeze(0)
        v4 = v.view(t, geo.num_kv_heads, d).transpose(0, 1).unsqueeze(0)
        if s == t:
            o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=attn.scaling,
                                               enable_gqa=True)
        else:
            parts = []
            for run in torch.arange(s, device=q.device).tensor_split(min(QUERY_BUCKETS, max(s, 1))):
                pos = q_positions[run]
                n_keys = int(pos[-1]) + 1
                mask = torch.arange(n_keys, device=k.device).unsqueeze(0) <= pos.unsqueeze(1)
                parts.append(F.scaled_dot_product_attention(
                    q4[:, :, run], k4[:, :, :n_keys], v4[:, :, :n_keys], attn_mask=mask,
                    scale=attn.scaling, enable_gqa=True))
            o = torch.cat(parts, dim=2)
        return o[0].transpose(0, 1).reshape(s, geo.num_heads * d)

    def _hf_layout(self, kv: torch.Tensor) -> torch.Tensor:
        """``[T, Hk*D]`` -> ``[1, Hk, T, D]`` (a view; the cache copies it)."""
        geo = self.geometry
        return kv.view(kv.shape[0], geo.num_kv_heads, geo.head_size).transpose(0, 1).unsqueeze(0)
