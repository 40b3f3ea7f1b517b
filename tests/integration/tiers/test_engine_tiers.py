"""The engine over the lower tiers: round trips through each tier and serde, sharing between
engines and processes, persistence across restarts, and processes killed while writing."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmcache.cachegen import format as cachegen_format
from lmcache.cachegen import gpu as cachegen_gpu
from lmcache.cachegen.encoded import CacheGenEncoderOutput
from lmcache.config import LMCacheEngineConfig
from lmcache.memory_management import MixedMemoryAllocator
from lmcache.storage_backend.disk_file import SUFFIX, TMP_SUFFIX
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.storage_backend.serde import blob
from tests.helpers import WRITE_WAIT
from tests.helpers.paged_kv import PagedKV, build_engine
from tests.helpers.servers import REPO
from tests.integration.tiers import disk_worker

pytestmark = pytest.mark.integration
WORKER = str(Path(__file__).with_name("disk_worker.py"))


def worker(*args: str, wait: bool = True) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    if wait:
        proc.wait(timeout=60)
        assert proc.returncode == 0
    return proc


def flush(engine) -> None:
    for name in ("LocalDiskBackend", "RemoteBackend"):
        backend = engine.storage_manager.backends.get(name)
        if backend is not None:
            assert backend.puts.flush(WRITE_WAIT)


def store(engine, n_tokens=40, seed=0):
    torch.manual_seed(seed)
    kv = PagedKV()
    tokens = torch.randint(0, 30000, (n_tokens,))
    slots = kv.slots_for(n_tokens)
    engine.store(tokens, kvcaches=kv.layers, slot_mapping=slots)
    flush(engine)
    return kv, tokens, slots


def retrieve_equal(engine, kv, tokens, slots) -> int:
    out = kv.empty_like()
    ret = engine.retrieve(tokens, kvcaches=out.layers, slot_mapping=slots)
    n = int(ret.sum())
    assert torch.equal(out.tokens_kv(slots[:n]), kv.tokens_kv(slots[:n])), "retrieved KV differs"
    return n


@pytest.fixture
def engines():
    made = []

    def make(**cfg):
        e = build_engine(**cfg)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture(params=["disk", "valkey", "lm"])
def tier_cfg(request, tmp_path):
    if request.param == "disk":
        return {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}
    if request.param == "valkey":
        return {"remote_url": request.getfixturevalue("valkey").url}
    return {"remote_url": request.getfixturevalue("lm_server")().url}


@pytest.mark.parametrize("serde", ["naive", "fast", "torch", "safe"])
def test_a_second_engine_retrieves_from_the_lower_tier_with_each_serde(engines, tier_cfg, serde):
    field = "local_disk_serde" if "local_disk" in tier_cfg else "remote_serde"
    cfg = {**tier_cfg, field: serde}
    a, b = engines(**cfg), engines(**cfg)
    kv, tokens, slots = store(a)
    tier = "LocalDiskBackend" if "local_disk" in cfg else "RemoteBackend"
    assert b.lookup(tokens, ["Hot"]) == 0 and b.lookup(tokens, [tier]) == 40
    assert retrieve_equal(b, kv, tokens, slots) == 40
    assert b.lookup(tokens, ["Hot"]) == 40  # lower-tier hits were promoted to the hot tier


@pytest.mark.parametrize("serde", ["naive", "fast", "torch", "safe"])
def test_mla_latents_and_recurrent_states_round_trip_through_each_tier_and_serde(engines, tier_cfg, serde):
    """The chunk forms of today's models: [1, layers, tokens, latent] MLA chunks, and a hybrid
    model's recurrent state beside them, come back from every tier bit for bit."""
    from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2

    field = "local_disk_serde" if "local_disk" in tier_cfg else "remote_serde"
    layers, width, n = 2, 24, 16

    def mla_engine():
        connector = VLLMPagedMemGPUConnectorV2(width, layers, layout="mla")
        return engines(**tier_cfg, **{field: serde}, layers=layers, heads=1, head_size=width, kv_count=1,
                       state_layout="state+test", connector=connector)

    a, b = mla_engine(), mla_engine()
    caches = [torch.randn(12, 4, width).to(torch.bfloat16) for _ in range(layers)]  # [blocks, bs, latent]
    tokens, slots = torch.randint(0, 30000, (n,)), torch.arange(n) + 8
    state = torch.randint(0, 256, (100,), dtype=torch.uint8)
    a.store(tokens, kvcaches=caches, slot_mapping=slots)
    assert a.store_state(tokens, 100, lambda buf: buf.copy_(state) is not None)
    flush(a)
    tier = "LocalDiskBackend" if "local_disk" in tier_cfg else "RemoteBackend"
    assert b.lookup(tokens, [tier]) == n
    out = [torch.zeros_like(c) for c in caches]
    assert bool(b.retrieve(tokens, kvcaches=out, slot_mapping=slots).all())
    for mine, theirs in zip(out, caches):
        assert torch.equal(mine.view(-1, width)[slots], theirs.view(-1, width)[slots])
    got = b.retrieve_state(tokens)
    assert torch.equal(got.tensor.view(torch.uint8)[:100], state)
    got.ref_count_down()


def test_all_three_tiers_together_and_prefetch(engines, tmp_path, valkey):
    cfg = {"local_disk": str(tmp_path / "d"), "max_local_disk_size": 0.01, "remote_url": valkey.url}
    kv, tokens, slots = store(engines(**cfg))
    remote_only = engines(remote_url=valkey.url)
    remote_only.prefetch(tokens)
    deadline = time.monotonic() + 5
    while remote_only.lookup(tokens, ["Hot"]) < 40:
        assert time.monotonic() < deadline, "prefetch did not fill the hot tier"
        time.sleep(0.02)
    assert retrieve_equal(remote_only, kv, tokens, slots) == 40
    with pytest.raises(ValueError, match="unknown storage backend"):
        remote_only.lookup(tokens, ["Disk"])


@pytest.mark.parametrize("store_kind", ["valkey", "lm"])
def test_two_engines_sharing_one_store_get_each_others_hits(engines, request, store_kind):
    url = (request.getfixturevalue("valkey").url if store_kind == "valkey"
           else request.getfixturevalue("lm_server")().url)
    a, b = engines(remote_url=url), engines(remote_url=url)
    kv1, t1, s1 = store(a, seed=1)
    kv2, t2, s2 = store(b, seed=2)
    assert retrieve_equal(b, kv1, t1, s1) == 40 and retrieve_equal(a, kv2, t2, s2) == 40


def test_an_engine_keeps_serving_while_the_remote_is_down(engines, valkey):
    e = engines(remote_url=valkey.url + "?backoff=5", error_handling=False)
    valkey.kill()
    kv, tokens, slots = store(e)  # hot tier keeps it; the remote put is skipped
    assert retrieve_equal(e, kv, tokens, slots) == 40
    fresh = engines(remote_url=valkey.url)
    assert fresh.lookup(tokens) == 0 and retrieve_equal(fresh, kv, tokens, slots) == 0


def test_disk_cache_survives_a_process_restart(engines, tmp_path):
    d = str(tmp_path / "disk")
    worker("engine-store", d, "7", "40")
    e = engines(local_disk=d, max_local_disk_size=0.01)
    torch.manual_seed(7)
    kv = PagedKV()
    tokens = torch.randint(0, 30000, (40,))
    assert e.lookup(tokens) == 40
    assert retrieve_equal(e, kv, tokens, kv.slots_for(40)) == 40


def reader_disk(path: str) -> LocalDiskBackend:
    config = LMCacheEngineConfig.from_defaults(local_disk=path, max_local_disk_size=1.0)
    arena = MixedMemoryAllocator(4 * disk_worker.SHAPE.numel() * 2)
    return LocalDiskBackend(config, disk_worker.META, arena.allocate)


def test_no_corrupt_entry_is_served_after_a_writer_is_killed_mid_write(tmp_path):
    d = str(tmp_path / "disk")
    proc = worker("write-forever", d, "20", wait=False)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    complete = sorted(n for n in os.listdir(d) if n.endswith(SUFFIX))
    assert complete, "the writer was killed before it finished a single file"
    victim = os.path.join(d, complete[0])  # and a torn final file, as a crash without rename leaves
    os.truncate(victim, os.path.getsize(victim) // 2)
    restarted = reader_disk(d)  # load_disk: drops the dead writer's temporary files
    assert not any(n.endswith(TMP_SUFFIX) for n in os.listdir(d))
    hits, wrong = disk_worker.read_all(restarted, 20)
    assert wrong == 0 and hits == len(complete) - 1 and restarted.num_corrupt == 1
    assert not os.path.exists(victim)
    restarted.close()


def test_processes_sharing_a_directory_never_read_torn_files(tmp_path):
    """Two writer processes store overlapping chunks (3..5 by both) while this process reads."""
    d = str(tmp_path / "disk")
    writers = [worker("write", d, "0", "6", wait=False), worker("write", d, "3", "3", wait=False)]
    reader = reader_disk(d)
    while any(w.poll() is None for w in writers):
        _, wrong = disk_worker.read_all(reader, 6)
        assert wrong == 0 and reader.num_corrupt == 0
        time.sleep(0.01)
    assert [w.returncode for w in writers] == [0, 0]
    assert disk_worker.read_all(reader, 6) == (6, 0)
    assert reader.num_corrupt == 0 and reader_disk(d).stats().gauges["files"] == 6
    reader.close()


def test_cachegen_serde_through_each_tier_is_lossy_but_close(engines, tier_cfg):
    field = "local_disk_serde" if "local_disk" in tier_cfg else "remote_serde"
    cfg = {**tier_cfg, field: "cachegen"}
    a, b = engines(**cfg), engines(**cfg)
    kv, tokens, slots = store(a)
    out = kv.empty_like()
    assert int(b.retrieve(tokens, kvcaches=out.layers, slot_mapping=slots).sum()) == 40
    want, got = kv.tokens_kv(slots).float(), out.tokens_kv(slots).float()
    assert not torch.equal(want, got)  # CacheGen is lossy ...
    # ... but close: random test KV has no structure, so the error is about step / sqrt(12) ~ 0.15 RMS
    assert float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()) < 0.25


def test_corrupt_cachegen_disk_file_is_a_miss_and_is_removed(engines, tmp_path):
    disk = tmp_path / "cg"
    cfg = {"local_disk": str(disk), "max_local_disk_size": 0.01, "local_disk_serde": "cachegen"}
    kv, tokens, slots = store(engines(**cfg))
    files = sorted(disk.glob("*" + SUFFIX))
    assert files
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0x40
    files[0].write_bytes(bytes(data))
    reader = engines(**cfg)
    out = kv.empty_like()
    hit = int(reader.retrieve(tokens, kvcaches=out.layers, slot_mapping=slots).sum())
    assert hit < 40 and not files[0].exists()


@pytest.mark.skipif(cachegen_gpu.available(), reason="CUDA and nvCOMP present: it would decode")
def test_gpu_coded_cachegen_disk_file_on_a_cpu_reader_is_a_miss_and_is_kept(engines, tmp_path):
    disk = tmp_path / "cg"
    cfg = {"local_disk": str(disk), "max_local_disk_size": 0.01, "local_disk_serde": "cachegen"}
    kv, tokens, slots = store(engines(**cfg))
    files = sorted(disk.glob("*" + SUFFIX))
    data = files[0].read_bytes()
    (key_len,) = struct.unpack_from("<I", data, 4)
    head = 8 + key_len
    old = blob.unpack(data[head:], "cachegen")
    stream = CacheGenEncoderOutput.from_bytes(old.payload)
    stream.coder = cachegen_format.CODER_NVCOMP  # as a CUDA writer with nvCOMP would have coded it
    stream.bytestream, stream.start_indices = bytes(64), torch.tensor([[0, 64]])
    stream.symbol_ranges = torch.empty(0, 2, dtype=torch.int32)
    payload = stream.to_bytes()
    files[0].write_bytes(data[:head] + blob.pack_header("cachegen", old.shape, old.dtype, payload)
                         + payload)
    reader = engines(**cfg)
    out = kv.empty_like()
    hit = int(reader.retrieve(tokens, kvcaches=out.layers, slot_mapping=slots).sum())
    assert hit < 40 and files[0].exists()  # a miss, but kept for readers that can decode it
