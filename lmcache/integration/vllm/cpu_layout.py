"""vLLM-CPU's packed KV block layout, probed with vLLM's own cache-write kernel.

vLLM-CPU keeps each layer's cache as ``kv [num_blocks, num_kv_heads, block_size, 2*head_size]``;
the slab of one (block, head) holds ``2 * block_size * head_size`` elements, K first then V, in an
order chosen by an ISA-specific kernel (`cpu_attn_reshape_and_cache`). Rather than hard-coding that
order, `probe_packed_layout` writes each element's own index through the real kernel and reads back
where it landed, giving permutations ``k_perm``/``v_perm`` such that for one flattened block
``flat = kv[b].reshape(-1)``: ``K[bs, h, d] = flat[k_perm]`` and ``V[bs, h, d] = flat[v_perm]``.

Every layout vLLM-CPU 0.32 writes on x86 fits a closed form (`closed_form_layout`; checked against
the permutations vLLM's kernel produced on an AMX machine, `tests/data/vllm_cpu_layouts`), named by
`PackedLayout.kind`:

- ``"vec"`` (ISAs ``vec`` and ``vec16``): inside each (block, head) slab K is dim-major (element
  (t, j) at ``j * bs + t``) and V token-major (``bs * d + t * d + j``); `token_views` gives
  zero-copy strided ``[num_blocks, bs, h, d]`` views of K and V.
- ``"amx"`` (ISA ``amx``, bf16): K in 16-token tiles ``[d/2][16][2]`` (element (t, j) at
  ``(t // 16) * 16 * d + (j // 2) * 32 + (t % 16) * 2 + j % 2``), V in 16-dim tiles
  ``[bs/2][16][2]`` (``bs * d + (j // 16) * bs * 16 + (t // 2) * 32 + (j % 16) * 2 + t % 2``).

`packed_layout` probes vLLM's kernel where it runs (the truth on this machine) and checks it
against the closed form of its ISA: a kernel build that packs otherwise (a vLLM upgrade, a build
nobody measured) raises `LayoutMismatch`, and the connector refuses to serve rather than guess.
Where the kernel cannot run, the closed form is used; an ISA with no closed form (not x86) is copied
exactly through the probed permutations.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from lmcache.integration.vllm.cpu_build import describe

logger = logging.getLogger(__name__)

_BASE = 64  # values 0..63 are exact in every float dtype the kernel supports
KINDS = ("vec", "amx")  # the layouts with a closed form (and a native copy)
_ISA_KINDS = {"vec": "vec", "vec16": "vec", "amx": "amx"}  # vLLM's x86 ISAs -> the layout written


class LayoutMismatch(ValueError):
    """vLLM's cache-write kernel packs KV otherwise than the closed form of its ISA (or not as a
    permutation of K and V at all)."""


@dataclass(frozen=True)
class PackedLayout:
    num_kv_heads: int
    head_size: int
    block_size: int
    isa: str
    k_perm: torch.Tensor  # [bs * h * d] indices into one flattened block
    v_perm: torch.Tensor

    @functools.cached_property
    def kind(self) -> str | None:
        """Which closed form the permutations are ("vec", "amx"), or None."""
        for kind in KINDS:
            k, v = closed_form(kind, self.num_kv_heads, self.head_size, self.block_size)
            if torch.equal(self.k_perm, k) and torch.equal(self.v_perm, v):
                return kind
        return None

    @property
    def is_vec(self) -> bool:
        """K dim-major and V token-major inside each (block, head) slab."""
        return self.kind == "vec"

    def token_views(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy K and V views ``[num_blocks, bs, h, d]`` of one layer's cache (vec only)."""
        if not self.is_vec:
            raise ValueError(f"layout of ISA {self.isa!r} has no strided token views")
        nb, h, bs, d = kv.shape[0], self.num_kv_heads, self.block_size, self.head_size
        k = kv.view(nb, h, 2, d, bs)[:, :, 0].permute(0, 3, 1, 2)
        v = kv.view(nb, h, 2, bs, d)[:, :, 1].permute(0, 2, 1, 3)
        return k, v


def closed_form(kind: str, num_kv_heads: int, head_size: int, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_perm, v_perm) of a layout `kind` (see the module docstring), int64 ``[bs * h * d]``."""
    h, d, bs = num_kv_heads, head_size, block_size
    t = torch.arange(bs).view(bs, 1, 1)
    slab = torch.arange(h).view(1, h, 1) * 2 * bs * d
    j = torch.arange(d).view(1, 1, d)
    if kind == "vec":
        k, v = j * bs + t, bs * d + t * d + j
    elif kind == "amx":
        if d % 2 or bs % 16:
            raise ValueError(f"the amx layout needs an even head size and 16-token tiles, not d={d}, bs={bs}")
        k = (t // 16) * 16 * d + (j // 2) * 32 + (t % 16) * 2 + j % 2
        v = bs * d + (j // 16) * bs * 16 + (t // 2) * 32 + (j % 16) * 2 + t % 2
    else:
        raise ValueError(f"no closed form for layout {kind!r}; known: {KINDS}")
    return (slab + k).flatten(), (slab + v).flatten()


def isa_kind(isa: str) -> str:
    """The layout kind vLLM's kernel writes for `isa` ("vec16" writes the vec layout)."""
    if isa not in _ISA_KINDS:
        raise ValueError(f"no known layout for vLLM-CPU ISA {isa!r}")
    return _ISA_KINDS[isa]


def closed_form_layout(num_kv_heads: int, head_size: int, block_size: int, isa: str) -> PackedLayout:
    """The layout vLLM's kernel writes for `isa`, from its closed form (no vLLM needed)."""
    k, v = closed_form(isa_kind(isa), num_kv_heads, head_size, block_size)
    return PackedLayout(num_kv_heads, head_size, block_size, isa, k, v)


@functools.cache
def packed_layout(num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype = torch.bfloat16,
                  isa: str | None = None) -> PackedLayout:
    """The layout of vLLM-CPU's caches for `isa` (default: the ISA vLLM picks on this CPU):
    probed with vLLM's kernel where it runs and checked against the ISA's closed form
    (`LayoutMismatch` if they differ), else the closed form."""
    try:
        isa = isa or default_isa(dtype, block_size, head_size)
        probed = probe_packed_layout(num_kv_heads, head_size, block_size, dtype, isa)
    except (ImportError, RuntimeError, AttributeError) as e:
        if isa is None:
            raise ValueError("vLLM is not installed: name the ISA of the layout") from e
        logger.info("vLLM-CPU's cache write kernel (%s) does not run here (%s); using its layout's "
                    "closed form", isa, e)
        return closed_form_layout(num_kv_heads, head_size, block_size, isa)
    if isa not in _ISA_KINDS:
        logger.info("vLLM-CPU's ISA %s has no closed form: copying its probed permutation", isa)
        return probed
    if probed.kind != isa_kind(isa):
        raise LayoutMismatch(f"{describe(isa)} packs KV blocks (heads {num_kv_heads}, head size {head_size}, "
                             f"block size {block_size}, {dtype}) otherwise than the {isa_kind(isa)} layout "
                             f"LMCache knows for that ISA")
    return probed


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
    Raises `LayoutMismatch` if the kernel ran but did not write a pure permutation of K and V
    within the addressed block; the kernel's own errors (it does not run here) propagate."""
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
            raise LayoutMismatch(f"vLLM-CPU kernel ({isa}) wrote outside the addressed block")
        got = kv[1].reshape(-1).to(torch.float64)
        if bool((got < 0).any()) or not bool((got == got.round()).all()):
            raise LayoutMismatch(f"vLLM-CPU kernel ({isa}) does not store K/V as a permutation")
        decoded += got.to(torch.int64) * _BASE**p
    if not torch.equal(decoded.sort().values, canonical):
        raise LayoutMismatch(f"vLLM-CPU kernel ({isa}) block is not a permutation of K and V")
    perm = torch.empty(2 * n, dtype=torch.int64)
    perm[decoded] = torch.arange(2 * n, dtype=torch.int64)
    return PackedLayout(h, d, bs, isa, perm[:n].clone(), perm[n:].clone())
