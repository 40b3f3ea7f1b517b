"""``LMCACHE_COPY_ISA`` picks the native kernels' vector path: any path this CPU runs, by name; a path
it lacks (or a name that is no path) is capped to the widest it has, with one warning."""

import logging

import pytest
import torch

from lmcache import native
from lmcache.cachegen.kernels import NativeKernels, kernels
from lmcache.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.memory_management import HostMemoryAllocator, MemoryFormat
from tests.helpers.copy_paths import NATIVE_PATHS

pytestmark = pytest.mark.skipif(not native.copy_isas(), reason="no native x86 kernels here")


def widest() -> str:
    return native.copy_isas()[-1]


def cachegen_build(isa: str) -> str | None:
    coder = kernels(isa=isa)
    assert isinstance(coder, NativeKernels)
    return coder.path


@pytest.mark.parametrize("path", NATIVE_PATHS)
def test_each_path_the_cpu_runs_is_selected_by_name(monkeypatch, path):
    monkeypatch.setenv(native.COPY_ISA_ENV, path)
    assert native.copy_isa() == path
    lib = native.load()
    assert lib is not None and native.COPY_ISAS[lib.lmc_copy_isa()] == path
    # CacheGen's kernels: their build for that path (one per path)
    assert cachegen_build(path) == path


def test_without_a_cap_the_widest_path_the_cpu_has_is_used(monkeypatch):
    monkeypatch.delenv(native.COPY_ISA_ENV, raising=False)
    assert native.copy_isa() == widest()
    assert native.COPY_ISAS.index(cachegen_build(widest()) or "sse2") <= native.COPY_ISAS.index(widest())


@pytest.mark.parametrize("path", [*native.COPY_ISAS, "avx1024"])
def test_a_path_the_cpu_lacks_is_capped_to_its_widest_with_one_warning(monkeypatch, caplog, path):
    """A forced path the CPU cannot run never reaches its instructions: the copies take the
    widest path there is (checked by a copy large enough to stream whole lines) and say so once."""
    if path in native.copy_isas():
        pytest.skip(f"this CPU runs the {path} path")
    monkeypatch.setenv(native.COPY_ISA_ENV, path)
    monkeypatch.setattr(native, "_isa_warned", set())
    with caplog.at_level(logging.WARNING, logger="lmcache.native"):
        assert native.copy_isa() == widest()
        assert native.copy_isa() == widest()
    warnings = [r.getMessage() for r in caplog.records if native.COPY_ISA_ENV in r.getMessage()]
    assert len(warnings) == 1 and path in warnings[0]
    assert cachegen_build(path) in native.copy_isas()

    layers, heads, head, n = 6, 6, 40, 2048  # 12 MB of bf16 KV (480-byte rows): the gather streams
    hidden = heads * head
    caches = [torch.randn(2, n // 16, 16, heads, head).to(torch.bfloat16) for _ in range(layers)]
    slots = torch.randperm(n)
    conn = VLLMPagedMemGPUConnectorV2(hidden, layers)
    obj = HostMemoryAllocator(2 * conn.get_shape(n).numel() + (1 << 20)).allocate(
        conn.get_shape(n), torch.bfloat16, MemoryFormat.KV_BLOB)
    conn.from_gpu(obj, 0, n, kvcaches=caches, slot_mapping=slots)
    expected = torch.stack([torch.stack([c[i].reshape(n, hidden)[slots] for c in caches]) for i in (0, 1)])
    assert torch.equal(obj.tensor, expected)
