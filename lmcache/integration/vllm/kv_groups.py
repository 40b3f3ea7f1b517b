"""What LMCache stores of each KV cache group vLLM gives the connector, or why it cannot serve a
model exactly.

vLLM splits a model's layers into KV cache groups (`KVCacheConfig.kv_cache_groups`): each group has
one spec and its own block table per request (block id 0 is vLLM's null block: nothing held).
`model_kv(vllm_config, kv_cache_config, config)` reads them into a `ModelKV`, or raises
`UnsupportedModel` with one message naming the model type and what is missing; the connector then
stays inactive and vLLM serves every request without it.

Attention kinds (`GroupKind`), stored per token in one chunk object per prefix chunk (chunk keys,
lookups and leases stay per request prefix, so a hit means every group can be served):

- ``FULL``: full attention. K and V of every token are kept while the request runs; all of them
  are stored and loaded.
- ``SLIDING``: sliding-window attention (window W). vLLM frees a request's blocks once they fall
  out of the window (`SlidingWindowManager.get_num_skipped_tokens`: a request that has computed n
  tokens reads only tokens from ``n - W + 1``). A chunk ending at token e can end a later hit of
  e (a longer prompt) or e - 1 (the same prompt, whose last token is recomputed), so its
  sliding-window rows hold the tokens vLLM keeps for a hit of e - 1: from the block holding token
  ``skipped(e - 1)`` on (`first_kept`). Those tokens are always still in vLLM's blocks when the
  chunk is stored (it is stored in the step that computes its last token, and vLLM frees only
  blocks below the window of the tokens computed before that step); rows below are zeros and are
  never loaded. (Chunks that vLLM's own prefix cache served, and whose kept rows it handed the
  request as null blocks, cannot be stored: `transfer.save_slots`.) A load writes only the blocks
  vLLM allocated for the hit (those in the window, at most one block beyond it), never its null
  blocks.
- ``MLA``: multi-head latent attention (DeepSeek): one latent of ``kv_lora_rank +
  qk_rope_head_dim`` values per token and layer, stored as such (chunks ``[1, layers, tokens,
  latent]``: no K/V split, no padding).

Recurrent layers (linear attention, Mamba; kind ``STATE``) keep no per-token KV but one state per
request. With vLLM's prefix caching on ("align" mamba cache mode) vLLM materializes the state only
where a prefill step ends: at block boundaries, and at the last multiple of its scheduling block
before a prompt's last token (`ModelKV.resume_points`); the state after ``n`` tokens is then in
block ``(n - 1) // block_size`` of the group's table. The connector stores, beside the chunks of
the attention layers, the state of every recurrent layer where a step ended at a chunk boundary
or at a resume point (its own key: the prefix's last chunk under `ModelKV.state_layout`, with the
trailing partial chunk stored too for a resume point inside a chunk), and a hit ends only at a
boundary whose state it holds: loading it puts the state where vLLM's own prefix cache would.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.config import LMCacheEngineConfig

NULL_BLOCK = 0  # vLLM's null block: a block-table entry holding nothing
CANONICAL_LAYOUT = "kv_blob"
MLA_LAYOUT = "mla_latent"  # [1, layers, tokens, latent]


class UnsupportedModel(ValueError):
    """The connector cannot serve this model exactly (the message says why)."""


class GroupKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"
    MLA = "mla"
    STATE = "state"


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: `index` is its position in the per-group block-id tuples."""

    index: int
    kind: GroupKind
    block_size: int
    layers: tuple[str, ...]
    window: int = 0  # SLIDING: vLLM's sliding_window
    retained: int = 0  # SLIDING: vLLM's extra_retained_tokens (kept below the window)
    state: str = ""  # STATE: the state's shapes and dtypes as vLLM's spec gives them

    def skipped(self, num_tokens: int) -> int:
        """Tokens a request that has computed `num_tokens` never reads again (vLLM frees their
        whole blocks)."""
        if self.kind != GroupKind.SLIDING:
            return 0
        return max(0, num_tokens - self.window + 1 - self.retained)

    def first_kept(self, end: int) -> int:
        """First token whose row a stored chunk ending at `end` holds for this group (see the
        module docstring); 0 for full attention."""
        return self.skipped(end - 1) // self.block_size * self.block_size

    def state_block(self, boundary: int) -> int:
        """STATE: the block-table position of the state after exactly `boundary` tokens."""
        return (boundary - 1) // self.block_size

    def tag(self) -> str:
        if self.kind == GroupKind.SLIDING:
            return f"swa{self.window}+{self.retained}/b{self.block_size}"
        if self.kind == GroupKind.STATE:
            return f"state{self.state}/b{self.block_size}"
        return self.kind.value


@dataclass(frozen=True)
class ModelKV:
    """The KV cache groups of one model, as LMCache stores them: every group's layers have
    `kv_count` tensors (K and V; or one MLA latent) of `num_kv_heads` x `head_size` values per
    token in `dtype`."""

    model_type: str
    groups: tuple[KVGroup, ...]
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_count: int = 2

    @property
    def token_groups(self) -> tuple[KVGroup, ...]:
        """The groups whose KV is stored per token (attention), in vLLM's order."""
        return tuple(g for g in self.groups if g.kind != GroupKind.STATE)

    @property
    def state_groups(self) -> tuple[KVGroup, ...]:
        """The groups of recurrent layers (a state per request)."""
        return tuple(g for g in self.groups if g.kind == GroupKind.STATE)

    @property
    def token_layers(self) -> tuple[str, ...]:
        """The layers stored per token, in chunk-row order (by layer index)."""
        return _by_index(self.token_groups)

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """For each of `token_layers`, the position of its group in `token_groups`."""
        where = {n: i for i, g in enumerate(self.token_groups) for n in g.layers}
        return tuple(where[n] for n in self.token_layers)

    @property
    def state_layers(self) -> tuple[tuple[str, KVGroup], ...]:
        """Each recurrent layer (by layer index) with its group."""
        group_of = {n: g for g in self.state_groups for n in g.layers}
        return tuple((n, group_of[n]) for n in _by_index(self.state_groups))

    @property
    def uniform(self) -> bool:
        """One full-attention group: the layout every engine (and HF transformers) shares."""
        return len(self.groups) == 1 and self.groups[0].kind == GroupKind.FULL

    def layout(self) -> str:
        """The stored layout's name, part of every cache key: "kv_blob" (the canonical K/V layout
        every engine and HF transformers share) for one full-attention group; "mla_latent" for
        MLA; otherwise "kv_blob+" and a digest of which layer holds which kind of attention or
        state (window, block size, state shapes), so a cache written for one layer structure never
        serves another."""
        if self.uniform:
            return CANONICAL_LAYOUT
        if self.kv_count == 1:
            return MLA_LAYOUT
        return f"{CANONICAL_LAYOUT}+{self._digest()}"

    def resume_points(self, num_tokens: int) -> list[int]:
        """Where vLLM may have kept the recurrent state before the last token of a prompt of
        `num_tokens` tokens (a hybrid model): it stops a prefill step at the last multiple of its
        scheduling block (a power of two from 16 tokens up to the state groups' block size) below
        the prompt's end. Sorted, distinct, positive."""
        block = self.state_groups[0].block_size if self.state_groups else 0
        sizes = {block} | {1 << k for k in range(4, block.bit_length()) if block % (1 << k) == 0}
        return sorted({(num_tokens - 1) // g * g for g in sizes if g} - {0})

    def state_layout(self) -> str:
        """The name under which recurrent states are keyed ("" for a model without them)."""
        return f"state+{self._digest()}" if self.state_groups else ""

    def _digest(self) -> str:
        group_of = {n: g for g in self.groups for n in g.layers}
        rows = ",".join(group_of[n].tag() for n in _by_index(self.groups))
        return hashlib.sha256(rows.encode()).hexdigest()[:16]


def model_kv(vllm_config: Any, kv_cache_config: Any, config: LMCacheEngineConfig) -> ModelKV:
    """The groups of `kv_cache_config` as LMCache stores them with `config`; `UnsupportedModel`
    otherwise."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    model_type = _model_type(vllm_config)

    def refuse(missing: str) -> UnsupportedModel:
        return unsupported(model_type, missing)

    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise refuse("vLLM gave the connector no KV cache configuration")
    chunk_size = config.chunk_size
    groups, specs, states = [], [], []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) is MambaSpec:
            if spec.mamba_cache_mode != "align" or spec.num_speculative_blocks:
                raise refuse(f"recurrent layers whose state vLLM keeps only for the running request "
                             f"(mamba_cache_mode={spec.mamba_cache_mode!r}, "
                             f"{spec.num_speculative_blocks} speculative blocks): enable vLLM's prefix "
                             "caching, without speculative decoding, so it keeps states at block boundaries")
            shapes = ";".join(f"{tuple(shape)}{dtype}" for shape, dtype in zip(spec.shapes, spec.dtypes))
            states.append(KVGroup(i, GroupKind.STATE, spec.block_size, tuple(group.layer_names),
                                  state=f"{spec.mamba_type.name}:{shapes}"))
            continue
        if type(spec) is FullAttentionSpec and not spec.attention_chunk_size:
            # (with vLLM's hybrid manager off, sliding-window layers come as full attention with a
            # window: their blocks are all kept, so storing everything is exact)
            kind = GroupKind.FULL
        elif type(spec) is SlidingWindowSpec:
            kind = GroupKind.SLIDING
        elif type(spec) is MLAAttentionSpec:
            kind = GroupKind.MLA
        else:
            raise refuse(f"KV cache group {i} is a {type(spec).__name__}, which the connector does "
                         "not store")
        if not getattr(group, "enable_kv_transfer", True):
            raise refuse(f"KV cache group {i} is not transferable")
        if spec.block_size <= 0 or chunk_size % spec.block_size:
            raise refuse(f"lmcache.chunk_size={chunk_size} is not a multiple of vLLM's block size "
                         f"{spec.block_size}; set lmcache.chunk_size to a multiple of it")
        groups.append(KVGroup(i, kind, spec.block_size, tuple(group.layer_names),
                              getattr(spec, "sliding_window", 0) if kind == GroupKind.SLIDING else 0,
                              getattr(spec, "extra_retained_tokens", 0)))
        specs.append(spec)
    if not groups:
        raise refuse("no attention layers (only recurrent state)")
    first = specs[0]
    assert isinstance(first, AttentionSpec)
    sizes = sorted({g.block_size for g in groups + states})
    if len(sizes) > 1:
        raise refuse(f"KV cache groups with different block sizes ({sizes})")
    mla = [g.kind == GroupKind.MLA for g in groups]
    if any(mla) and not all(mla):
        raise refuse("MLA layers beside other kinds of attention")
    for spec in specs:
        cache_dtype = getattr(spec, "cache_dtype_str", None)
        if spec.kv_quant_mode != KVQuantMode.NONE or cache_dtype not in (None, "auto"):
            raise refuse(f"a quantized KV cache ({spec.kv_quant_mode.name}, {cache_dtype or spec.dtype}: "
                         "LMCache stores unquantized KV only; run with kv_cache_dtype='auto' to use it)")
        if not any(mla) and spec.head_size_v != spec.head_size:
            raise refuse(f"different K and V head sizes ({spec.head_size} and {spec.head_size_v})")
        if (spec.num_kv_heads, spec.head_size, spec.dtype) != (first.num_kv_heads, first.head_size,
                                                               first.dtype):
            raise refuse("attention layers with different KV shapes or dtypes "
                         f"({first.num_kv_heads}x{first.head_size} {first.dtype} and "
                         f"{spec.num_kv_heads}x{spec.head_size} {spec.dtype})")
    model = ModelKV(model_type, tuple(sorted(groups + states, key=lambda g: g.index)), first.num_kv_heads,
                    first.head_size, first.dtype, kv_count=1 if any(mla) else 2)
    serdes = {config.remote_serde if config.remote_url else None,
              config.local_disk_serde if config.local_disk else None}
    if "cachegen" in serdes and (model.kv_count == 1 or states):
        raise refuse("CacheGen (lmcache.remote_serde / local_disk_serde) codes K and V, not "
                     f"{'MLA latents' if model.kv_count == 1 else 'recurrent states'}; choose another "
                     "serde for this model")
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    if not model.uniform and device != "cpu":
        raise refuse(f"{'MLA' if any(mla) else f'{len(groups)} KV cache groups'} on {device} (served on "
                     "vLLM-CPU only so far)")
    return model


def _by_index(groups: tuple[KVGroup, ...]) -> tuple[str, ...]:
    return tuple(sorted((n for g in groups for n in g.layers), key=layer_index))


def unsupported(model_type: str, missing: str) -> UnsupportedModel:
    """The refusal of a model: the one message the connector logs (see the module docstring)."""
    return UnsupportedModel(f"LMCache cannot serve {model_type} models exactly: {missing}. The "
                            "connector is inactive for this engine; vLLM serves every request without it.")


def _model_type(vllm_config: Any) -> str:
    hf_config = getattr(vllm_config.model_config, "hf_config", None)
    return str(getattr(hf_config, "model_type", None) or "this model's")


def layer_index(name: str) -> tuple[int, str]:
    """Sort key of a layer name: its first number ("model.layers.12.attn" -> 12), then the name."""
    digits = ""
    for ch in name:
        if ch.isdigit():
            digits += ch
        elif digits:
            break
    return (int(digits) if digits else 0, name)
