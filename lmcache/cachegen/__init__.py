"""CacheGen: a codec that compresses KV caches (per-token quantization + entropy coding) so the disk
and remote tiers move and hold several times less data. The tiers use it as the `cachegen` serde.

Modules, in the order the data meets them:

- `config`: `QuantizationSpec`, `CacheGenConfig` — quantization bins per (K/V, layer);
  `tables`: the bin tables fitted for known models.
- `quant`: the quantizer's arithmetic (per-channel means, RMS-relative per-token steps, anchor
  tokens) and the numpy reference of its data passes.
- `layout`: channel classes and symbol groups (which frequency table codes which symbol) and the
  substreams (`CodeLayout`).
- `rans`: the interleaved-rANS entropy coder: frequency tables and the numpy reference coder.
- `kernels`: the data passes on the CPU, `NativeKernels` (C, `lmcache/native/cachegen_kernels.c`)
  or `ReferenceKernels` (numpy), bit-identical.
- `gpu`: the same quantizer in torch with nvCOMP's ANS coder, on a CUDA device (optional).
- `encoder`: KV -> symbols -> coded token blocks (`CacheGenEncoderImpl`, `encode_stream`).
- `encoded`: the encoder output in memory (`CacheGenEncoderOutput`, `CacheGenGPUEncoderOutput`).
- `format`: the versioned binary stream (`pack` / `unpack`, `CorruptBlobError` for bad bytes).
- `decoder`: stream -> KV in one fused pass (`StreamTables`, `decode_stream`, `decode_kv`).
- `serde`: `CacheGenSerializer` / `CacheGenDeserializer`, the stream inside the common blob header.

Encode: `CacheGenSerializer.to_parts(kv [2, L, T, C])` -> `encoder.code_blocks` (kernels:
statistics -> `quant` steps -> symbols -> `layout` groups -> `rans` tables and substreams) ->
`format.pack_fields` -> `blob.pack_header`. Decode: `CacheGenDeserializer.from_bytes(blob)` ->
`blob.unpack` -> `format.unpack` -> `encoded.CacheGenEncoderOutput` -> `decoder.decode_stream`
(kernels: substreams -> symbols -> ``q * step + mean`` in the output dtype). With CUDA and nvCOMP
present, `gpu.encode` / `gpu.decode` take the coder's place.

The seed documents' paths `lmcache.storage_backend.serde.cachegen_*` are aliases of these modules;
the seed's helpers that the codec never calls live in `lmcache.compat.cachegen_seed`.
"""

from lmcache.cachegen.config import CacheGenConfig, QuantizationSpec
from lmcache.cachegen.decoder import StreamTables, decode_kv, decode_stream
from lmcache.cachegen.encoded import CacheGenEncoderOutput, CacheGenGPUBytestream, CacheGenGPUEncoderOutput
from lmcache.cachegen.encoder import CacheGenEncoderImpl, encode_stream
from lmcache.cachegen.format import StaleStreamError, UnavailableCoderError
from lmcache.cachegen.serde import CacheGenDeserializer, CacheGenSerializer

__all__ = [
    "CacheGenConfig", "CacheGenDeserializer", "CacheGenEncoderImpl", "CacheGenEncoderOutput",
    "CacheGenGPUBytestream", "CacheGenGPUEncoderOutput", "CacheGenSerializer", "QuantizationSpec",
    "StaleStreamError", "StreamTables", "UnavailableCoderError", "decode_kv", "decode_stream",
    "encode_stream",
]
