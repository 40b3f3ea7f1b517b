"""`KVSources`: an engine's KV cache as 2 * num_layers tensors addressed by slot.

Every layout (paged flash-attention / FlashInfer / (K, V) tuples, token-major and HF tensors)
becomes the same thing: all K tensors, then all V tensors, each a ``[num_blocks, block_size,
num_heads, head_size]`` view in whatever strides the engine uses; token-major tensors are
``[T, 1, H, D]`` views (block size 1, slot = token position). A token's slot is
``block * block_size + offset``. The row access helpers here are the pure-torch way to move rows;
the native CPU kernel and the Triton kernel read the same geometry.
"""

from __future__ import annotations

from functools import cached_property

import torch


class KVSources:
    def __init__(self, tensors: list[torch.Tensor], hidden: int) -> None:
        first = tensors[0]
        if first.dim() != 4:
            raise ValueError(f"KV source views must be [num_blocks, block_size, heads, head_size], got "
                             f"{tuple(first.shape)}")
        for t in tensors:
            if (t.shape != first.shape or t.dtype != first.dtype or t.device != first.device
                    or t.shape[2] * t.shape[3] != hidden):
                raise ValueError("KV tensors must all be [num_blocks, block_size, heads, head_size] with "
                                 f"heads * head_size = {hidden} and one dtype/device, got "
                                 f"{tuple(t.shape)} {t.dtype} {t.device}")
        self.tensors = tensors
        self.hidden = hidden
        self.device, self.dtype = first.device, first.dtype
        self.num_blocks, self.block_size, self.num_heads, self.head_size = (int(x) for x in first.shape)
        self.num_slots = self.num_blocks * self.block_size
        self.flat = [_flat_rows(t, hidden) for t in tensors]

    @property
    def num_sources(self) -> int:
        return len(self.tensors)

    @cached_property
    def native_ptrs(self) -> torch.Tensor | None:
        """int64 CPU tensor of each source's address when every source is ``[num_slots, hidden]``
        contiguous rows in CPU memory (what the native kernel takes), else None."""
        if self.device.type != "cpu" or not all(f is not None and f.is_contiguous() for f in self.flat):
            return None
        return torch.tensor([t.data_ptr() for t in self.tensors], dtype=torch.int64)

    @cached_property
    def uniform_strides(self) -> tuple[int, int, int] | None:
        """(block, token, head) element strides shared by every source, with the head dimension
        contiguous (what the Triton kernel takes); None otherwise."""
        strides = {t.stride() for t in self.tensors}
        if len(strides) != 1:
            return None
        block, token, head, dim = strides.pop()
        return (block, token, head) if dim == 1 or self.head_size == 1 else None

    def element_offsets(self) -> torch.Tensor | None:
        """``[num_sources]`` int64: each source's address minus the first's, in elements (None if a
        difference is not a whole number of elements). Computed once per object (read-only)."""
        return self._element_offsets

    @cached_property
    def _element_offsets(self) -> torch.Tensor | None:
        base, size = self.tensors[0].data_ptr(), self.tensors[0].element_size()
        diffs = [t.data_ptr() - base for t in self.tensors]
        if any(d % size for d in diffs):
            return None
        return torch.tensor([d // size for d in diffs], dtype=torch.int64)

    # ---- torch row access -----------------------------------------------------------------------

    def gather_rows(self, s: int, slots: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` rows of source `s` at `slots` (a new tensor; slots on `device`, >= 0)."""
        flat = self.flat[s]
        if flat is not None:
            return flat.index_select(0, slots)
        t = self.tensors[s]
        return t[slots // self.block_size, slots % self.block_size].reshape(-1, self.hidden)

    def scatter_rows(self, s: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows [N, hidden]`` into source `s` at `slots` (on `device`, >= 0)."""
        flat = self.flat[s]
        if flat is not None:
            flat.index_copy_(0, slots, rows)
            return
        t = self.tensors[s]
        t.index_put_((slots // self.block_size, slots % self.block_size),
                     rows.reshape(-1, self.num_heads, self.head_size))

    def run_view(self, s: int, first: int, n: int) -> torch.Tensor | None:
        """Slots ``first .. first + n - 1`` of source `s` as one ``[n, H, D]`` view, if they are
        one strided run (rows of a flat source, a token-major source, or within one block)."""
        flat = self.flat[s]
        if flat is not None:
            return flat[first: first + n].view(n, self.num_heads, self.head_size)
        t = self.tensors[s]
        if self.block_size == 1:
            return t[first: first + n, 0]
        block, offset = divmod(first, self.block_size)
        if offset + n <= self.block_size:
            return t[block, offset: offset + n]
        return None


def _flat_rows(t: torch.Tensor, hidden: int) -> torch.Tensor | None:
    """`t` as a ``[num_slots, hidden]`` view, if its strides allow one."""
    try:
        return t.view(-1, hidden)
    except RuntimeError:
        return None
