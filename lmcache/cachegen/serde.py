"""The CacheGen serde: the `Serializer` / `Deserializer` pair the storage tiers use (`cachegen`).

`CacheGenSerializer.to_bytes(kv)` encodes one KV_BLOB chunk ``[2, L, T, C]`` (T <= chunk_size) as a
single token block (`encoder`; on the CUDA device with nvCOMP where present, `gpu`), packs the
coder's arrays (`format.pack_fields`) and wraps the stream in the common blob header
(`lmcache.storage_backend.serde.blob`). `CacheGenDeserializer.from_bytes(blob)` validates that
header, parses the stream and decodes it (`decoder.decode_stream`); `from_bytes_to` decodes
straight into the arena buffer the tier allocates (no extra copy), in the engine's KV dtype.

Errors: anything inconsistent raises `CorruptBlobError` (the tiers count a miss and delete the
value), also a blob that is not a float chunk of this engine's shape (checked before decoding); a
stream of the previous format version raises its subclass `StaleStreamError`; an
nvCOMP-coded stream where CUDA or nvCOMP is missing raises `UnavailableCoderError` (a miss, the
value kept). Each of the last two is logged once per process.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from lmcache.cachegen import format as fmt
from lmcache.cachegen import gpu
from lmcache.cachegen.config import CacheGenConfig
from lmcache.cachegen.decoder import decode_stream
from lmcache.cachegen.encoded import CacheGenEncoderOutput
from lmcache.cachegen.encoder import FLOAT_DTYPES, check_kv, code_blocks
from lmcache.cachegen.kernels import Kernels
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import MemoryFormat, MemoryObj
from lmcache.observability import log_once
from lmcache.storage_backend.serde import blob
from lmcache.storage_backend.serde.serde import AllocateFn, CorruptBlobError, Deserializer, Serializer

logger = logging.getLogger(__name__)


def _check_kv_pairs(metadata: LMCacheEngineMetadata) -> None:
    if metadata.kv_count != 2:
        raise ValueError("CacheGen codes K and V per layer; this engine stores one latent per token "
                         "and layer (MLA): choose another serde (naive, fast, safe, torch)")


class CacheGenSerializer(Serializer):
    """Bins come from `cachegen_config` if given (it must have the model's layer count), else
    `CacheGenConfig.from_model_name` (the model's fitted table, or the layer-count default)
    scaled by `config.cachegen_quality`. `coder`: the CPU kernels (default: native where
    available, else the numpy reference). Raises ValueError for an MLA engine (one latent per
    token and layer) or a `cachegen_config` of another layer count."""

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                 cachegen_config: CacheGenConfig | None = None, coder: Kernels | None = None) -> None:
        _check_kv_pairs(metadata)
        self.coder = coder
        self.chunk_size = config.chunk_size
        self.num_heads, self.head_size = metadata.kv_shape[3], metadata.kv_shape[4]
        if cachegen_config is None:
            cachegen_config = CacheGenConfig.from_model_name(metadata.model_name, metadata.num_layers)
            if config.cachegen_quality != 1.0:
                cachegen_config = cachegen_config.scaled(config.cachegen_quality)
        elif cachegen_config.nlayers != metadata.num_layers:
            raise ValueError(f"cachegen_config covers {cachegen_config.nlayers} layers, the model has "
                             f"{metadata.num_layers}")
        self.cachegen_config = cachegen_config
        self.key_bins = self.make_key_bins(self.cachegen_config)
        self.value_bins = self.make_value_bins(self.cachegen_config)

    def make_key_bins(self, config: CacheGenConfig) -> torch.Tensor:
        return torch.tensor(config.key_bins(), dtype=torch.int32)

    def make_value_bins(self, config: CacheGenConfig) -> torch.Tensor:
        return torch.tensor(config.value_bins(), dtype=torch.int32)

    def to_bytes(self, tensor: torch.Tensor) -> bytes:
        """KV_BLOB chunk [2, L, T, num_heads * head_size] -> blob (header + cachegen stream)."""
        return b"".join(self.to_parts(tensor))

    def to_parts(self, tensor: torch.Tensor) -> list[bytes | memoryview]:
        """The blob as [header, stream header and tables, substreams] (what the tiers write;
        saves joining them)."""
        if tensor.dim() != 4 or tensor.shape[3] != self.num_heads * self.head_size \
                or tensor.shape[2] > self.chunk_size:
            raise ValueError(f"CacheGen serializes KV_BLOB [2, L, T <= {self.chunk_size}, "
                             f"{self.num_heads * self.head_size}]; got {tuple(tensor.shape)}")
        check_kv(tensor, self.cachegen_config.nlayers, 1)
        if gpu.available():  # packed straight from the encoder's pinned payload (no copy)
            enc = gpu.encode(tensor, self.key_bins, self.value_bins)
            exps = torch.stack([enc.max_tensors_key, enc.max_tensors_value]).flatten(0, 1)
            parts = list(fmt.pack_fields(
                fmt.CODER_NVCOMP, self.num_heads, self.head_size, self.key_bins.numpy(),
                self.value_bins.numpy(), np.array([tensor.shape[2]]),
                enc.channel_means.reshape(exps.shape[0], -1).view(torch.int16).numpy(), exps.numpy(),
                None, enc.data_chunks[0].bytestream.numpy().data, enc.symbol_checksum))
        else:  # packed straight from the coder's arrays (no encoder output tensors)
            code = code_blocks(tensor, self.key_bins, self.value_bins, [tensor.shape[2]], self.coder)
            tables = fmt.RansTables(code.refine, code.classes, code.low, code.size, code.freqs,
                                    code.encoded.lengths)
            parts = list(fmt.pack_fields(
                fmt.CODER_RANS, self.num_heads, self.head_size, self.key_bins.numpy(),
                self.value_bins.numpy(), np.array([tensor.shape[2]]),
                (code.means.view(np.uint32) >> 16).astype(np.uint16), code.exps, tables,
                code.encoded.payload))
        return [blob.pack_header("cachegen", tensor.shape, tensor.dtype, parts), *parts]


def _log_once(error: CorruptBlobError) -> None:
    log_once(logger, type(error), "CacheGen: treating a stream as a cache miss: %s (logged once per kind)",
              error)


class CacheGenDeserializer(Deserializer):
    """`dtype`: the float dtype of `get_output_buffer` (a blob decodes to the dtype it was
    serialized from). `coder`: the CPU kernels (default: native where available, else the numpy
    reference). Raises ValueError for an MLA engine or a non-float `dtype`."""

    lossy = True  # the KV decoded is quantized

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                 dtype: torch.dtype, coder: Kernels | None = None) -> None:
        _check_kv_pairs(metadata)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"CacheGenDeserializer decodes to a float dtype; got {dtype!r}")
        super().__init__(dtype)
        self.chunk_size = config.chunk_size
        self.nlayers = metadata.num_layers
        self.hidden = metadata.hidden_dim
        self.cachegen_config = CacheGenConfig.from_model_name(metadata.model_name, self.nlayers)
        self.coder = coder

    def make_key_bins(self, config: CacheGenConfig) -> torch.Tensor:
        return torch.tensor(config.key_bins(), dtype=torch.int32)

    def make_value_bins(self, config: CacheGenConfig) -> torch.Tensor:
        return torch.tensor(config.value_bins(), dtype=torch.int32)

    def get_output_buffer(self, nlayers: int, nchannels: int, ntokens: int) -> torch.Tensor:
        """An empty KV_BLOB [2, nlayers, ntokens, nchannels] of the deserializer's dtype."""
        return torch.empty(2, nlayers, ntokens, nchannels, dtype=self.dtype)

    def _parse(self, bs: bytes | bytearray | memoryview) -> tuple[blob.Blob, CacheGenEncoderOutput]:
        header = blob.unpack(bs, "cachegen")
        self._check_header(header)
        try:
            encoded = CacheGenEncoderOutput.from_bytes(header.payload, view=True)  # decoded at once
        except (fmt.StaleStreamError, fmt.UnavailableCoderError) as e:
            _log_once(e)
            raise
        shape = (2, len(encoded.key_bins), int(encoded.block_tokens.sum()),
                 encoded.channel_means.shape[-1])
        if tuple(header.shape) != shape:
            raise CorruptBlobError(f"blob header shape {tuple(header.shape)} != stream shape {shape}")
        return header, encoded

    def _check_header(self, header: blob.Blob) -> None:
        """Raise CorruptBlobError unless the blob holds what the serializer of this engine writes:
        a float KV_BLOB chunk [2, L, T <= chunk_size, C] of this model (before decoding it, so
        that a small stream cannot make the decoder allocate a huge tensor)."""
        if header.dtype not in FLOAT_DTYPES:
            raise CorruptBlobError(f"a cachegen blob of dtype {header.dtype}; CacheGen codes float KV")
        shape = tuple(header.shape)
        if len(shape) != 4 or shape[0] != 2 or shape[1] != self.nlayers or shape[3] != self.hidden:
            raise CorruptBlobError(f"cachegen blob of shape {shape}; this model's chunks are [2, "
                                   f"{self.nlayers} layers, T, {self.hidden}]")
        if not 1 <= shape[2] <= self.chunk_size:
            raise CorruptBlobError(f"cachegen blob of {shape[2]} tokens; a chunk holds 1 to "
                                   f"chunk_size={self.chunk_size}")

    def _decode(self, encoded: CacheGenEncoderOutput, dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
        try:
            return decode_stream(encoded, dtype, self.coder, out)
        except fmt.UnavailableCoderError as e:
            _log_once(e)
            raise

    def from_bytes(self, bs: bytes | bytearray | memoryview) -> torch.Tensor:
        """Blob -> KV_BLOB [2, L, T, C] on the CPU, in the dtype it was serialized from."""
        header, encoded = self._parse(bs)
        return self._decode(encoded, header.dtype).cpu()

    def from_bytes_to(self, bs: bytes | bytearray | memoryview, allocate: AllocateFn) -> MemoryObj | None:
        """Decode into a KV_BLOB object from `allocate` (one reference, owned by the caller), in
        the deserializer's dtype (the tiers' KV dtype) whatever float dtype the blob was coded from."""
        header, encoded = self._parse(bs)
        obj = allocate(header.shape, self.dtype, MemoryFormat.KV_BLOB)
        if obj is None:
            return None
        try:
            target = obj.tensor
            assert target is not None
            self._decode(encoded, self.dtype, target)
        except BaseException:
            obj.ref_count_down()
            raise
        return obj
