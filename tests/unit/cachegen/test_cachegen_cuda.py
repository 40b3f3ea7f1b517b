"""CacheGen with KV on a CUDA device (runs only where CUDA is present; the nvCOMP coder also
needs the optional extra lmcache[gpu])."""

import pytest
import torch

from lmcache.cachegen import format as fmt
from lmcache.cachegen import gpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_nvcomp = pytest.mark.skipif(not gpu.available(), reason="needs nvCOMP (lmcache[gpu])")


@needs_nvcomp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kv_is_coded_on_the_device_within_half_a_step(serde, make_kv, within_half_step,
                                                          stream_of, dtype) -> None:
    ser, de = serde
    kv = make_kv(dtype=dtype).cuda()
    data = ser.to_bytes(kv)
    assert stream_of(data).coder == fmt.CODER_NVCOMP
    out = de.from_bytes(data)
    assert out.shape == kv.shape and out.dtype == dtype
    within_half_step(kv.cpu(), out.cpu(), data)


@needs_nvcomp
def test_a_corrupt_nvcomp_payload_is_rejected(serde, make_kv, stream_of) -> None:
    from lmcache.storage_backend.serde import blob
    from lmcache.storage_backend.serde.serde import CorruptBlobError

    data = serde[0].to_bytes(make_kv().cuda())
    out = stream_of(data)
    out.bytestream = out.bytestream[: len(out.bytestream) // 2]
    out.start_indices = torch.tensor([[0, len(out.bytestream)]])
    head = blob.unpack(data)
    payload = out.to_bytes()
    with pytest.raises(CorruptBlobError):
        serde[1].from_bytes(blob.pack_header("cachegen", head.shape, head.dtype, payload) + payload)


@pytest.mark.skipif(gpu.available(), reason="nvCOMP present: KV goes to the GPU coder")
def test_cuda_kv_without_nvcomp_uses_the_cpu_coder(serde, make_kv, within_half_step,
                                                   stream_of) -> None:
    ser, de = serde
    kv = make_kv().cuda()
    data = ser.to_bytes(kv)
    assert stream_of(data).coder == fmt.CODER_RANS
    within_half_step(kv.cpu(), de.from_bytes(data), data)


@needs_nvcomp
def test_an_altered_nvcomp_payload_byte_is_rejected(serde, make_kv, stream_of) -> None:
    from lmcache.storage_backend.serde import blob
    from lmcache.storage_backend.serde.serde import CorruptBlobError

    data = serde[0].to_bytes(make_kv().cuda())
    out = stream_of(data)
    body = bytearray(out.bytestream)
    body[len(body) // 2] ^= 0xFF  # coded data, well past nvCOMP's container header
    out.bytestream = bytes(body)
    head = blob.unpack(data)
    payload = out.to_bytes()
    with pytest.raises(CorruptBlobError):
        serde[1].from_bytes(blob.pack_header("cachegen", head.shape, head.dtype, payload) + payload)
