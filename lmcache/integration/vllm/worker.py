"""The worker side of the vLLM connector (runs in each vLLM worker process, next to the model).

- `register_kv_caches`: builds this rank's engine around vLLM's per-layer caches: on CPU the
  packed vLLM-CPU layout (probed with vLLM's own kernel) through `VLLMCPUPackedConnector`, on CUDA
  the flash-attention ``[2, num_blocks, block_size, heads, head_size]`` or FlashInfer ``[num_blocks,
  2, ...]`` layout through `VLLMPagedMemGPUConnectorV2`; both store the canonical KV_BLOB layout.
  Then it starts the lookup server the scheduler side asks.
- `start_load_kv` (before the forward): loads each planned prefix; whatever could not be loaded
  (evicted since the lookup, a tier fault) is reported by `get_block_ids_with_load_errors` and vLLM
  recomputes it.
- `wait_for_save` (after the forward): stores the newly computed chunks synchronously; the copy is
  the only stall (lower tiers are written in the background).
- `get_finished`: ends the lookup leases of finished requests.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.config import LMCacheEngineConfig
from lmcache.gpu_connector import GPUConnectorInterface, VLLMPagedMemGPUConnectorV2
from lmcache.integration.vllm.lookup_channel import LookupServer, socket_path
from lmcache.integration.vllm.metadata import LMCacheConnectorMetadata, RequestPlan
from lmcache.integration.vllm.utils import ENGINE_NAME, engine_metadata

logger = logging.getLogger(__name__)


class LMCacheWorker:
    def __init__(self, vllm_config: Any, config: LMCacheEngineConfig, rank: int) -> None:
        self.vllm_config = vllm_config
        self.config = config
        self.rank = rank
        self.block_size = vllm_config.cache_config.block_size
        self.engine: LMCacheEngine | None = None
        self.kvcaches: list[Any] = []
        self.server: LookupServer | None = None
        self._load_errors: set[int] = set()

    # ---- set-up ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        tensors = [kv_caches[n] for n in names]
        connector, self.kvcaches = self._connector_for(tensors)
        metadata = engine_metadata(self.vllm_config, self.config, tensors[0].dtype, self.rank)
        if metadata.num_layers != len(tensors):
            raise ValueError(f"vLLM registered {len(tensors)} KV layers, the model has {metadata.num_layers}")
        self.engine = LMCacheEngineBuilder.get_or_create(ENGINE_NAME, self.config, metadata, connector)
        address = socket_path(self.vllm_config.kv_transfer_config.engine_id, self.rank)
        self.server = LookupServer(address, self._answer)
        logger.info("LMCache engine ready: %d layers, chunk %d, %s, lookups on %s", len(tensors),
                    self.config.chunk_size, type(connector).__name__, address)

    def _connector_for(self, tensors: list[torch.Tensor]) -> tuple[GPUConnectorInterface, list[Any]]:
        model_config = self.vllm_config.model_config
        parallel = self.vllm_config.parallel_config
        heads, head_size = model_config.get_num_kv_heads(parallel), model_config.get_head_size()
        first, bs = tensors[0], self.block_size
        hidden = heads * head_size
        if first.device.type == "cpu" and tuple(first.shape[1:]) == (heads, bs, 2 * head_size):
            from lmcache.integration.vllm.cpu_connector import VLLMCPUPackedConnector
            from lmcache.integration.vllm.cpu_layout import default_isa, probe_packed_layout

            layout = probe_packed_layout(heads, head_size, bs, first.dtype,
                                         default_isa(first.dtype, bs, head_size))
            return VLLMCPUPackedConnector(hidden, len(tensors), layout), tensors
        connector = VLLMPagedMemGPUConnectorV2(hidden, len(tensors))
        if first.dim() == 5 and first.shape[0] == 2 and first.shape[2] == bs:
            return connector, tensors  # flash attention: [2, num_blocks, bs, heads, head_size]
        if first.dim() == 5 and first.shape[1] == 2 and first.shape[2] == bs:
            return connector, [(t[:, 0], t[:, 1]) for t in tensors]  # FlashInfer
        raise ValueError(f"LMCache does not know vLLM's KV cache layout {tuple(first.shape)} on "
                         f"{first.device} (block size {bs}, {heads} KV heads of {head_size})")

    def _answer(self, header: dict[str, Any], tokens: Any) -> dict[str, Any]:
        assert self.engine is not None
        cmd = header.get("cmd")
        if cmd == "lookup":
            hit = self.engine.lookup(torch.from_numpy(tokens.astype("int64")),
                                     extra_key=header.get("extra_key"), lease_id=str(header["lease"]))
            return {"hit": hit}
        if cmd == "stats":
            return self.engine.stats.snapshot()
        if cmd == "ping":
            return {}
        raise ValueError(f"unknown command {cmd!r}")

    # ---- per step -------------------------------------------------------------------------------

    def start_load_kv(self, metadata: LMCacheConnectorMetadata) -> None:
        for plan in metadata.requests:
            if plan.has_load:
                self.load(plan)

    def wait_for_save(self, metadata: LMCacheConnectorMetadata) -> None:
        for plan in metadata.requests:
            if plan.has_save:
                self.save(plan)

    def load(self, plan: RequestPlan) -> int:
        """Load `plan`'s prefix; returns the tokens now valid up to (<= plan.load_to)."""
        assert self.engine is not None
        n = plan.retrieve_to
        chunk = self.config.chunk_size
        slots = self._slots(plan.block_ids, n)
        slots[: plan.load_from] = -1
        slots[plan.load_to :] = -1
        skip = plan.load_from - plan.load_from % chunk
        mask = torch.arange(n) >= skip if skip else None
        tokens = torch.tensor(plan.token_ids[:n], dtype=torch.int64)
        loaded = self.engine.retrieve(tokens, mask, extra_key=plan.extra_key, kvcaches=self.kvcaches,
                                      slot_mapping=slots)
        valid = min(skip + int(loaded[skip:].sum()), plan.load_to)
        if valid < plan.load_to:
            bs = self.block_size
            first = max(valid, plan.load_from) // bs
            self._load_errors.update(plan.block_ids[first : -(-plan.load_to // bs)])
            logger.info("request %s: loaded %d of %d planned tokens; vLLM recomputes the rest",
                        plan.req_id, max(valid - plan.load_from, 0), plan.load_to - plan.load_from)
        self.engine.release(plan.req_id)
        return valid

    def save(self, plan: RequestPlan) -> None:
        assert self.engine is not None
        n = plan.save_to
        skip = plan.save_from - plan.save_from % self.config.chunk_size
        mask = torch.arange(n) >= skip if skip else None
        tokens = torch.tensor(plan.token_ids[:n], dtype=torch.int64)
        self.engine.store(tokens, mask, extra_key=plan.extra_key, kvcaches=self.kvcaches,
                          slot_mapping=self._slots(plan.block_ids, n))

    def _slots(self, block_ids: list[int], n: int) -> torch.Tensor:
        """Slot of each of the first `n` tokens (-1 where no block is allocated yet)."""
        bs = self.block_size
        blocks = torch.tensor(block_ids[: -(-n // bs)], dtype=torch.int64)
        slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[:n]
        if slots.shape[0] < n:
            slots = torch.cat([slots, torch.full((n - slots.shape[0],), -1, dtype=torch.int64)])
        return slots

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.engine is not None:
            for rid in finished_req_ids:
                self.engine.release(rid)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        LMCacheEngineBuilder.destroy(ENGINE_NAME)
        self.engine = None


def _layer_index(name: str) -> tuple[int, str]:
    match = re.search(r"\d+", name)
    return (int(match.group()) if match else 0, name)
