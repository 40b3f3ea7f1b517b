"""`CacheBlendImpl`: reuse KV that was computed for other positions/contexts, recomputing only the
tokens whose KV deviates most (CacheBlend).

Per input, layer by layer (the caller computes fresh Q/K/V of the tokens still being computed and
applies its own positions to them):

- layers before the first check layer: every token is computed; the long K/V is the fresh K/V;
- a check layer (``check_layers``, default [1]): the retrieved K, moved from its original
  positions to the new ones (RoPE correction), is compared with the fresh K; per request the
  tokens without valid retrieved KV plus the `recompute_ratio` fraction of the valid ones whose
  fresh K deviates most (squared L2) are kept, the others stop being computed. With several check
  layers the kept fraction shrinks geometrically (ratio^(i/n) at the i-th of n) — gradual filtering;
- every later layer: Q of the kept tokens only, against the long K/V = retrieved KV (moved to the
  new positions) with the kept tokens' fresh K/V written in.

A new input starts whenever `blend` is called for a layer at or before the first check layer;
state from the previous input is dropped then. Inputs are never modified in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lmcache.blend.interfaces import BlendExecutor, BlendOutput, PositionalEncoder
from lmcache.config import LMCacheEngineConfig


def create_index(ndims: int, target_dim: int,
                 index: torch.Tensor | slice) -> tuple[torch.Tensor | slice, ...]:
    """An indexing tuple for an `ndims`-D tensor that applies `index` on `target_dim` only."""
    if not -ndims <= target_dim < ndims:
        raise ValueError(f"target_dim={target_dim} is out of range for a {ndims}-D tensor")
    idx: list[torch.Tensor | slice] = [slice(None)] * ndims
    idx[target_dim] = index
    return tuple(idx)


def indices_to_mask(indices: torch.Tensor, size: int) -> torch.Tensor:
    """A bool ``[size]`` tensor (on the device of `indices`) that is True at `indices`."""
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= size):
        raise ValueError(f"indices must lie in [0, {size}), got range "
                         f"[{int(indices.min())}, {int(indices.max())}]")
    mask = torch.zeros(size, dtype=torch.bool, device=indices.device)
    mask[indices] = True
    return mask


def mask_to_indices(mask: torch.Tensor) -> torch.Tensor:
    """The ascending int64 indices where the 1-D bool `mask` is True."""
    if mask.dim() != 1 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a 1-D bool tensor, got {mask.dtype} of shape {tuple(mask.shape)}")
    return torch.nonzero(mask).squeeze(1)


def select_top_deviation(deviation: torch.Tensor, forced: torch.Tensor, num_valid_tokens: int,
                         fraction: float) -> torch.Tensor:
    """Ascending indices of the tokens to keep among ``[S]`` candidates of one request: every
    `forced` one plus the ``ceil(fraction * num_valid_tokens)`` others with the largest
    `deviation` (capped at the number of candidates)."""
    num_forced = int(forced.sum())
    budget = min(deviation.numel(), num_forced + math.ceil(fraction * num_valid_tokens - 1e-9))
    scores = deviation.float().masked_fill(forced.to(deviation.device), math.inf)
    return torch.topk(scores, budget, sorted=False).indices.sort().values


def _check_query_start_loc(qsl: torch.Tensor, num_tokens: int) -> None:
    if qsl.dim() != 1 or qsl.numel() < 2 or int(qsl[0]) != 0 or int(qsl[-1]) != num_tokens \
            or bool((qsl[1:] < qsl[:-1]).any()):
        raise ValueError(f"query_start_loc {qsl.tolist()} must be non-decreasing from 0 to the "
                         f"number of input tokens {num_tokens}")


class CacheBlendImpl(BlendExecutor):
    def __init__(self, recompute_ratio: float, check_layers: Sequence[int] = (1,)) -> None:
        if not 0.0 <= recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio={recompute_ratio} must be in [0, 1]")
        if not check_layers or min(check_layers) < 0:
            raise ValueError(f"check_layers={list(check_layers)} must be non-empty layer ids >= 0")
        self.recompute_ratio = recompute_ratio
        self.check_layers = sorted(set(check_layers))
        n = len(self.check_layers)
        self._fractions = {layer: recompute_ratio ** ((i + 1) / n)
                           for i, layer in enumerate(self.check_layers)}
        self.positional_encoder: PositionalEncoder | None = None
        self.reverse_positional_encoder: PositionalEncoder | None = None
        # state of the current input: input indices of the tokens still computed (None = all),
        # and the positions of all input tokens
        self._kv_indices: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config: LMCacheEngineConfig) -> CacheBlendImpl:
        """From `blend_recompute_ratio` and `blend_check_layers`."""
        return cls(config.blend_recompute_ratio, config.blend_check_layers)

    def set_positional_encoder(self, positional_encoder: PositionalEncoder) -> None:
        self.positional_encoder = positional_encoder

    def set_reverse_positional_encoder(self, reverse_positional_encoder: PositionalEncoder) -> None:
        self.reverse_positional_encoder = reverse_positional_encoder

    def uses_retrieved_kv(self, layer_id: int) -> bool:
        return layer_id >= self.check_layers[0]

    @property
    def selected_indices(self) -> torch.Tensor | None:
        """Input indices of the tokens computed in the latest layer (None = all of them)."""
        return self._kv_indices

    def blend(
        self,
        layer_id: int,
        retrieved_k: torch.Tensor | None,
        retrieved_v: torch.Tensor | None,
        valid_mask: torch.Tensor,
        original_positions: torch.Tensor,
        fresh_q: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        token_dim: int,
    ) -> BlendOutput:
        ndim = min(fresh_q.dim(), fresh_k.dim())
        if not -ndim <= token_dim < ndim:
            raise ValueError(f"token_dim={token_dim} is out of range for fresh q "
                             f"{tuple(fresh_q.shape)} / k {tuple(fresh_k.shape)}")
        if positions.dim() != 1:
            raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
        n_fresh = fresh_q.shape[token_dim]
        if fresh_k.shape != fresh_v.shape or fresh_k.shape[token_dim] != n_fresh \
                or positions.numel() != n_fresh:
            raise ValueError(f"fresh q/k/v/positions disagree: q {tuple(fresh_q.shape)}, k "
                             f"{tuple(fresh_k.shape)}, v {tuple(fresh_v.shape)}, positions "
                             f"{tuple(positions.shape)} (token_dim={token_dim})")
        if layer_id <= self.check_layers[0] or self._positions is None:
            self._kv_indices, self._positions = None, positions
        cur = self._kv_indices
        num_tokens = self._positions.numel()
        if (n_fresh != num_tokens) if cur is None else (n_fresh != cur.numel()):
            raise ValueError(f"layer {layer_id}: got {n_fresh} fresh tokens, expected "
                             f"{num_tokens if cur is None else cur.numel()}")
        if retrieved_k is None or retrieved_v is None:
            if cur is not None:
                raise ValueError(f"layer {layer_id}: retrieved KV is missing after tokens were selected")
            return self._unchanged(fresh_q, fresh_k, fresh_v, positions)
        self._check_retrieved(retrieved_k, retrieved_v, valid_mask, original_positions, fresh_k,
                              token_dim, num_tokens)
        _check_query_start_loc(query_start_loc, num_tokens)
        check = layer_id in self._fractions
        if cur is None and not check:
            return self._unchanged(fresh_q, fresh_k, fresh_v, positions)

        rk = self._move_keys(retrieved_k, original_positions, token_dim)
        k = fresh_k if cur is None else rk.index_copy(token_dim, cur, fresh_k)
        v = fresh_v if cur is None else retrieved_v.index_copy(token_dim, cur, fresh_v)
        if not check:
            return BlendOutput(fresh_q, k, v, positions, _arange(n_fresh, fresh_q.device), None)

        rk_cur = rk if cur is None else rk.index_select(token_dim, cur)
        deviation = (fresh_k - rk_cur).float().pow(2).sum(
            dim=[d for d in range(fresh_k.dim()) if d != token_dim % fresh_k.dim()])
        sel, new_qsl = self._select(deviation, valid_mask, cur, query_start_loc, self._fractions[layer_id])
        self._kv_indices = sel if cur is None else cur[sel]
        return BlendOutput(fresh_q.index_select(token_dim, sel), k, v, positions[sel], sel, new_qsl)

    # ---- helpers --------------------------------------------------------------------------------

    def _select(self, deviation: torch.Tensor, valid_mask: torch.Tensor, cur: torch.Tensor | None,
                qsl: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Local indices (into the fresh tokens) to keep, and the new query_start_loc."""
        device = deviation.device
        input_idx = cur if cur is not None else _arange(deviation.numel(), device)
        bounds = torch.searchsorted(input_idx, qsl.to(device=device, dtype=input_idx.dtype))
        invalid = ~valid_mask.to(device)
        kept, counts = [], []
        for r in range(qsl.numel() - 1):
            lo, hi = int(bounds[r]), int(bounds[r + 1])
            n_valid = int(valid_mask[int(qsl[r]):int(qsl[r + 1])].sum())
            local = select_top_deviation(deviation[lo:hi], invalid[input_idx[lo:hi]], n_valid, fraction)
            kept.append(local + lo)
            counts.append(local.numel())
        sel = torch.cat(kept)
        new_qsl = torch.zeros(len(counts) + 1, dtype=qsl.dtype, device=qsl.device)
        new_qsl[1:] = torch.tensor(counts, dtype=qsl.dtype).cumsum(0)
        return sel, new_qsl

    def _move_keys(self, retrieved_k: torch.Tensor, original_positions: torch.Tensor,
                   token_dim: int) -> torch.Tensor:
        """Retrieved K re-encoded from `original_positions` to the input's positions."""
        enc, rev = self.positional_encoder, self.reverse_positional_encoder
        if enc is None and rev is None:
            return retrieved_k
        if enc is None or rev is None:
            raise ValueError("set both the positional encoder and its reverse, or neither")
        assert self._positions is not None
        k2 = retrieved_k.movedim(token_dim, 0)
        shape = k2.shape
        k2 = k2.reshape(shape[0], -1)
        no_q = k2[:, :0]
        _, k2 = rev(original_positions.to(k2.device), no_q, k2)
        _, k2 = enc(self._positions.to(k2.device), no_q, k2)
        return k2.reshape(shape).movedim(0, token_dim)

    @staticmethod
    def _check_retrieved(rk: torch.Tensor, rv: torch.Tensor, valid_mask: torch.Tensor,
                         original_positions: torch.Tensor, fresh_k: torch.Tensor, token_dim: int,
                         num_tokens: int) -> None:
        expected = list(fresh_k.shape)
        expected[token_dim] = num_tokens
        if list(rk.shape) != expected or rv.shape != rk.shape:
            raise ValueError(f"retrieved K/V shapes {tuple(rk.shape)}/{tuple(rv.shape)} do not match "
                             f"the {num_tokens} input tokens; expected {tuple(expected)}")
        if rk.dtype != fresh_k.dtype or rv.dtype != fresh_k.dtype:
            raise ValueError(f"retrieved K/V dtype {rk.dtype}/{rv.dtype} differs from the fresh KV "
                             f"dtype {fresh_k.dtype}")
        if valid_mask.dtype != torch.bool or valid_mask.device.type != "cpu" \
                or valid_mask.shape != (num_tokens,):
            raise ValueError(f"valid_mask must be a CPU bool tensor of shape ({num_tokens},), got "
                             f"{valid_mask.dtype} {tuple(valid_mask.shape)} on {valid_mask.device}")
        if original_positions.shape != (num_tokens,):
            raise ValueError(f"original_positions has shape {tuple(original_positions.shape)}, "
                             f"expected ({num_tokens},)")

    @staticmethod
    def _unchanged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> BlendOutput:
        return BlendOutput(q, k, v, positions, _arange(positions.numel(), q.device), None)


def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)
