"""Self-verification of the cache (`verify_rate`): a few lookups that would hit are answered as
misses, vLLM computes those prefixes, and the KV it computed is compared with what the cache holds
under the same keys.

- Choice (`Auditor.answer`, on each lookup the worker answers): lookup number ``n`` (counted from
  `verify_seed`) is audited where ``floor((n + 1) * rate) > floor(n * rate)``: exactly a `rate`
  fraction of lookups, spread evenly, the same on every tensor-parallel rank (each answers the
  same lookups in the same order), none at rate 0 and all at rate 1. An audited lookup that finds
  something cached answers 0 and remembers how many tokens it found; repeated lookups of one
  request (lease) get the first answer.
- Capture (`Auditor.capture`, in `wait_for_save`, on the request path): of the chunks the plan
  saves that lie in the audited prefix and that vLLM computed itself (from `RequestPlan.fresh_from`
  on; what vLLM's own prefix cache served may have come from LMCache), the fresh KV is read out of
  vLLM's cache and queued, with the recurrent state of a boundary the plan saves there. They are
  not stored (what the cache holds stays to be compared). On vLLM-CPU's packed layout the fresh KV
  is decoded through the permutations probed from vLLM's own kernel
  (`cpu_layout.probe_packed_layout`), not through the copy the stores use, so a wrong store copy
  is seen too; other layouts are read through the engine's connector.
- Check (a background thread, `Auditor._run`; the queue is bounded in bytes, what does not fit is
  counted in ``dropped`` and not audited): every tier holding the key is read through its own API
  (`get_blocking`) and compared layer by layer (`compare`): ``exact`` (bit for bit),
  ``within_rounding`` (the largest difference at most `ROUNDING_ULPS` units in the last place of
  the dtype, relative to the layer's largest magnitude) or ``mismatch``. Counted per tier and
  group kind (`counts`; Prometheus ``lmcache:audits_total{tier, group_kind, result}``). A
  mismatch logs one incident (model, group, layer, tier, size of the difference) and removes the
  chunk from that tier; after `verify_max_mismatches` mismatches the worker stops serving hits for
  the model (one message): lookups answer 0, stores go on, audits continue at `rate`.
- An engine with a tier that codes KV lossily (CacheGen: quantized by design) is not audited (one
  message at start): its hits, and those promoted from it into the hot tier, only approximate
  what vLLM computes, so no comparison could tell a fault from the coding.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.cache_key import CacheEngineKey
from lmcache.integration.vllm.cpu_connector import VLLMCPUPackedConnector, permuted_gather
from lmcache.integration.vllm.kv_groups import KVGroup, ModelKV
from lmcache.integration.vllm.metadata import RequestPlan
from lmcache.integration.vllm.states import StateCopier
from lmcache.integration.vllm.transfer import save_slots
from lmcache.memory_management import MemoryFormat, release_all

logger = logging.getLogger(__name__)

# The largest difference counted as rounding, in units in the last place of the dtype relative to
# the compared layer's largest magnitude: 4x the largest difference measured between a fresh
# prefill and the stored KV of the same prompt split otherwise (`benchmarks/audit_noise.py`,
# benchmarks/RESULTS.md "Self-verification"): fp32 18.9 (Llama, Gemma 3, gpt-oss) -> 76; bf16 0
# (Qwen3-Next: every audit exact) -> 8, two bf16 rounding steps with the margin (nothing measured
# larger); fp16 as bf16 (not measured).
ROUNDING_ULPS = {torch.float32: 76.0, torch.bfloat16: 8.0, torch.float16: 8.0}
# MLA (DeepSeek-V2) on vLLM-CPU: the latents of the same tokens differ with the length of the
# prefill that computed them (vLLM-CPU prefills MLA in one step, and a bf16 MoE's routing flips):
# measured up to 251 ulps, about twice the layer's largest magnitude. 4x that: only gross faults
# (a NaN, an exponent bit) are told from it.
MLA_ULPS = 1004.0
MAX_QUEUED_BYTES = 256 << 20  # fresh KV waiting to be compared
MAX_REMEMBERED = 4096  # audit decisions of requests not yet finished


class Result(enum.Enum):
    EXACT = "exact"
    WITHIN_ROUNDING = "within_rounding"
    MISMATCH = "mismatch"


@dataclass(frozen=True)
class Difference:
    """How far a stored chunk (or state part) is from the fresh one: the worst `layer` (or state
    part), its largest absolute difference and that in `ulps` (see the module docstring)."""

    result: Result
    layer: int = -1
    max_abs: float = 0.0
    ulps: float = 0.0


def layer_differences(fresh: torch.Tensor, stored: torch.Tensor, tolerance_ulps: float) -> list[Difference]:
    """Compare two ``[kv_count, layers, tokens, hidden]`` chunks (or ``[1, parts, n]`` states)
    layer by layer (dim 1): one `Difference` per layer. Different shapes or dtypes are one
    mismatch of layer -1; a non-finite difference is a mismatch."""
    if fresh.shape != stored.shape or fresh.dtype != stored.dtype:
        return [Difference(Result.MISMATCH, -1, math.inf, math.inf)]
    out = []
    eps = torch.finfo(fresh.dtype).eps if fresh.dtype.is_floating_point else 1.0
    for layer in range(fresh.shape[1]):
        a, b = fresh[:, layer], stored[:, layer]
        if torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            out.append(Difference(Result.EXACT, layer))
            continue
        diff = (a.double() - b.double()).abs().max().item()
        diff = diff if math.isfinite(diff) else math.inf  # NaN or infinity on one side
        scale = max(a.double().abs().max().item(), b.double().abs().max().item(), eps)
        ulps = diff / (scale * eps)
        out.append(Difference(Result.WITHIN_ROUNDING if ulps <= tolerance_ulps else Result.MISMATCH,
                              layer, diff, ulps))
    return out


def worst(diffs: Sequence[Difference]) -> Difference:
    """The first mismatch, else the largest difference."""
    order = {Result.EXACT: 0, Result.WITHIN_ROUNDING: 1, Result.MISMATCH: 2}
    return max(diffs, key=lambda d: (order[d.result], d.ulps if d.result != Result.MISMATCH else 0),
               default=Difference(Result.EXACT))


def compare(fresh: torch.Tensor, stored: torch.Tensor, tolerance_ulps: float) -> Difference:
    """The worst of `layer_differences`."""
    return worst(layer_differences(fresh, stored, tolerance_ulps))


def selected(n: int, rate: float) -> bool:
    """Whether lookup number `n` is audited at `rate`."""
    return math.floor((n + 1) * rate) > math.floor(n * rate)


@dataclass
class _Item:
    key: CacheEngineKey
    fresh: torch.Tensor  # a chunk [kv_count, layers, tokens, hidden], or a state [parts, max bytes]
    state: bool = False


class Auditor:
    def __init__(self, engine: LMCacheEngine, kv: ModelKV, *, rate: float, max_mismatches: int, seed: int,
                 states: StateCopier | None = None) -> None:
        self.engine = engine
        self.kv = kv
        lossy = [name for name, tier in engine.storage_manager.backends.items() if tier.lossy]
        if lossy and rate > 0:
            logger.info("LMCache self-verification is off: %s code KV lossily (CacheGen), so a hit only "
                        "approximates what vLLM computes", ", ".join(lossy))
            rate = 0.0
        self.rate = rate
        self.max_mismatches = max_mismatches
        self.states = states
        self.tolerance = MLA_ULPS if kv.kv_count == 1 else ROUNDING_ULPS.get(engine.metadata.kv_dtype, 0.0)
        self._next = seed
        self._answers: OrderedDict[str, tuple[int, int]] = OrderedDict()  # lease -> (answer, audited hit)
        self._lock = threading.Lock()
        self.mismatches = 0
        self.stopped = False
        self._counts: dict[tuple[str, str, str], int] = {}  # (tier, group kind, result) -> n
        self._reported: dict[tuple[str, str, str], int] = {}
        self.dropped = 0
        self.max_ulps = 0.0  # the largest within-rounding difference seen
        self.largest_ulps = 0.0  # the largest finite difference seen, mismatches included
        self._queued_bytes = 0
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="lmcache-audit", daemon=True)
        self._thread.start()

    # ---- choice (the lookup server's thread) ------------------------------------------------

    def answer(self, lease: str, hit: int) -> int:
        """The hit a lookup reports: 0 for an audited one, and for every one once hits stopped."""
        with self._lock:
            known = self._answers.get(lease)
            if known is None:
                audited = selected(self._next, self.rate) and hit > 0
                self._next += 1
                if audited:
                    known = (0, hit)
                else:  # once hits stopped, still a miss (but not audited beyond the rate)
                    known = (0, 0) if self.stopped else (hit, 0)
                self._answers[lease] = known
                while len(self._answers) > MAX_REMEMBERED:
                    self._answers.popitem(last=False)
            return known[0]

    def audited(self, req_id: str) -> int:
        """Tokens the cache held for an audited request (0: not audited)."""
        with self._lock:
            known = self._answers.get(req_id)
        return known[1] if known is not None else 0

    def finished(self, req_ids: Sequence[str] | set[str]) -> None:
        with self._lock:
            for rid in req_ids:
                self._answers.pop(rid, None)

    # ---- capture (the worker's thread, on the request path) ---------------------------------

    def capture(self, plan: RequestPlan, kvcaches: Any) -> RequestPlan:
        """Queue the fresh KV of `plan`'s audited chunks (and state); returns the plan of what is
        still to be stored."""
        cached = self.audited(plan.req_id)
        cs = self.engine.config.chunk_size
        lo = max(plan.save_from, -(-plan.fresh_from // cs) * cs)
        hi = min(plan.save_to, cached)
        if cached == 0 or (hi <= lo and not self._audits_state(plan, cached)):
            return plan
        rest = plan
        if hi > lo:
            self._capture_chunks(plan, lo, hi, kvcaches)
            rest = dataclasses.replace(rest, save_from=max(plan.save_from, hi))
        if self._audits_state(plan, cached):
            self._capture_state(plan)
            rest = dataclasses.replace(rest, save_state_at=0)
        return rest

    def _audits_state(self, plan: RequestPlan, cached: int) -> bool:
        return self.states is not None and plan.fresh_from < plan.save_state_at <= cached

    def _capture_chunks(self, plan: RequestPlan, lo: int, hi: int, kvcaches: Any) -> None:
        engine = self.engine
        slots, first = save_slots(self.kv.token_groups, dataclasses.replace(plan, save_from=lo, save_to=hi),
                                  engine.config.chunk_size)
        if first >= hi:
            return
        tokens = torch.tensor(plan.token_ids[:hi], dtype=torch.int64)
        mask = torch.arange(hi) >= first - first % engine.config.chunk_size
        chunks = list(engine.token_database.process_tokens(tokens, mask, extra_key=plan.extra_key))
        fresh = self._read_fresh(kvcaches, slots, [(c.start, c.end) for c in chunks])
        for chunk, blob in zip(chunks, fresh, strict=False):
            self._enqueue(_Item(chunk.key, blob))

    def _read_fresh(self, kvcaches: Any, slots: torch.Tensor, spans: list[tuple[int, int]]
                    ) -> list[torch.Tensor]:
        """The KV of each token span as chunk tensors ``[kv_count, layers, tokens, hidden]``."""
        connector = self.engine.gpu_connector
        if isinstance(connector, VLLMCPUPackedConnector):
            return [permuted_gather(connector, kvcaches, slots[..., a:b]) for a, b in spans]
        sm = self.engine.storage_manager
        objs = sm.allocate_many([connector.get_shape(b - a) for a, b in spans], self.engine.metadata.kv_dtype,
                                MemoryFormat.KV_BLOB)
        try:
            if len(objs) < len(spans):  # no room in the arena: not audited (and not stored)
                with self._lock:
                    self.dropped += len(spans)
                return []
            connector.batched_from_gpu(objs, [a for a, _ in spans], [b for _, b in spans], kvcaches=kvcaches,
                                       slot_mapping=slots)
            return [obj.tensor.clone() for obj in objs if obj.tensor is not None]
        finally:
            release_all(objs)

    def _capture_state(self, plan: RequestPlan) -> None:
        assert self.states is not None
        boundary = plan.save_state_at
        buffer = torch.empty(self.states.nbytes, dtype=torch.uint8)
        if not self.states.gather(plan.block_ids, boundary, buffer):
            return
        tokens = torch.tensor(plan.token_ids[:boundary], dtype=torch.int64)
        *_, last = self.engine.token_database.process_tokens(tokens, extra_key=plan.extra_key)
        self._enqueue(_Item(self.engine.state_key(last.key), buffer, state=True))

    def _enqueue(self, item: _Item) -> None:
        size = item.fresh.numel() * item.fresh.element_size()
        with self._lock:
            if self._queued_bytes + size > MAX_QUEUED_BYTES:
                self.dropped += 1
                return
            self._queued_bytes += size
        self._queue.put(item)

    # ---- check (the audit thread) -----------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._check(item)
            except Exception:  # an audit that fails must not stop the others
                logger.exception("LMCache audit of %s failed", item.key)
            finally:
                with self._lock:
                    self._queued_bytes -= item.fresh.numel() * item.fresh.element_size()
                self._queue.task_done()

    def _check(self, item: _Item) -> None:
        for name, tier in self.engine.storage_manager.backends.items():
            obj = tier.get_blocking(item.key) if tier.contains(item.key) else None
            if obj is None:
                continue
            try:
                stored = obj.tensor
                assert stored is not None
                by_kind = self._state_differences(item.fresh, stored.view(torch.uint8)) if item.state \
                    else self._chunk_differences(item.fresh, stored)
            finally:
                obj.ref_count_down()
            for kind, diff in by_kind.items():
                self._count(name, kind, diff)
            bad = worst(list(by_kind.values()))
            if bad.result == Result.MISMATCH:
                self._mismatch(name, tier, item, bad)

    def _chunk_differences(self, fresh: torch.Tensor, stored: torch.Tensor) -> dict[str, Difference]:
        """The worst difference of each group kind's layers."""
        diffs = layer_differences(fresh, stored, self.tolerance)
        if diffs[0].layer < 0:
            return {g.kind.value: diffs[0] for g in self.kv.token_groups}
        kinds: dict[str, list[Difference]] = {}
        for diff in diffs:
            kinds.setdefault(self._group_of(diff.layer).kind.value, []).append(diff)
        return {kind: worst(group) for kind, group in kinds.items()}

    def _state_differences(self, fresh: torch.Tensor, stored: torch.Tensor) -> dict[str, Difference]:
        """Each part of the state compared in its own dtype (``layer`` = the part)."""
        assert self.states is not None
        if stored.numel() < fresh.numel():
            return {"state": Difference(Result.MISMATCH, -1, math.inf, math.inf)}
        diffs = []
        offset = 0
        for part, ((t, _), size) in enumerate(zip(self.states.parts, self.states.sizes, strict=True)):
            a = fresh[offset: offset + size].view(t.dtype).view(1, 1, -1)
            b = stored[offset: offset + size].view(t.dtype).view(1, 1, -1)
            offset += size
            diffs.append(dataclasses.replace(compare(a, b, ROUNDING_ULPS.get(t.dtype, 0.0)), layer=part))
        return {"state": worst(diffs)}

    def _group_of(self, layer: int) -> KVGroup:
        return self.kv.token_groups[self.kv.layer_groups[layer]]

    def _count(self, tier: str, kind: str, diff: Difference) -> None:
        with self._lock:
            key = (tier, kind, diff.result.value)
            self._counts[key] = self._counts.get(key, 0) + 1
            if diff.result == Result.WITHIN_ROUNDING:
                self.max_ulps = max(self.max_ulps, diff.ulps)
            if math.isfinite(diff.ulps):
                self.largest_ulps = max(self.largest_ulps, diff.ulps)

    def _mismatch(self, name: str, tier: Any, item: _Item, diff: Difference) -> None:
        if item.state and self.states is not None and diff.layer >= 0:
            t, group = self.states.parts[diff.layer]
            where = (f"KV cache group {group.index} (state), part {diff.layer} of the recurrent state "
                     f"({group.layers[0]}..., {t.dtype})")
        elif item.state:
            where = "the whole recurrent state"
        elif diff.layer >= 0:
            group = self._group_of(diff.layer)
            where = (f"KV cache group {group.index} ({group.kind.value}), layer {diff.layer} "
                     f"({self.kv.token_layers[diff.layer]})")
        else:
            where = "the whole chunk (shape or dtype)"
        removed = tier.remove(item.key)
        logger.warning("LMCache audit mismatch: model %s, %s, tier %s: largest difference %.6g (%.3g "
                       "units in the last place of %s; rounding allows %.3g); chunk %s %s",
                       self.engine.metadata.model_name, where, name, diff.max_abs, diff.ulps,
                       self.engine.metadata.kv_dtype, self.tolerance, item.key.chunk_hash[:16],
                       "deleted" if removed else "could not be deleted")
        with self._lock:
            self.mismatches += 1
            stop = not self.stopped and self.mismatches >= self.max_mismatches
            if stop:
                self.stopped = True
        if stop:
            logger.error("LMCache stops serving cache hits for model %s: %d audit mismatches "
                         "(verify_max_mismatches=%d). vLLM computes every prompt; stores and audits go on.",
                         self.engine.metadata.model_name, self.mismatches, self.max_mismatches)

    # ---- reports ----------------------------------------------------------------------------

    def counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """Audits so far: {tier: {group kind: {result: n}}}."""
        with self._lock:
            return _nested(self._counts)

    def interval(self) -> dict[str, dict[str, dict[str, int]]]:
        """Audits since the previous call, as `counts`."""
        with self._lock:
            delta = {k: n - self._reported.get(k, 0) for k, n in self._counts.items()
                     if n != self._reported.get(k, 0)}
            self._reported = dict(self._counts)
        return _nested(delta)

    def report(self) -> dict[str, Any]:
        """For the worker's ``stats`` reply."""
        with self._lock:
            state = {"stopped": self.stopped, "mismatches": self.mismatches, "dropped": self.dropped,
                     "max_within_rounding_ulps": self.max_ulps, "largest_ulps": self.largest_ulps,
                     "rounding_ulps": self.tolerance,
                     "queued_bytes": self._queued_bytes}
        return {**state, "counts": self.counts()}

    def wait_idle(self, timeout: float) -> bool:
        """True once every queued audit is done (within `timeout` seconds)."""
        done = threading.Event()

        def join() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=join, daemon=True).start()
        return done.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


def _nested(flat: dict[tuple[str, str, str], int]) -> dict[str, dict[str, dict[str, int]]]:
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (tier, kind, result), n in flat.items():
        out.setdefault(tier, {}).setdefault(kind, {})[result] = n
    return out
