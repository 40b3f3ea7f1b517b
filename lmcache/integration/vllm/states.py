"""A hybrid model's recurrent state at one chunk boundary, between vLLM's state blocks and one flat
byte buffer (see `kv_groups` for where vLLM keeps it).

Each recurrent layer's cache is one tensor, or a list of them (e.g. conv and SSM state), indexed by
block first; the state after exactly ``p`` tokens is the layer's entry at block
``block_ids[group][p // block_size - 1]``. The buffer holds every layer's entries, layer after
layer, as raw bytes: a state goes back bit for bit, whatever its dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache.integration.vllm.kv_groups import NULL_BLOCK, KVGroup


class StateCopier:
    def __init__(self, layers: Sequence[tuple[Any, KVGroup]]) -> None:
        """`layers`: each recurrent layer's cache (a tensor or a list of tensors) with its group."""
        self.parts: list[tuple[torch.Tensor, KVGroup]] = []
        for cache, group in layers:
            for t in cache if isinstance(cache, (list, tuple)) else [cache]:
                if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t[0].is_contiguous():
                    shape = tuple(getattr(t, "shape", ()))
                    raise ValueError("a recurrent layer's cache must be [num_blocks, ...] tensors with "
                                     f"contiguous blocks, got {type(t).__name__} {shape}")
                self.parts.append((t, group))
        self.sizes = [t[0].numel() * t.element_size() for t, _ in self.parts]
        self.nbytes = sum(self.sizes)

    def _blocks(self, block_ids: Sequence[Sequence[int]], boundary: int) -> list[int] | None:
        """Each part's block holding the state after `boundary` tokens (None if one is not held)."""
        out = []
        for t, group in self.parts:
            i = group.state_block(boundary)
            table = block_ids[group.index]
            if not 0 <= i < len(table) or table[i] == NULL_BLOCK or table[i] >= t.shape[0]:
                return None
            out.append(table[i])
        return out

    def gather(self, block_ids: Sequence[Sequence[int]], boundary: int, out: torch.Tensor) -> bool:
        """Copy the state after `boundary` tokens into `out` (``[nbytes]`` uint8); False (nothing
        copied) if vLLM does not hold it."""
        blocks = self._blocks(block_ids, boundary)
        if blocks is None:
            return False
        offset = 0
        for (t, _), size, block in zip(self.parts, self.sizes, blocks, strict=True):
            out[offset: offset + size].copy_(t[block].reshape(-1).view(torch.uint8))
            offset += size
        return True

    def scatter(self, block_ids: Sequence[Sequence[int]], boundary: int, src: torch.Tensor) -> bool:
        """Write the state in `src` (``[nbytes]`` uint8) where vLLM keeps the state after
        `boundary` tokens; False (nothing written) if vLLM allocated no block for it."""
        blocks = self._blocks(block_ids, boundary)
        if blocks is None:
            return False
        offset = 0
        for (t, _), size, block in zip(self.parts, self.sizes, blocks, strict=True):
            entry = t[block]
            entry.copy_(src[offset: offset + size].view(t.dtype).view(entry.shape))
            offset += size
        return True
