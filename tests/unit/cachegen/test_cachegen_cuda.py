"""CacheGen with KV on a CUDA device (runs only where CUDA is present)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kv_round_trips_within_half_a_step(serde, make_kv, within_half_step, dtype) -> None:
    ser, de = serde
    kv = make_kv(dtype=dtype).cuda()
    data = ser.to_bytes(kv)  # quantization runs on the device, entropy coding on the host
    out = de.from_bytes(data)
    assert out.shape == kv.shape and out.dtype == dtype
    within_half_step(kv.cpu(), out.cpu(), data)
