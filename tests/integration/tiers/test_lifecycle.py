"""An engine gives back what it takes when it is destroyed: its arena, threads and files, at once
(not when Python's cycle collector happens to run)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lmcache.cache_engine import LMCacheEngineBuilder
from lmcache.config import LEGACY_BACKENDS, LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from tests.integration.tiers.test_engine_tiers import retrieve_equal, store

pytestmark = pytest.mark.integration
ARENA_GB = 0.5


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_engines_of_every_backend_name_built_and_destroyed_in_a_loop_hold_memory_threads_and_files_flat(
        tmp_path, valkey):
    metadata = LMCacheEngineMetadata("test-model", 1, 0, "vllm", torch.bfloat16, (2, 2, 8, 2, 4))
    names = sorted(LEGACY_BACKENDS)
    baseline: tuple[int, int, int] | None = None
    for round_ in range(2):
        for name in names:
            config = LMCacheEngineConfig.from_legacy(
                chunk_size=8, backend=name, max_local_cache_size=ARENA_GB, local_disk=str(tmp_path / "disk"),
                remote_url=f"redis://127.0.0.1:{valkey.port}" if "remote" in name else None)
            engine = LMCacheEngineBuilder.get_or_create(f"loop-{name}", config, metadata,
                                                        VLLMPagedMemGPUConnectorV2(8, 2))
            kv, tokens, slots = store(engine, seed=round_)
            assert retrieve_equal(engine, kv, tokens, slots) == 40
            LMCacheEngineBuilder.destroy(f"loop-{name}")
            now = (rss_bytes(), threading.active_count(), open_files())
            if baseline is None:  # after the first engine: imports, thread pools and caches are warm
                baseline = now
                continue
            # the caller still holds `engine` (and through it every cycle it is part of)
            assert now[0] < baseline[0] + (ARENA_GB * (1 << 30)) / 4, f"RSS grew after {name}: {now[0]}"
            assert now[1] <= baseline[1], f"threads left running after {name}"
            assert now[2] <= baseline[2], f"files left open after {name}"
