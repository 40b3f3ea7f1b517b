"""An engine process on a cache server, driven by JSON lines on stdin (one answer line each).

Its KV cache is token-major and filled from a seed, so any process can tell what a prompt's KV
must be: ``store`` {tokens, seed} (answered once the server applied the commit); ``retrieve``
{tokens, seed} -> {hit, exact}; ``lookup`` {tokens} -> {hit}; ``reserve`` {n} (hold n slots, never
commit them); ``hold`` {tokens} (load the cached prefix and keep it); ``drop`` (let go of what was
held); ``attached`` -> {attached}; ``faults`` -> {failures, skipped} (the cache-server tier's
counters); ``close`` (how long the engine took to close goes to stderr). Arguments: the server's
URL and, optionally, the model's name (default "test-model") and the seconds the engine waits for
the server's answer (default 2).
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch

from lmcache.cache_engine import LMCacheEngine, _make_allocator
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import TokenMajorConnector
from lmcache.memory_management import release_all
from lmcache.process_exit import skip_final_collection
from lmcache.token_database import ChunkedTokenDatabase

LAYERS, HEADS, HEAD_SIZE, CHUNK, SLOTS = 2, 2, 4, 8, 512
HIDDEN = HEADS * HEAD_SIZE


def kv_cache(seed: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) of [SLOTS, HIDDEN]; zeros without a seed."""
    gen = torch.Generator().manual_seed(seed or 0)

    def one() -> torch.Tensor:
        t = torch.randn(SLOTS, HIDDEN, generator=gen).to(torch.bfloat16)
        return t if seed is not None else torch.zeros_like(t)

    return [(one(), one()) for _ in range(LAYERS)]


def build(url: str, model: str = "test-model", heartbeat_timeout: float = 2.0) -> LMCacheEngine:
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, cache_server_url=url,
                                               remote_timeout=heartbeat_timeout)
    metadata = LMCacheEngineMetadata(model, 1, 0, "vllm", torch.bfloat16,
                                     (LAYERS, 2, CHUNK, HEADS, HEAD_SIZE))
    return LMCacheEngine(config, metadata, _make_allocator(config, metadata),
                         ChunkedTokenDatabase(config, metadata), TokenMajorConnector(HIDDEN, LAYERS))


def run(engine: LMCacheEngine, cmd: dict) -> dict:
    op = cmd["op"]
    tokens = torch.tensor(cmd.get("tokens", []), dtype=torch.int64)
    if op == "store":
        engine.store(tokens, kvcaches=kv_cache(cmd["seed"]))
        # The commit is one-way: a request of this engine's own is answered after the server applied
        # it, so another engine asking next finds the chunks.
        engine.storage_manager.backends["CacheServer"].client.call("heartbeat")
        return {"stored": True}
    if op == "retrieve":
        target = kv_cache(None)
        mask = engine.retrieve(tokens, kvcaches=target)
        hit = int(mask.sum())
        want = kv_cache(cmd["seed"])
        exact = all(torch.equal(target[i][j][:hit], want[i][j][:hit]) for i in range(LAYERS) for j in (0, 1))
        return {"hit": hit, "exact": exact}
    if op == "lookup":
        return {"hit": engine.lookup(tokens)}
    if op == "reserve":
        got = [engine.memory_allocator.allocate(torch.Size([2, LAYERS, CHUNK, HIDDEN]), torch.bfloat16)
               for _ in range(cmd["n"])]
        held.extend(got)
        return {"slots": sum(obj is not None for obj in got)}
    if op == "hold":
        keys = [c.key for c in engine.token_database.process_tokens(tokens)]
        got = engine.storage_manager.get_prefix(keys)
        held.extend(got)
        return {"held": len(got)}
    if op == "drop":
        dropped = len(held)
        release_all(held)
        held.clear()
        return {"dropped": dropped}
    if op == "attached":
        return {"attached": engine.memory_allocator.available}
    if op == "faults":
        counted = engine.storage_manager.backends["CacheServer"].stats().counters
        return {name: counted[name] for name in ("failures", "skipped")}
    raise ValueError(f"unknown op {op!r}")


held: list = []

if __name__ == "__main__":
    skip_final_collection()  # as in vLLM's workers with the connector: seconds at exit, more under load
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = build(sys.argv[1], *sys.argv[2:3], *map(float, sys.argv[3:4]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "close":
            break
        print(json.dumps(run(engine, cmd)), flush=True)
    t0 = time.monotonic()
    engine.close()
    print(f"engine closed in {time.monotonic() - t0:.3f} s", file=sys.stderr)
