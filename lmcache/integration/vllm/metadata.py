"""What the scheduler side tells the worker side each step (pickled by vLLM with the step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from lmcache.integration.vllm.kv_events import PlanBlocks


@dataclass
class RequestPlan:
    """One request's work in this step.

    Load: retrieve the cached prefix ``token_ids[:retrieve_to]`` but write only tokens
    ``[load_from, load_to)`` into the engine (below `load_from` vLLM's own prefix cache already
    holds the KV; from `load_to` on vLLM computes). With `load_async` the load is reported through
    `get_finished` / `failed_recving` (vLLM's way for several KV cache groups) instead of failed
    blocks. Save: store tokens ``[save_from, save_to)`` (``save_from`` tokens are known to be cached
    already); `save_state_at` > 0: also keep the recurrent layers' state after that many tokens
    (a chunk boundary this step ends at; hybrid models). A range with equal ends means nothing to
    do. `block_ids`: all of the request's blocks so far, one list per KV cache group. `fresh_from`:
    the tokens below it came from vLLM's own prefix cache when the request was admitted (an audit
    compares only KV vLLM computed for the request).
    Send (a prefill instance, `lmcache.pd`): after this step's save, send the KV of the prompt,
    ``token_ids[:send_tokens]``, to the decoder's KV receiver `send_to` ("host:port").
    `blocks`: with vLLM's KV events on, the request's vLLM blocks over `token_ids` (`kv_events`)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[list[int]]
    extra_key: str | None = None
    load_from: int = 0
    load_to: int = 0
    retrieve_to: int = 0
    load_async: bool = False
    save_from: int = 0
    save_to: int = 0
    save_state_at: int = 0
    send_to: str | None = None
    send_tokens: int = 0
    fresh_from: int = 0
    blocks: PlanBlocks | None = None

    @property
    def has_load(self) -> bool:
        return self.load_to > self.load_from

    @property
    def has_save(self) -> bool:
        return self.save_to > self.save_from or self.save_state_at > 0

    @property
    def has_send(self) -> bool:
        return self.send_to is not None


@dataclass
class LMCacheConnectorMetadata(KVConnectorMetadata):
    requests: list[RequestPlan] = field(default_factory=list)
