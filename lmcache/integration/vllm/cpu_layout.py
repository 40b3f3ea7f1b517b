"""vLLM-CPU's packed KV block layout, probed with vLLM's own cache-write kernel.

vLLM-CPU keeps each layer's cache as ``kv [num_blocks, num_kv_heads, block_size, 2*head_size]``;
the slab of one (block, head) holds ``2 * block_size * head_size`` elements, K first then V, in an
order chosen by an ISA-specific kernel (`cpu_attn_reshape_and_cache`). Rather than hard-coding that
order, `probe_packed_layout` writes each element's own index through the real kernel and reads back
where it landed, giving permutations ``k_perm``/``v_perm`` such that for one flattened block
``flat = kv[b].reshape(-1)``: ``K[bs, h, d] = flat[k_perm]`` and ``V[bs, h, d] = flat[v_perm]``.

On the ``vec``/``vec16`` ISAs (x86 without AMX) the probe finds K dim-major (element (t, j) at
``j * bs + t``) and V token-major inside each (block, head) slab; `token_views` then gives zero-copy
strided ``[num_blocks, bs, h, d]`` views of K and V. Other layouts (AMX tiles) are handled through
the permutations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

_BASE = 64  # values 0..63 are exact in every float dtype the kernel supports


@dataclass(frozen=True)
class PackedLayout:
    num_kv_heads: int
    head_size: int
    block_size: int
    isa: str
    k_perm: torch.Tensor  # [bs * h * d] indices into one flattened block
    v_perm: torch.Tensor

    @functools.cached_property
    def is_vec(self) -> bool:
        """K dim-major and V token-major inside each (block, head) slab."""
        h, d, bs = self.num_kv_heads, self.head_size, self.block_size
        t = torch.arange(bs).view(bs, 1, 1)
        hh = torch.arange(h).view(1, h, 1)
        j = torch.arange(d).view(1, 1, d)
        slab = hh * 2 * bs * d
        k_expected = (slab + j * bs + t).flatten()
        v_expected = (slab + bs * d + t * d + j).flatten()
        return torch.equal(self.k_perm, k_expected) and torch.equal(self.v_perm, v_expected)

    def token_views(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy K and V views ``[num_blocks, bs, h, d]`` of one layer's cache (vec only)."""
        if not self.is_vec:
            raise ValueError(f"layout of ISA {self.isa!r} has no strided token views")
        nb, h, bs, d = kv.shape[0], self.num_kv_heads, self.block_size, self.head_size
        k = kv.view(nb, h, 2, d, bs)[:, :, 0].permute(0, 3, 1, 2)
        v = kv.view(nb, h, 2, bs, d)[:, :, 1].permute(0, 2, 1, 3)
        return k, v


def default_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU attention backend picks for this configuration."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size, "auto"))


def _write(kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
           isa: str) -> None:
    """Exactly what vLLM's CPU attention backend does to write new K/V into the cache."""
    import vllm._custom_ops as ops

    nb, h, bs, _ = kv.shape
    key_cache, value_cache = kv.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


@functools.cache
def probe_packed_layout(num_kv_heads: int, head_size: int, block_size: int,
                        dtype: torch.dtype = torch.bfloat16, isa: str | None = None) -> PackedLayout:
    """Derive the layout by writing known values through vLLM's kernel into a 3-block cache.
    Raises RuntimeError if the kernel is not a pure permutation within the addressed block."""
    h, d, bs = num_kv_heads, head_size, block_size
    isa = isa or default_isa(dtype, bs, d)
    n = bs * h * d
    canonical = torch.arange(2 * n, dtype=torch.int64)  # K: [0, n), V: [n, 2n)
    passes = 1
    while _BASE**passes < 2 * n:
        passes += 1
    slots = torch.arange(bs, dtype=torch.int64) + bs  # the middle block
    decoded = torch.zeros(2 * n, dtype=torch.int64)
    for p in range(passes):
        digit = (canonical // _BASE**p) % _BASE
        kv = torch.full((3, h, bs, 2 * d), -1.0, dtype=dtype)
        _write(kv, digit[:n].view(bs, h, d).to(dtype), digit[n:].view(bs, h, d).to(dtype), slots, isa)
        if not (bool((kv[0] == -1).all()) and bool((kv[2] == -1).all())):
            raise RuntimeError(f"vLLM-CPU kernel ({isa}) wrote outside the addressed block")
        got = kv[1].reshape(-1).to(torch.float64)
        if bool((got < 0).any()) or not bool((got == got.round()).all()):
            raise RuntimeError(f"vLLM-CPU kernel ({isa}) does not store K/V as a permutation")
        decoded += got.to(torch.int64) * _BASE**p
    if not torch.equal(decoded.sort().values, canonical):
        raise RuntimeError(f"vLLM-CPU kernel ({isa}) block is not a permutation of K and V")
    perm = torch.empty(2 * n, dtype=torch.int64)
    perm[decoded] = torch.arange(2 * n, dtype=torch.int64)
    return PackedLayout(h, d, bs, isa, perm[:n].clone(), perm[n:].clone())
