"""Tiers under concurrent load: evictions (hot and disk), peer publishing and peer reads, lookups
with leases, prefetches and retrieves from several threads at once, against a real Valkey lookup
service, unsealed and sealed (`kv_encryption_key`). Nothing deadlocks (every thread finishes
within a bound), nothing wrong is served, no value fails to verify, and afterwards every engine
is at rest with its books balanced (no reference leaked)."""

from __future__ import annotations

import faulthandler
import random
import sys
import threading
import time

import pytest
import torch

from lmcache.storage_backend.serde.seal import write_key_file
from tests.helpers import WRITE_WAIT
from tests.helpers.paged_kv import PagedKV, build_engine

pytestmark = pytest.mark.integration

CHUNK = 8
SEQUENCES = 24
RUN_SECONDS = 3.0
JOIN_SECONDS = 60.0


def source(seq: int) -> tuple[torch.Tensor, PagedKV, torch.Tensor]:
    """Sequence `seq`: its tokens, the paged KV holding its rows and their slots."""
    n = CHUNK * (2 + seq % 4)
    tokens = torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seq))
    torch.manual_seed(10_000 + seq)
    kv = PagedKV(num_blocks=16)
    return tokens, kv, kv.slots_for(n)


def engine_for(lookup_url: str, disk: str | None, key_path: str | None):
    extra = {"local_disk": disk, "max_local_disk_size": 40 * 512 / 2**30} if disk else {}
    return build_engine(CHUNK, cpu_bytes=24 * 512, enable_p2p=True, lookup_url=lookup_url,
                        distributed_url="127.0.0.1:0", p2p_ttl=5.0, remote_timeout=2.0,
                        error_handling=False, kv_encryption_key=key_path, **extra)


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_evictions_peer_publishing_and_concurrent_lookups_neither_deadlock_nor_leak(valkey, tmp_path, sealed):
    url = f"redis://127.0.0.1:{valkey.port}"
    key_path = None
    if sealed:  # disk files and peer transfers sealed (kv_encryption_key)
        key_path = str(tmp_path / "kv.key")
        write_key_file(key_path)
    owner = engine_for(url, str(tmp_path / "disk"), key_path)  # stores; small tiers: constant eviction
    reader = engine_for(url, None, key_path)  # reads the owner's chunks through its peer tier
    sources = [source(s) for s in range(SEQUENCES)]
    deadline = time.monotonic() + RUN_SECONDS
    errors: list[BaseException] = []
    served = [0]

    def store_loop(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            tokens, kv, slots = sources[rng.randrange(SEQUENCES)]
            owner.store(tokens, kvcaches=kv.layers, slot_mapping=slots)

    def read_loop(engine, seed: int) -> None:
        rng = random.Random(seed)
        lease = 0
        while time.monotonic() < deadline:
            tokens, kv, slots = sources[rng.randrange(SEQUENCES)]
            lease += 1
            lease_id = f"{seed}-{lease}"
            engine.lookup(tokens, lease_id=lease_id)
            if rng.random() < 0.3:
                engine.prefetch(tokens)
            target = kv.empty_like()
            got = engine.retrieve(tokens, kvcaches=target.layers, slot_mapping=slots)
            engine.release(lease_id)
            hit = int(got.sum())
            assert bool(got[:hit].all()), "a retrieve's hits must be a prefix"
            assert torch.equal(target.tokens_kv(slots[:hit]), kv.tokens_kv(slots[:hit])), \
                "served KV differs from what was stored for these tokens"
            served[0] += hit

    def guarded(fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(store_loop, s), name=f"store-{s}") for s in range(2)]
    threads += [threading.Thread(target=guarded, args=(read_loop, owner, 10 + s), name=f"own-read-{s}")
                for s in range(2)]
    threads += [threading.Thread(target=guarded, args=(read_loop, reader, 20 + s), name=f"peer-read-{s}")
                for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline + JOIN_SECONDS - time.monotonic(), 0.1))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        faulthandler.dump_traceback(file=sys.stderr)
        pytest.fail(f"threads {stuck} still running {JOIN_SECONDS:.0f} s after the load stopped: deadlock")
    if errors:
        raise errors[0]
    stats = owner.storage_manager.stats()
    assert stats["Hot"].counters.get("evicted", 0) > 0 and stats["LocalDiskBackend"].counters["evicted"] > 0
    assert reader.storage_manager.stats()["PeerBackend"].counters.get("hits", 0) > 0
    assert served[0] > 0
    for engine, tier in ((owner, "LocalDiskBackend"), (reader, "PeerBackend")):
        counters = engine.storage_manager.stats()[tier].counters
        assert counters.get("forged", 0) == 0 and counters.get("corrupt", 0) == 0
    assert owner.storage_manager.backends["LocalDiskBackend"].puts.flush(WRITE_WAIT)
    for engine in (owner, reader):
        settle(engine)
    reader.close()
    owner.close()


def settle(engine, timeout: float = WRITE_WAIT) -> None:
    """Wait until `engine` is at rest with its books balanced (`check_integrity`), up to `timeout`
    s: after the load stops, work it started may still hold a chunk for a moment (the owner's peer
    server answering a read the reader gave up on, a prefetch finishing), most of all beside other
    tests. A leak never comes to rest: the last check's error is raised."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            engine.check_integrity()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
