"""CacheBlend interfaces (seed 001): the executor that blends retrieved KV with fresh KV, and the
retriever that loads the KV of an input's segments.

Conventions (DESIGN.md, "Blend."): per layer, Q is ``[T, num_heads * head_size]`` and K/V are
``[T, num_kv_heads * head_size]`` (grouped-query attention) with the token dimension `token_dim`
(0 in this project's callers). A positional encoder is ``(positions, q, k) -> (q, k)``; the
reverse encoder undoes it. `original_positions` are the positions the retrieved KV was computed
at. `valid_mask` is a CPU bool tensor over the tokens of the input.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch

PositionalEncoder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``(positions [T], q [T, Hq*D], k [T, Hk*D]) -> (q, k)`` with the positions applied (RoPE)."""


@dataclass
class BlendOutput:
    """What `BlendExecutor.blend` returns for one layer.

    q: the short Q ``[S, num_heads * head_size]`` of the tokens that are (still) computed.
    k, v: the long K/V ``[T, num_kv_heads * head_size]`` of every input token: retrieved KV moved
        to the new positions, with every freshly computed token's KV put in its place.
    positions: ``[S]`` positions in the input of the tokens in `q`.
    local_indices: ``[S]`` indices of the tokens of `q` in this call's `fresh_q`.
    query_start_loc: ``[num_requests + 1]`` boundaries of the requests in `q` if a token selection
        happened in this call, else None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    local_indices: torch.Tensor
    query_start_loc: torch.Tensor | None


class BlendExecutor(abc.ABC):
    """Blends the retrieved KV with fresh KV, layer by layer, and picks the tokens to recompute."""

    @abc.abstractmethod
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
        """Blend layer `layer_id`: return the short Q, the long blended K/V and the positions of
        the tokens in Q.

        retrieved_k / retrieved_v: ``[T, kv_hidden]`` for all T input tokens, or None if nothing
            was retrieved. valid_mask: CPU bool ``[T]``, True where the retrieved KV is usable.
        original_positions: ``[T]`` positions the retrieved KV was computed at.
        fresh_q / fresh_k / fresh_v: this layer's fresh projections of the tokens still being
            computed (all T tokens until a selection happened, then the selected S).
        positions: positions in the input of the tokens in `fresh_q`.
        query_start_loc: ``[num_requests + 1]`` request boundaries in the *input* (never changes
            after a selection)."""

    def uses_retrieved_kv(self, layer_id: int) -> bool:
        """Whether `blend` reads the retrieved KV of `layer_id`; a caller may pass None for the
        retrieved K/V of a layer where this is False (and so not wait for its load)."""
        return True


@dataclass
class BlendRetrieverResult:
    """One layer of retrieved KV.

    k, v: ``[T, num_kv_heads * head_size]`` for the T input tokens (rows of tokens whose
        `valid_mask` is False are undefined), or None if nothing was retrieved.
    valid_mask: CPU bool ``[T]``.
    original_positions: ``[T]`` positions the KV was computed at (0 where not valid), on the
        device of k and v.
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    valid_mask: torch.Tensor
    original_positions: torch.Tensor


class BlendRetrieverTask(abc.ABC):
    """The KV loads a `BlendRetriever` started for one input."""

    @abc.abstractmethod
    def result(self, layer_id: int) -> BlendRetrieverResult:
        """Block until layer `layer_id` is available and return it; K/V cover exactly the input
        tokens given to `BlendRetriever.new_request`."""


class BlendRetriever(abc.ABC):
    """Starts (possibly asynchronous) loads of the KV of an input's reusable parts."""

    @abc.abstractmethod
    def new_request(self, input_tokens: torch.Tensor, query_start_loc: torch.Tensor) -> BlendRetrieverTask:
        """Start retrieving the KV of `input_tokens` (1-D, possibly several requests back to back;
        `query_start_loc` ``[num_requests + 1]`` gives their boundaries)."""
