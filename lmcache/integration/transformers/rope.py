"""Positional encoders for CacheBlend built from an HF model's own rotary embedding.

`rotary_encoders(model)` returns ``(encode, reverse)``, both ``(positions [T], q [T, Hq*D],
k [T, Hk*D]) -> (q, k)``: `encode` applies RoPE at `positions` exactly as the model does (its
`rotary_emb` for cos/sin and its module's `apply_rotary_pos_emb`), `reverse` undoes it. Either
input may have zero width (e.g. only keys are moved). Rotations run in float32 and are cast back.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from lmcache.blend.interfaces import PositionalEncoder

QK = tuple[torch.Tensor, torch.Tensor]
_REMEMBERED = 4
ApplyRotary = Callable[..., QK]


def rotary_encoders(model: Any) -> tuple[PositionalEncoder, PositionalEncoder]:
    """``(encode, reverse)`` for a Llama-family `model` (``model.model.rotary_emb``)."""
    base = model.model
    attn = base.layers[0].self_attn
    apply = getattr(inspect.getmodule(type(attn)), "apply_rotary_pos_emb", None)
    if apply is None:
        raise ValueError(f"{type(attn).__name__}'s module has no apply_rotary_pos_emb; "
                         "this model family is not supported")
    return make_encoders(base.rotary_emb, attn.head_dim, apply)


def make_encoders(rotary_emb: torch.nn.Module, head_size: int,
                  apply_rotary: ApplyRotary) -> tuple[PositionalEncoder, PositionalEncoder]:
    """Encoders from a rotary embedding module (``forward(x, position_ids [1, T]) -> (cos, sin)``,
    each ``[1, T, head_size]``) and the matching ``apply_rotary(q, k, cos, sin, unsqueeze_dim)``."""
    scale = float(getattr(rotary_emb, "attention_scaling", 1.0))

    recent: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (positions, cos, sin)

    def cos_sin(positions: torch.Tensor, device: torch.device) -> QK:
        """cos/sin ``[T, head_size]`` in float32; the last few position sets are remembered
        (a blended prefill asks for the same ones in every layer)."""
        positions = positions.reshape(-1).to(device)
        for pos, cos, sin in recent:
            if pos.shape == positions.shape and torch.equal(pos, positions):
                return cos, sin
        probe = torch.empty(0, dtype=torch.float32, device=device)
        cos, sin = rotary_emb(probe, positions.unsqueeze(0))
        recent.insert(0, (positions.clone(), cos[0].float(), sin[0].float()))
        del recent[_REMEMBERED:]
        return recent[0][1], recent[0][2]

    def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> QK:
        n = k.shape[0]
        if q.shape[0] != n or cos.shape[0] != n:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and {cos.shape[0]} positions "
                             "must have the same number of tokens")
        q3 = q.reshape(n, q.shape[1:].numel() // head_size, head_size).float()
        k3 = k.reshape(n, k.shape[1:].numel() // head_size, head_size).float()
        q3, k3 = apply_rotary(q3, k3, cos, sin, unsqueeze_dim=1)
        return q3.reshape(q.shape).to(q.dtype), k3.reshape(k.shape).to(k.dtype)

    def encode(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> QK:
        cos, sin = cos_sin(positions, k.device)
        return rotate(q, k, cos, sin)

    def reverse(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> QK:
        cos, sin = cos_sin(positions, k.device)
        return rotate(q, k, cos / scale**2, -sin / scale**2)

    return encode, reverse
