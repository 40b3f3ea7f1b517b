"""`SPTBlendRetriever`: retrieve the KV of each segment of an input on its own, with a SPecial Token
sequence as the segment delimiter.

A segment ends with (and includes) the separator; the tokens after the last separator form the
last segment. ``[x, x, x, spt, y, y, spt, z, z, z, z]`` -> ``[x, x, x, spt]``, ``[y, y, spt]``,
``[z, z, z, z]``. Each segment is looked up in the cache engine as if it started the sequence
(its keys do not chain over the segments before it), so KV precomputed for a passage alone is found
wherever the passage appears; its `original_positions` are therefore ``0 .. len(segment) - 1``.

`new_request` starts one engine retrieval per segment on a thread pool and returns at once; the
loads write into one ``[2, num_layers, T, num_kv_heads * head_size]`` buffer, and
`SPTBlendRetrieverTask.result(layer_id)` waits for them and hands out views of one layer. The
engine's connector must accept per-layer ``(K, V)`` tensors with the token dimension first
(`VLLMNestedTupleGPUConnector`, or the transformers integration's `HFKVConnector`). A segment
whose load fails is a miss (logged), never an error.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lmcache.blend.interfaces import BlendRetriever, BlendRetrieverResult, BlendRetrieverTask
from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheEngineMetadata

logger = logging.getLogger(__name__)


def split_segments(tokens: torch.Tensor, spt: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` of each segment of the 1-D `tokens`: every segment but the last ends with
    a (non-overlapping, leftmost-first) occurrence of `spt`; a non-empty tail is the last one."""
    n, m = tokens.numel(), spt.numel()
    if m == 0:
        raise ValueError("the special token sequence must not be empty")
    ends: list[int] = []
    if n >= m:
        hits = (tokens.unfold(0, m, 1) == spt.to(tokens.device, tokens.dtype)).all(dim=1)
        next_free = 0
        for s in torch.nonzero(hits).squeeze(1).tolist():
            if s >= next_free:
                ends.append(s + m)
                next_free = s + m
    if not ends or ends[-1] != n:
        ends.append(n)
    starts = [0, *ends[:-1]]
    return [(s, e) for s, e in zip(starts, ends) if e > s]


class SPTBlendRetrieverTask(BlendRetrieverTask):
    """The per-segment loads of one input (`token_segments` in input order, one future each, each
    future resolving to the segment's CPU bool hit mask) into `kv_buffer`."""

    def __init__(self, token_segments: list[torch.Tensor], tasks: list[Future], fmt: str, *,
                 kv_buffer: torch.Tensor) -> None:
        if len(token_segments) != len(tasks):
            raise ValueError(f"{len(token_segments)} segments but {len(tasks)} tasks")
        self.token_segments = token_segments
        self.tasks = tasks
        self.fmt = fmt
        self.kv_buffer = kv_buffer
        self._lock = threading.Lock()
        self._valid: torch.Tensor | None = None
        self._original_positions: torch.Tensor | None = None

    def _finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if self._valid is None or self._original_positions is None:
                num_tokens = self.kv_buffer.shape[2]
                valid = torch.zeros(num_tokens, dtype=torch.bool)
                positions = torch.zeros(num_tokens, dtype=torch.int64)
                start = 0
                for seg, task in zip(self.token_segments, self.tasks):
                    n = seg.numel()
                    hit = task.result()
                    valid[start:start + n] = hit
                    positions[start:start + n] = torch.arange(n) * hit
                    start += n
                self._valid = valid
                self._original_positions = positions.to(self.kv_buffer.device)
            return self._valid, self._original_positions

    @property
    def num_retrieved_tokens(self) -> int:
        """Tokens whose KV was found (waits for the loads)."""
        return int(self._finish()[0].sum())

    def result(self, layer_id: int) -> BlendRetrieverResult:
        num_layers = self.kv_buffer.shape[1]
        if not 0 <= layer_id < num_layers:
            raise ValueError(f"layer_id={layer_id} is out of range for {num_layers} layers")
        valid, positions = self._finish()
        if not bool(valid.any()):
            return BlendRetrieverResult(None, None, valid, positions)
        kv = self.kv_buffer[:, layer_id]
        return BlendRetrieverResult(kv[0], kv[1], valid, positions)


class SPTBlendRetriever(BlendRetriever):
    def __init__(self, spt: torch.Tensor, cache_engine: LMCacheEngine, metadata: LMCacheEngineMetadata,
                 *, device: str | torch.device = "cpu", max_workers: int = 4) -> None:
        if spt.dim() != 1 or spt.numel() == 0 or spt.is_floating_point():
            raise ValueError(f"spt must be a non-empty 1-D integer tensor, got {spt.dtype} "
                             f"of shape {tuple(spt.shape)}")
        self.spt = spt.to("cpu", torch.int64)
        self.cache_engine = cache_engine
        self.metadata = metadata
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="lmcache-blend")

    def new_request(self, input_tokens: torch.Tensor, query_start_loc: torch.Tensor) -> SPTBlendRetrieverTask:
        tokens = input_tokens.to("cpu", torch.int64)
        if tokens.dim() != 1:
            raise ValueError(f"input_tokens must be 1-D, got shape {tuple(tokens.shape)}")
        qsl = query_start_loc.to("cpu").tolist()
        if len(qsl) < 2 or qsl[0] != 0 or qsl[-1] != tokens.numel() or qsl != sorted(qsl):
            raise ValueError(f"query_start_loc {qsl} must be non-decreasing from 0 to {tokens.numel()}")
        kv = torch.empty(2, self.metadata.num_layers, tokens.numel(), self.metadata.hidden_dim,
                         dtype=self.metadata.kv_dtype, device=self.device)
        segments: list[torch.Tensor] = []
        futures: list[Future] = []
        for lo, hi in itertools.pairwise(qsl):
            for s, e in split_segments(tokens[lo:hi], self.spt):
                segments.append(tokens[lo + s:lo + e])
                futures.append(self._pool.submit(self._load, segments[-1], kv[:, :, lo + s:lo + e]))
        return SPTBlendRetrieverTask(segments, futures, self.metadata.fmt, kv_buffer=kv)

    def _load(self, tokens: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Retrieve one segment into `kv` ``[2, L, n, hidden]``; its CPU bool hit mask."""
        kvcaches = [(kv[0, layer], kv[1, layer]) for layer in range(kv.shape[1])]
        try:
            return self.cache_engine.retrieve(tokens, kvcaches=kvcaches)
        except Exception as e:  # noqa: BLE001 - a failed load is a miss; the tokens are recomputed
            logger.warning("blend retrieval of a %d-token segment failed (recomputed instead): %s",
                           tokens.numel(), e)
            return torch.zeros(tokens.numel(), dtype=torch.bool)

    def close(self) -> None:
        """Stop the loader threads (waits for loads in flight)."""
        self._pool.shutdown(wait=True)
