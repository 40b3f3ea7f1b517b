"""Moving a piece's tokens between `KVSources` and a buffer laid out like the piece, with torch ops.

The portable row kernel: O(sources) torch operations per chunk group (an ``index_select`` /
``index_copy_`` of all the group's rows, or one strided copy when the group's slots are one
consecutive run, as for token-major caches). It runs on any device; on CPU it is the fallback
when the native kernel cannot be used and the kernel of the forced staged path.
"""

from __future__ import annotations

import torch

from lmcache.gpu_connector.sources import KVSources
from lmcache.gpu_connector.spans import ChunkGroup, Piece, group_view


def copy_piece_torch(gather: bool, sources: KVSources, piece: Piece, buffer: torch.Tensor,
                     slots: torch.Tensor, device_slots: torch.Tensor) -> None:
    """buffer: uint8 ``[>= piece.nbytes]`` on ``sources.device``, laid out like `piece`.
    slots / device_slots: the request's ``[N]`` int64 slots on the CPU / on ``sources.device``.
    gather: sources -> buffer; else buffer -> sources, skipping negative slots."""
    for group in piece.groups:
        blocks = group_view(buffer, group, sources.num_sources, sources.hidden, sources.dtype)
        host = slots[group.first_token: group.first_token + group.num_tokens]
        if not _copy_run(gather, sources, group, blocks, host):
            _copy_indexed(gather, sources, group, blocks, host, device_slots)


def _copy_run(gather: bool, sources: KVSources, group: ChunkGroup, blocks: torch.Tensor,
              host: torch.Tensor) -> bool:
    """One strided copy per source if the group's slots are one consecutive run; False if not."""
    first = int(host[0])
    if first < 0 or not torch.equal(host, torch.arange(first, first + host.numel())):
        return False
    views = [sources.run_view(s, first, group.num_tokens) for s in range(sources.num_sources)]
    if any(v is None for v in views):
        return False
    shape = (group.count, group.tokens, sources.num_heads, sources.head_size)
    for s, view in enumerate(views):
        assert view is not None
        block, rows = blocks[:, s].view(shape), view.view(shape)
        if gather:
            block.copy_(rows)
        else:
            rows.copy_(block)
    return True


def _copy_indexed(gather: bool, sources: KVSources, group: ChunkGroup, blocks: torch.Tensor,
                  host: torch.Tensor, device_slots: torch.Tensor) -> None:
    n = group.num_tokens
    idx = device_slots[group.first_token: group.first_token + n]
    keep = None
    if not gather and int(host.min()) < 0:
        keep = torch.nonzero(host >= 0).flatten().to(sources.device)
        idx = idx.index_select(0, keep)
    for s in range(sources.num_sources):
        block = blocks[:, s]  # [count, tokens, hidden]
        if gather:
            block.copy_(sources.gather_rows(s, idx).view(group.count, group.tokens, sources.hidden))
        else:
            rows = block.reshape(n, sources.hidden)
            sources.scatter_rows(s, idx, rows if keep is None else rows.index_select(0, keep))
