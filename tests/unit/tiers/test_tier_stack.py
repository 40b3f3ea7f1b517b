import logging

import torch

from lmcache.storage_backend import create_storage_backends
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.storage_backend.remote_backend import RemoteBackend
from tests.helpers import WRITE_WAIT
from tests.helpers.paged_kv import PagedKV, build_engine

UNREACHABLE = "redis://127.0.0.1:1?backoff=10"  # nothing listens on port 1


def test_tiers_are_built_in_lookup_order_without_contacting_the_store(tmp_path, meta, allocator):
    config = {"local_disk": str(tmp_path), "max_local_disk_size": 0.001, "remote_url": UNREACHABLE}
    from lmcache.config import LMCacheEngineConfig

    backends = create_storage_backends(LMCacheEngineConfig.from_defaults(**config), meta, allocator,
                                       allocator.allocate)
    assert list(backends) == ["Hot", "LocalDiskBackend", "RemoteBackend"]
    assert isinstance(backends["LocalDiskBackend"], LocalDiskBackend)
    assert isinstance(backends["RemoteBackend"], RemoteBackend)
    for b in backends.values():
        b.close()


def test_an_engine_with_an_unreachable_remote_serves_from_its_other_tiers(tmp_path, caplog):
    engine = build_engine(local_disk=str(tmp_path), max_local_disk_size=0.001, remote_url=UNREACHABLE)
    kv = PagedKV()
    tokens = torch.randint(0, 30000, (40,))
    slots = kv.slots_for(40)
    with caplog.at_level(logging.WARNING):
        engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
        for b in engine.storage_manager.backends.values():
            if hasattr(b, "puts"):
                assert b.puts.flush(WRITE_WAIT)
        assert engine.lookup(tokens, ["RemoteBackend"]) == 0
        assert engine.lookup(tokens, ["LocalDiskBackend"]) == 40
        out = kv.empty_like()
        assert int(engine.retrieve(tokens, kvcaches=out.layers, slot_mapping=slots).sum()) == 40
    assert torch.equal(out.tokens_kv(slots), kv.tokens_kv(slots))
    assert sum("treated as a cache miss" in r.message for r in caplog.records) == 1
    engine.close()
