"""The worker side of the vLLM connector (runs in each vLLM worker process, next to the model).

- `register_kv_caches`: builds this rank's engine (`engine_setup.build_engine`) around
  vLLM's per-layer caches of the layers `kv_groups.ModelKV` stores per token: on CPU the packed
  vLLM-CPU layout (probed with vLLM's own kernel), on CUDA the flash-attention or FlashInfer
  layout; both store the canonical KV_BLOB layout. Then it starts the lookup server the scheduler
  side asks.
- `start_load_kv` (before the forward for synchronous loads, after it for asynchronous ones):
  loads each planned prefix; whatever could not be loaded (evicted since the lookup, a tier fault)
  is reported, and vLLM recomputes it: by failed blocks (`get_block_ids_with_load_errors`, one KV
  cache group) or by request (`get_transfer_results`' ``failed_recving``, several groups). On CUDA
  the load returns once issued: vLLM's stream waits on its event, the host never synchronises.
- `wait_for_save` (after the forward): stores the newly computed chunks; on the CPU the copy is the
  only stall, on CUDA vLLM's stream waits only for the gather into the staging buffer (the chunks
  enter the hot tier when their copy to host memory has completed; lower tiers are written in the
  background).
- `get_transfer_results`: ends the lookup leases of finished requests; reports the asynchronous
  loads carried out in this step (done, or failed).
- KV events (vLLM's `enable_kv_cache_events`; `kv_events`): the blocks of each planned load and
  save are recorded by chunk key; `take_events` (after every step) turns what the tiers stored and
  dropped since into vLLM's events.
- Audits (`verify_rate` > 0, `audit.Auditor`): the lookup answers 0 for an audited request (and
  for every request once audits found `verify_max_mismatches` mismatches); its save hands the
  audited chunks' fresh KV to the auditor instead of storing them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.integration.vllm.audit import Auditor
from lmcache.integration.vllm.cpu_build import describe
from lmcache.integration.vllm.cpu_layout import packed_layout
from lmcache.integration.vllm.engine_setup import (
    VLLM_CPU_LAYOUT,
    build_engine,
    connector_kvcaches,
    vllm_layout,
)
from lmcache.integration.vllm.kv_events import LMCacheKVEvents, WorkerEvents, events_enabled
from lmcache.integration.vllm.kv_groups import ModelKV, unsupported
from lmcache.integration.vllm.lookup_channel import LookupServer, socket_path
from lmcache.integration.vllm.metadata import LMCacheConnectorMetadata, RequestPlan
from lmcache.integration.vllm.metrics import LMCacheKVConnectorStats
from lmcache.integration.vllm.mla_layout import check_latent_rows
from lmcache.integration.vllm.states import StateCopier
from lmcache.integration.vllm.transfer import load_plan, save_plan
from lmcache.integration.vllm.utils import ENGINE_NAME
from lmcache.metrics import rank_payload
from lmcache.pd.sender import PDSender

logger = logging.getLogger(__name__)


class LMCacheWorker:
    def __init__(self, vllm_config: Any, config: LMCacheEngineConfig, rank: int, kv: ModelKV) -> None:
        self.vllm_config = vllm_config
        self.config = config
        self.rank = rank
        self.kv = kv
        self.engine: LMCacheEngine | None = None
        self.kvcaches: list[Any] = []
        self.states: StateCopier | None = None  # a hybrid model's recurrent layers
        self.server: LookupServer | None = None
        self.sender: PDSender | None = None  # a prefill instance's KV channel (`lmcache.pd`)
        self.auditor: Auditor | None = None  # self-verification (`verify_rate`)
        self.events: WorkerEvents | None = None  # vLLM's KV events (`kv_events`)
        self._load_errors: set[int] = set()
        self._loaded: set[str] = set()  # asynchronous loads done in this step
        self._failed_loads: set[str] = set()
        self._reported_gauges: dict[str, Any] = {}
        self.kernels = ""  # which kernels vLLM runs (`cpu_build.describe`), for logs and stats

    # ---- set-up ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the engine, and answer the scheduler's lookups. A cache layout the connector
        turns out not to copy (learned here, from vLLM's own write ops) is refused like an
        unsupported model: one message, and the lookups answer 0 (the scheduler side asked first)."""
        names = self.kv.token_layers
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ValueError(f"vLLM registered no KV cache for layers {missing[:3]} of its KV cache groups")
        tensors = [kv_caches[n] for n in names]
        vc = self.vllm_config
        block_size = self.kv.token_groups[0].block_size
        self.kernels = describe() if tensors[0].device.type == "cpu" else "CUDA"
        try:
            if self.kv.kv_count == 1:
                check_latent_rows(vc.compilation_config.static_forward_context[names[0]], block_size)
            if self.kv.state_groups:
                self.states = StateCopier([(kv_caches[n], g) for n, g in self.kv.state_layers])
            layout = "mla" if self.kv.kv_count == 1 else vllm_layout(tensors, block_size)
            if layout == VLLM_CPU_LAYOUT:  # LayoutMismatch where vLLM's kernel packs otherwise
                _, heads, _, width = tensors[0].shape
                self.kernels = describe(packed_layout(heads, width // 2, block_size, tensors[0].dtype).isa)
        except (ValueError, KeyError) as e:
            logger.error("%s", unsupported(self.kv.model_type, str(e)))
        else:
            self.kvcaches = connector_kvcaches(tensors, block_size)
            self.engine = build_engine(vc, self.config, rank=self.rank, kv_dtype=tensors[0].dtype,
                                       device=tensors[0].device.type, layout=layout, model=self.kv)
            if self.engine.controller is not None:
                self.engine.controller.tokenize = lazy_tokenizer(vc.model_config.tokenizer)
            if self.config.enable_pd and self.config.pd_role == "sender":
                self.sender = PDSender(self.engine, self.config, self.rank)
            if events_enabled(vc) and len(self.kv.groups) == 1:
                self.events = WorkerEvents(self.engine)
            if self.config.verify_rate > 0:
                self.auditor = Auditor(self.engine, self.kv, rate=self.config.verify_rate,
                                       max_mismatches=self.config.verify_max_mismatches,
                                       seed=self.config.verify_seed, states=self.states)
        address = socket_path(vc, self.rank)
        self.server = LookupServer(address, self._answer)
        if self.engine is not None:
            logger.info("LMCache engine ready: %d layers, chunk %d, %s, %s, lookups on %s", len(tensors),
                        self.config.chunk_size, type(self.engine.gpu_connector).__name__, self.kernels,
                        address)

    def _answer(self, header: dict[str, Any], tokens: Any) -> dict[str, Any]:
        cmd = header.get("cmd")
        if self.engine is None:  # refused at registration: nothing is cached
            return {"hit": 0} if cmd == "lookup" else {}
        if cmd == "lookup":
            ids = torch.from_numpy(tokens.astype("int64"))
            ends: list[int] = []
            if self.states is not None:  # resume before the last token (vLLM computes it), where a state is
                ids, ends = ids[:-1], self.kv.resume_points(len(ids))
            lease = str(header["lease"])
            hit = self.engine.lookup(ids, extra_key=header.get("extra_key"), lease_id=lease, state_ends=ends)
            return {"hit": hit if self.auditor is None else self.auditor.answer(lease, hit)}
        if cmd == "release":  # the lookup's answer was not used (another rank did not answer)
            self.engine.release(str(header["lease"]))
            return {}
        if cmd == "stats":
            audits = {"audits": self.auditor.report()} if self.auditor is not None else {}
            return {**self.engine.stats.report(), "kernels": self.kernels, **audits}
        if cmd == "clear":
            return {"cleared": self.engine.storage_manager.clear(str(header.get("tier")))}
        if cmd == "ping":
            return {}
        raise ValueError(f"unknown command {cmd!r}")

    # ---- per step -------------------------------------------------------------------------------

    def start_load_kv(self, metadata: LMCacheConnectorMetadata) -> None:
        for plan in metadata.requests:
            if plan.has_load and self.engine is not None:
                self._record_blocks(plan, 0)
                self.load(plan)

    def wait_for_save(self, metadata: LMCacheConnectorMetadata) -> None:
        for plan in metadata.requests:
            if plan.has_save and self.engine is not None:
                self._record_blocks(plan, plan.save_from)
                self.save(plan)
            if plan.has_send and self.sender is not None:
                self.send(plan)

    def _record_blocks(self, plan: RequestPlan, from_token: int) -> None:
        if self.events is not None and self.engine is not None and plan.blocks is not None:
            self.engine.bugs.call(f"recording request {plan.req_id}'s blocks for KV events",
                                  partial(self.events.record, plan.token_ids, plan.extra_key, plan.blocks,
                                          from_token), None)

    def take_events(self) -> LMCacheKVEvents | None:
        """What the tiers stored and dropped since the last call, as vLLM's KV events (None: KV
        events are off, or there are none)."""
        if self.events is None or self.engine is None:
            return None
        return self.engine.bugs.call("taking the tiers' KV events", self.events.take, None)

    def load(self, plan: RequestPlan) -> int:
        """Load `plan`'s prefix; what could not be loaded is reported (vLLM then recomputes it):
        as failed blocks, or for an asynchronous load as a failed request. Never raises: a cache
        fault must not fail the request (the engine's `bugs`, see `lmcache.failures`)."""
        engine = self.engine
        assert engine is not None
        valid = engine.bugs.call(f"loading request {plan.req_id}'s cached prefix",
                                 partial(load_plan, engine, self.kvcaches, plan, self.kv.token_groups,
                                         self.states),
                                 plan.load_from)
        if plan.load_async:
            self._loaded.add(plan.req_id)
        if valid < plan.load_to:
            if plan.load_async:
                self._failed_loads.add(plan.req_id)
                blocks = sum(-(-(plan.load_to - plan.load_from) // g.block_size) for g in self.kv.groups)
            else:
                bs = self.kv.token_groups[0].block_size
                first = max(valid, plan.load_from) // bs
                failed = plan.block_ids[0][first : -(-plan.load_to // bs)]
                self._load_errors.update(failed)
                blocks = len(failed)
            engine.stats.add("load_error_blocks", blocks)
            logger.debug("request %s: loaded %d of %d planned tokens; vLLM recomputes the rest",
                         plan.req_id, max(valid - plan.load_from, 0), plan.load_to - plan.load_from)
        return valid

    def save(self, plan: RequestPlan) -> None:
        """Store what `plan` says; a failure only means the KV is not cached (never raises: the
        engine's `bugs`)."""
        engine = self.engine
        assert engine is not None
        if self.auditor is not None:
            plan = engine.bugs.call(f"auditing request {plan.req_id}'s KV",
                                    partial(self.auditor.capture, plan, self.kvcaches), plan)
            if not plan.has_save:
                return
        first = engine.bugs.call(f"storing request {plan.req_id}'s KV",
                                 partial(save_plan, engine, self.kvcaches, plan, self.kv.token_groups,
                                         self.states),
                                 plan.save_from)
        if first > plan.save_from:
            engine.stats.add("store_unkept_tokens", min(first, plan.save_to) - plan.save_from)

    def send(self, plan: RequestPlan) -> None:
        """Send the prompt's KV to the decoder `plan` names (never raises: the receiver's faults
        are the sender's failure domains, anything else the engine's `bugs`)."""
        engine, sender = self.engine, self.sender
        assert engine is not None and sender is not None and plan.send_to is not None
        tokens = torch.tensor(plan.token_ids[: plan.send_tokens], dtype=torch.int64)
        ends = self.kv.resume_points(plan.send_tokens) if self.states is not None else ()
        send = partial(sender.send, plan.send_to, tokens, extra_key=plan.extra_key, state_ends=ends)
        engine.bugs.call(f"sending request {plan.req_id}'s KV", send, None)  # counted by the sender

    def stats_interval(self) -> LMCacheKVConnectorStats | None:
        """What the engine counted since the last report (vLLM asks after every step); None when
        nothing changed."""
        if self.engine is None:
            return None
        payload = rank_payload(self.engine.stats, self.rank)
        if self.auditor is not None and (audits := self.auditor.interval()):
            payload["audits"] = audits
        gauges = payload["gauges_by_rank"]
        if not (payload["counters"] or payload["tier_counters"] or payload["observations"]
                or payload.get("audits")) and gauges == self._reported_gauges:
            return None
        self._reported_gauges = gauges
        return LMCacheKVConnectorStats(data=payload)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.engine is not None:
            for rid in finished_req_ids:
                self.engine.release(rid)
        if self.auditor is not None:
            self.auditor.finished(finished_req_ids)
        results = KVConnectorTransferResults(finished_recving=self._loaded,
                                             failed_recving=self._failed_loads)
        self._loaded, self._failed_loads = set(), set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self.auditor is not None:
            self.auditor.close()
            self.auditor = None
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.server is not None:
            self.server.close()
            self.server = None
        LMCacheEngineBuilder.destroy(ENGINE_NAME)
        self.engine = None


def lazy_tokenizer(name_or_path: str) -> Callable[[str], list[int]]:
    """The model's tokenizer as a function, loaded on first use (the controller's "text")."""
    loaded: list[Any] = []

    def tokenize(text: str) -> list[int]:
        if not loaded:
            from transformers import AutoTokenizer

            loaded.append(AutoTokenizer.from_pretrained(name_or_path))
        return list(loaded[0](text, add_special_tokens=False)["input_ids"])

    return tokenize
