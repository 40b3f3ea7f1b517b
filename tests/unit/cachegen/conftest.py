"""Fixtures for the CacheGen codec tests: engine config/metadata, KV-like tensors and checks.

(Tests run with --import-mode=importlib, so helpers are handed out as fixtures.)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lmcache.cachegen.encoded import CacheGenEncoderOutput
from lmcache.cachegen.quant import steps
from lmcache.cachegen.serde import CacheGenDeserializer, CacheGenSerializer
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.storage_backend.serde import blob

NLAYERS, HEADS, HEAD_SIZE, CHUNK = 4, 2, 16, 64


def _make_kv(nlayers: int = NLAYERS, ntokens: int = CHUNK, hidden: int = HEADS * HEAD_SIZE,
            dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """KV_BLOB-shaped [2, L, T, hidden] with what real KV has: per-channel offsets (a few large
    outlier channels), token norms varying over a decade, Laplace-ish noise, smooth channels."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.randn(2, nlayers, 1, hidden, generator=g)
    outliers = torch.rand(2, nlayers, 1, hidden, generator=g) < 0.05
    offsets = torch.where(outliers, offsets * 20, offsets)
    token_scale = torch.exp(torch.randn(2, nlayers, ntokens, 1, generator=g) * 0.6)
    u = torch.rand(2, nlayers, ntokens, hidden, generator=g) - 0.5
    noise = -torch.sign(u) * torch.log1p(-2 * u.abs())  # Laplace(0, 1)
    smooth = torch.cumsum(torch.randn(2, nlayers, ntokens, hidden, generator=g) * 0.1, dim=2)
    return (offsets + token_scale * noise + smooth).to(dtype)


@pytest.fixture
def engine_config() -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, remote_serde="cachegen")


@pytest.fixture
def metadata() -> LMCacheEngineMetadata:
    return LMCacheEngineMetadata("test-model", 1, 0, "vllm", torch.bfloat16,
                                 (NLAYERS, 2, CHUNK, HEADS, HEAD_SIZE))


@pytest.fixture
def serde(engine_config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata
          ) -> tuple[CacheGenSerializer, CacheGenDeserializer]:
    return (CacheGenSerializer(engine_config, metadata),
            CacheGenDeserializer(engine_config, metadata, metadata.kv_dtype))


def _stream_of(data: bytes) -> CacheGenEncoderOutput:
    """The parsed cachegen stream inside a blob."""
    return CacheGenEncoderOutput.from_bytes(blob.unpack(data, "cachegen").payload)


def _step_sizes(data: bytes) -> torch.Tensor:
    """The quantization step of every (K/V, layer, token) of a blob: [2, L, T, 1] float32."""
    out = _stream_of(data)
    exps = torch.stack([out.max_tensors_key, out.max_tensors_value]).numpy()
    return torch.from_numpy(steps(exps))[..., None]


def _assert_within_half_step(original: torch.Tensor, decoded: torch.Tensor, data: bytes) -> None:
    """|x - x_hat| <= step / 2, allowing the rounding of x_hat to the output dtype."""
    rel = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(decoded.dtype, 1e-6)
    err = (decoded.float() - original.float()).abs()
    bound = _step_sizes(data) * (0.5 + 1e-5) + decoded.float().abs() * rel + 1e-30
    assert bool((err <= bound).all()), f"max excess {(err - bound).max():.3g}"


@pytest.fixture
def make_kv() -> Callable[..., torch.Tensor]:
    return _make_kv


@pytest.fixture
def stream_of() -> Callable[[bytes], CacheGenEncoderOutput]:
    return _stream_of


@pytest.fixture
def within_half_step() -> Callable[[torch.Tensor, torch.Tensor, bytes], None]:
    return _assert_within_half_step


@pytest.fixture
def dims() -> dict[str, int]:
    return {"nlayers": NLAYERS, "heads": HEADS, "head_size": HEAD_SIZE, "chunk": CHUNK,
            "hidden": HEADS * HEAD_SIZE}
