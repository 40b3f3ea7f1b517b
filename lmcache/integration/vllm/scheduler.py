"""The scheduler side of the vLLM connector (runs in vLLM's EngineCore process).

- `get_num_new_matched_tokens`: asks the workers (over `lookup_channel`) how many prefix tokens
  LMCache holds, pinning them under a lease named by the request id; answers the tokens beyond
  vLLM's own hit, always leaving at least one prompt token to compute. It may be called repeatedly
  for a waiting request, so the answer is remembered until the request is admitted.
- What names a request's KV: its prompt tokens, under `utils.extra_key` (cache salt, LoRA, the
  identifiers of its images: their placeholder tokens are the same for every image). A prompt
  given as embeddings (placeholder token ids) is neither looked up nor stored.
- `update_state_after_alloc`: records the blocks (one list per KV cache group) and how many
  external tokens vLLM accepted.
- `build_connector_meta`: per step, a `RequestPlan` for each request that loads (once) or has
  newly computed prompt chunks to save (decode tokens too with `save_decode_cache`); a trailing
  partial chunk is saved when the prompt is complete. For a hybrid model with recurrent layers, a
  prefill step that ends at a chunk boundary or a resume point (`ModelKV.resume_points`) also saves
  the layers' state there.
- Loads. A model with one full-attention KV cache group loads synchronously, before the forward
  of the request's first step, and reports what failed as blocks (vLLM recomputes from there).
  With several groups vLLM can only recover a failed load reported by request, and with one
  sliding-window group a recompute from a failed block would attend over the null blocks before
  the window, so there the load is asynchronous in vLLM's sense: the request waits
  (WAITING_FOR_REMOTE_KVS) while its plan is carried out, the worker reports it finished (or
  failed: vLLM recomputes the request from its first token, and LMCache does not offer it a load
  again).
- `kv_role`: "kv_producer" only stores, "kv_consumer" only loads, "kv_both" does both.
- Prefill/decode disaggregation (`lmcache.pd`): on a sender (``pd_role: sender``), a request whose
  ``kv_transfer_params`` name a KV receiver gets, in the step that completes its prompt, a plan
  to send the prompt's KV there (after that step's save). A malformed receiver is logged once and
  ignored (the decoder then computes the prompt).
- KV events (vLLM's `enable_kv_cache_events`, `kv_events`): a plan that saves or loads carries the
  request's vLLM block hashes over its tokens, which the worker maps its chunk keys to.
- `request_finished`: forgets the request; reports the tokens it planned to load in
  `kv_transfer_params["lmcache_loaded_tokens"]`. Saves are synchronous, so blocks are never held.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lmcache.config import LMCacheEngineConfig
from lmcache.integration.vllm.kv_events import events_enabled, plan_blocks
from lmcache.integration.vllm.kv_groups import GroupKind, ModelKV
from lmcache.integration.vllm.lookup_channel import LookupClient, socket_path
from lmcache.integration.vllm.metadata import LMCacheConnectorMetadata, RequestPlan
from lmcache.integration.vllm.utils import extra_key, tokens_name_kv
from lmcache.observability import log_once
from lmcache.pd.params import receiver_of

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    request: Any  # vllm.v1.request.Request (kept: later steps do not resend the tokens)
    block_ids: list[list[int]]  # one list per KV cache group
    extra_key: str | None
    load_from: int = 0
    load_to: int = 0
    retrieve_to: int = 0
    load_pending: bool = False
    saved: int = 0  # tokens [0, saved) are in LMCache
    state_saved: int = 0  # the last boundary whose recurrent state was saved
    send_to: str | None = None  # the decoder's KV receiver (a prefill instance)
    fresh_from: int = 0  # vLLM's own prefix-cache hit at admission


class LMCacheScheduler:
    def __init__(self, vllm_config: Any, config: LMCacheEngineConfig, kv: ModelKV) -> None:
        self.config = config
        self.chunk_size = config.chunk_size
        ranks = vllm_config.parallel_config.world_size
        self.client = LookupClient([socket_path(vllm_config, r) for r in range(ranks)],
                                   timeout=config.lookup_timeout)
        role = vllm_config.kv_transfer_config.kv_role
        self.loads = role != "kv_producer"  # a producer (prefill instance) only stores
        self.saves = role != "kv_consumer"  # a consumer (decode instance) only loads
        self.sends = config.enable_pd and config.pd_role == "sender"
        self.kv = kv
        self.load_async = len(kv.groups) > 1 or kv.groups[0].kind is GroupKind.SLIDING
        self.states = bool(kv.state_groups)
        # the blocks KV events name: those of the one KV cache group (see `kv_events`)
        self.event_block_size = kv.token_groups[0].block_size \
            if events_enabled(vllm_config) and len(kv.groups) == 1 else 0
        self._lookups: dict[str, tuple[int, int]] = {}  # req id -> (cached tokens, vLLM's hit)
        self._reqs: dict[str, _Tracked] = {}
        self._failed: set[str] = set()  # requests whose load failed: vLLM recomputes them

    # ---- admission ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = request.prompt_token_ids
        rid = request.request_id
        if not self.loads or tokens is None or len(tokens) < 2 or rid in self._failed \
                or not tokens_name_kv(request):
            return 0, False
        known = self._lookups.get(rid)
        cached = known[0] if known is not None else self.client.lookup(rid, tokens, extra_key(request))
        self._lookups[rid] = (cached, num_computed_tokens)
        usable = min(cached, len(tokens) - 1)
        if usable <= num_computed_tokens:
            return 0, False
        return usable - num_computed_tokens, self.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Also called again for a request vLLM admits anew (preempted, or its asynchronous load
        completed): its blocks are replaced, and a load is planned whenever vLLM accepted one.
        A prompt of embeddings is not tracked (`tokens_name_kv`)."""
        rid = request.request_id
        cached, local = self._lookups.pop(rid, (0, 0))
        if not tokens_name_kv(request):
            return
        tracked = self._reqs.get(rid)
        if tracked is None:
            # cached chunks need no saving; a cached trailing partial chunk only if the prompt ends there
            saved = cached if cached >= request.num_prompt_tokens else cached - cached % self.chunk_size
            tracked = self._reqs[rid] = _Tracked(request, [], extra_key(request), saved=saved,
                                                 send_to=self._receiver(request), fresh_from=local)
        tracked.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if num_external_tokens > 0:
            tracked.load_from, tracked.load_to = local, local + num_external_tokens
            tracked.retrieve_to = max(cached, tracked.load_to)
            tracked.load_pending = True

    def _receiver(self, request: Any) -> str | None:
        if not self.sends:
            return None
        try:
            return receiver_of(getattr(request, "kv_transfer_params", None))
        except ValueError as e:
            log_once(logger, "bad-pd-receiver", "request %s: %s; its KV is not sent", request.request_id, e)
            return None

    def loads_failed(self, req_ids: Iterable[str]) -> None:
        """The workers could not load these requests' prefixes: vLLM recomputes them, and
        LMCache offers them no load again."""
        for rid in req_ids:
            self._failed.add(rid)
            self._reqs.pop(rid, None)

    # ---- per step -------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheConnectorMetadata:
        plans: list[RequestPlan] = []
        scheduled = scheduler_output.num_scheduled_tokens
        planned = set()
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._reqs.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = [list(ids) for ids in new.block_ids]
                self._add_plan(plans, tracked, new.num_computed_tokens + scheduled[new.req_id])
                planned.add(new.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, rid in enumerate(cached.req_ids):
            tracked = self._reqs.get(rid)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if rid in resumed:
                    tracked.block_ids = [list(ids) for ids in new_blocks]
                else:
                    for ids, more in zip(tracked.block_ids, new_blocks, strict=True):
                        ids.extend(more)
            self._add_plan(plans, tracked, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
            planned.add(rid)
        for rid, tracked in self._reqs.items():  # asynchronous loads: the request computes later
            if tracked.load_pending and rid not in planned:
                self._add_plan(plans, tracked, None)
        return LMCacheConnectorMetadata(plans)

    def _add_plan(self, plans: list[RequestPlan], tracked: _Tracked, computed: int | None) -> None:
        """`computed`: tokens whose KV exists once this step has run (None: the request does not
        compute in this step)."""
        request = tracked.request
        prompt_len = request.num_prompt_tokens
        plan = RequestPlan(request.request_id, [], tracked.block_ids, tracked.extra_key,
                           fresh_from=tracked.fresh_from)
        if tracked.load_pending:
            tracked.load_pending = False
            plan.load_from, plan.load_to = tracked.load_from, tracked.load_to
            plan.retrieve_to = tracked.retrieve_to
            plan.load_async = self.load_async
        if computed is not None:
            limit = computed if self.config.save_decode_cache else min(computed, prompt_len)
            save_to = prompt_len if limit == prompt_len else limit - limit % self.chunk_size
            if self.saves and save_to > tracked.saved:
                plan.save_from, plan.save_to = tracked.saved, save_to
                tracked.saved = save_to
            if (self.saves and self.states and tracked.state_saved < computed <= prompt_len
                    and (computed % self.chunk_size == 0 or computed in self.kv.resume_points(prompt_len))):
                plan.save_state_at = tracked.state_saved = computed
            if tracked.send_to is not None and computed >= prompt_len:
                plan.send_to, plan.send_tokens = tracked.send_to, prompt_len
                tracked.send_to = None
        if plan.has_load or plan.has_save or plan.has_send:
            plan.token_ids = list(request.all_token_ids[: max(plan.retrieve_to, plan.save_to,
                                                              plan.save_state_at, plan.send_tokens)])
            if self.event_block_size and (plan.has_load or plan.save_to > plan.save_from):
                plan.blocks = plan_blocks(request, len(plan.token_ids), self.event_block_size)
            plans.append(plan)

    def request_finished(self, request: Any) -> dict[str, Any]:
        """Forget `request`; its `kv_transfer_params`."""
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._failed.discard(rid)
        tracked = self._reqs.pop(rid, None)
        loaded = tracked.load_to - tracked.load_from if tracked is not None else 0
        return {"lmcache_loaded_tokens": loaded}

    def reset_cache(self) -> bool | None:
        if not self.config.clear_hot_on_reset:
            return None
        return self.client.clear("hot")

    def close(self) -> None:
        self.client.close()
