"""HFKVConnector: copies between KV_BLOB objects and HF-layout / token-major per-layer tensors."""

from __future__ import annotations

import pytest
import torch

from lmcache.integration.transformers.connector import HFKVConnector
from lmcache.memory_management import MemoryFormat, MemoryObj, MixedMemoryAllocator

L, H, D = 3, 2, 4


@pytest.fixture(scope="module")
def allocator() -> MixedMemoryAllocator:
    return MixedMemoryAllocator(1 << 20)


def blob(allocator: MixedMemoryAllocator, n: int) -> MemoryObj:
    obj = allocator.allocate(torch.Size([2, L, n, H * D]), torch.float32, MemoryFormat.KV_BLOB)
    assert obj is not None
    return obj


def hf_cache(num_tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, H, num_tokens, D, generator=g), torch.randn(1, H, num_tokens, D, generator=g))
            for _ in range(L)]


def test_hf_layout_round_trips_a_token_range(allocator: MixedMemoryAllocator) -> None:
    conn = HFKVConnector(L, H, D)
    src = hf_cache(40)
    obj = blob(allocator, 24)
    conn.from_gpu(obj, 16, 40, kvcaches=src)
    assert obj.tensor is not None
    # the blob is canonical token-major: [2, L, n, H*D]
    expected_k0 = src[0][0][0, :, 16:40].transpose(0, 1).reshape(24, H * D)
    assert torch.equal(obj.tensor[0, 0], expected_k0)
    dst = [(torch.zeros(1, H, 40, D), torch.zeros(1, H, 40, D)) for _ in range(L)]
    conn.to_gpu(obj, 16, 40, kvcaches=dst)
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[:, :, 16:40], sk[:, :, 16:40]) and torch.equal(dv[:, :, 16:40], sv[:, :, 16:40])
        assert not dk[:, :, :16].any()
    obj.ref_count_down()


@pytest.mark.parametrize("shape", [(40, H * D), (40, H, D)])
def test_token_major_tensors_give_the_same_blob_as_hf_layout(allocator: MixedMemoryAllocator,
                                                             shape: tuple[int, ...]) -> None:
    conn = HFKVConnector(L, H, D)
    src = hf_cache(40, seed=1)
    token_major = [tuple(t[0].transpose(0, 1).reshape(shape).contiguous() for t in layer) for layer in src]
    a, b = blob(allocator, 10), blob(allocator, 10)
    conn.from_gpu(a, 5, 15, kvcaches=src)
    conn.from_gpu(b, 5, 15, kvcaches=token_major)
    assert a.tensor is not None and b.tensor is not None and torch.equal(a.tensor, b.tensor)
    dst = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(L)]
    conn.to_gpu(b, 5, 15, kvcaches=dst)
    assert torch.equal(dst[2][1][5:15], token_major[2][1][5:15])
    a.ref_count_down()
    b.ref_count_down()


@pytest.mark.parametrize(("bad", "match"), [
    (torch.zeros(2, H, 40, D), "expected \\[1, 2"),
    (torch.zeros(1, H + 1, 40, D), "expected \\[1, 2"),
    (torch.zeros(1, H, 10, D), "cannot provide tokens"),
    (torch.zeros(1, H, 40, D, dtype=torch.float16), "dtype"),
    (torch.zeros(40, H * D + 1), "cannot provide tokens"),
])
def test_tensors_that_cannot_hold_the_range_are_rejected(allocator: MixedMemoryAllocator,
                                                         bad: torch.Tensor, match: str) -> None:
    conn = HFKVConnector(L, H, D)
    caches = hf_cache(40)
    caches[1] = (bad, caches[1][1])
    obj = blob(allocator, 24)
    with pytest.raises(ValueError, match=match):
        conn.from_gpu(obj, 16, 40, kvcaches=caches)
    obj.ref_count_down()


def test_a_wrong_number_of_layers_is_rejected(allocator: MixedMemoryAllocator) -> None:
    obj = blob(allocator, 8)
    with pytest.raises(ValueError, match="3 per-layer"):
        HFKVConnector(L, H, D).to_gpu(obj, 0, 8, kvcaches=hf_cache(8)[:2])
    obj.ref_count_down()
