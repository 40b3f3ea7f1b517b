"""Engine configuration and metadata.

`LMCacheEngineConfig` holds seed 000's fields (plus a few documented extras) and validates itself.
Sources, lowest to highest precedence: defaults < YAML file named by ``LMCACHE_CONFIG_FILE`` <
``LMCACHE_<FIELD>`` environment variables < explicit overrides (e.g. vLLM's
``kv_connector_extra_config``); `LMCacheEngineConfig.load` applies them in that order.
Sizes in GB mean 2**30 bytes. `LMCacheEngineConfig.from_legacy` (seed 002's and upstream's legacy
names) is implemented in the compat edge, `lmcache.compat.legacy_config`, loaded on first call.
`ENV_VARS` is the table of every other environment variable the package reads; an ``LMCACHE_*``
variable that is neither a field's nor in it is warned about.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import yaml

from lmcache.observability import log_once
from lmcache.storage_backend.connectors import parse_remote_url, redact_url, remote_schemes
from lmcache.storage_backend.evictor import POLICIES
from lmcache.storage_backend.serde.registry import serde_names
from lmcache.storage_backend.serde.seal import load_keys

logger = logging.getLogger(__name__)

GB = 1 << 30
ENV_PREFIX = "LMCACHE_"


@dataclass(frozen=True)
class EnvVar:
    """An environment variable the package reads besides the ``LMCACHE_<FIELD>`` config fields:
    its `name`, its `default` (in words) and what it does (`doc`). `read` is False for a name that
    is only accepted (not warned about) and has no effect."""

    name: str
    default: str
    doc: str
    read: bool = True


# Every environment variable the package reads, other than ``LMCACHE_<FIELD>`` (one per config
# field). The README's table shows it; tests/unit/core/test_env_vars.py checks it against the
# code. ``LMCACHE_*`` names here are not warned about as unknown.
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("LMCACHE_CONFIG_FILE", "unset", "YAML file of config fields (below `LMCACHE_<FIELD>` variables)"),
    EnvVar("LMCACHE_LOG_LEVEL", "unset (the `lmcache` CLI: INFO)", "level of the `lmcache` loggers"),
    EnvVar("LMCACHE_AUTH_TOKEN", "unset", "shared secret of `lmcache server`, of `lm://` remote URLs "
           "without `?auth_token=` and of the peer servers"),
    EnvVar("LMCACHE_KV_KEY", "unset", "KV sealing keys (64 hex digits each, comma-separated, the first "
           "seals) where `kv_encryption_key` names no key file; never logged"),
    EnvVar("LMCACHE_MODEL_DIR", "`~/.cache/lmcache/models`", "where the local SmolLM2 model folder is kept"),
    EnvVar("LMCACHE_NATIVE", "1", "0 turns the compiled kernels off (the Python paths give the same "
           "results)"),
    EnvVar("LMCACHE_NATIVE_CACHE_DIR", "`~/.cache/lmcache/native`", "where compiled kernels are cached"),
    EnvVar("LMCACHE_COPY_ISA", "unset (the widest the CPU has)", "`sse2`, `avx2` or `avx512`: caps the "
           "vector path of the native copies and CacheGen kernels"),
    EnvVar("LMCACHE_MALLOC_TUNING", "1", "0 leaves glibc's malloc thresholds alone (`native.tune_malloc`)"),
    EnvVar("LMCACHE_STAGED_COPY", "0", "1 forces the connectors' staged copy path for CPU caches too"),
    EnvVar("LMCACHE_TORCH_CPU_PROBES", "unset", "torch CPU feature probes that answer False in a vLLM "
           "process, so it loads another vLLM-CPU kernel build (set by `cpu_build.forced_build_env`)"),
    EnvVar("LMCACHE_USE_EXPERIMENTAL", "unset", "upstream LMCache's switch to its experimental engine: "
           "accepted, no effect (this package has one engine)", read=False),
    EnvVar("CC", "`cc`, else `gcc`", "the C compiler that builds the native kernels"),
    EnvVar("XDG_CACHE_HOME", "`~/.cache`", "base of a legacy `local_disk` backend's default directory"),
    EnvVar("PYTHONPATH", "inherited", "extended, not replaced, for vLLM processes by "
           "`cpu_build.forced_build_env`"),
)
_SECRET_URLS = ("remote_url", "lookup_url")  # fields whose passwords and tokens repr() hides
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass
class LMCacheEngineConfig:
    """Seed 000's config. Extras beyond the seed:

    - `cache_policy`: the hot tier's eviction order;
    - `blend_check_layers`, `blend_special_str`: CacheBlend's token-selection layers and the text
      separating blended segments;
    - `remote_timeout`: seconds per remote (and peer) operation; `lookup_timeout`: seconds a
      serving engine's scheduler waits for a cache lookup before treating it as a miss;
    - `local_disk_serde`, `local_disk_fsync`: the serde of disk files, and fsync of each file
      before it becomes visible (durable across power loss; without it a file torn by a crash is
      still never served, because checksums catch it);
    - `cachegen_quality`: the `cachegen` serde's quantization bins are the model's table times this
      factor, in [0.25, 4]; 1.0 is the default (KL <= 0.01 on every evaluated genre at SmolLM2),
      higher keeps more precision for more bits (about +log2(factor) bits/value, KL ~
      1/factor**2; see benchmarks/RESULTS.md);
    - `p2p_ttl`: seconds an instance's peer registrations outlive its last heartbeat;
    - `controller_url`: ``host:port`` of the engine's HTTP controller (None = none);
    - `kv_events_endpoint` (cache server): a ZMQ endpoint (``tcp://*:PORT`` binds, ``tcp://HOST:PORT``
      connects, ``ipc://PATH``) where an `lmcache cache-server` publishes its tiers' KV events in
      vLLM's format (None = none; a vLLM engine publishes with vLLM's ``--kv-events-config``);
    - `clear_hot_on_reset`: a serving engine's cache reset (vLLM's connector-cache reset) also
      empties the hot tier;
    - `verify_rate`, `verify_max_mismatches`, `verify_seed` (vLLM connector): the fraction of
      lookups audited (answered as a miss; the KV vLLM then computes is compared with what the cache
      holds, `integration.vllm.audit`; 0 turns audits off), the audit mismatches after which the
      connector stops serving hits for the model, and where the evenly spread choice of audited
      lookups starts;
    - `kv_encryption_key`: path of a key file (``lmcache keygen PATH``); with it, or with keys in
      ``LMCACHE_KV_KEY``, every blob of the disk, remote and peer tiers and every chunk the PD
      channel sends over TCP is sealed with AES-256-GCM for its chunk key, and one that does not
      open is a miss (`storage_backend.serde.seal`). The config holds the path only; key material
      never enters it;
    - `metrics_port`, `metrics_host`: serve the ``lmcache:`` Prometheus metrics there (for
      engines outside vLLM, whose metrics appear in vLLM's own ``/metrics``; port 0 = any).

    Peer-to-peer sharing (`enable_p2p`): `lookup_url` is the Valkey/Redis where instances register
    which chunks they hold, in `remote_url`'s redis-family forms (``redis://``, ``valkey://``,
    ``rediss://``, ``redis-sentinel://``, ``redis-cluster://``; a bare ``host:port`` means
    ``redis://host:port``); `distributed_url` is ``host:port`` of this instance's read-only chunk
    server (port 0 = any free port).

    Prefill/decode disaggregation (`enable_pd`, upstream's names; see `lmcache.pd`): `pd_role`
    "sender" (a prefill instance: after computing a prompt it sends the prompt's KV to the decoder
    the request names) or "receiver" (a decode instance: it receives KV into a bounded buffer of
    `pd_buffer_size` bytes on `pd_buffer_device`, listening on `pd_peer_host`, port
    `pd_peer_init_port` + its tensor-parallel rank); `transfer_channel` "nixl" (NIXL writes over
    `nixl_backends`; falls back to "tcp" with one log line where NIXL is not installed) or "tcp";
    `pd_send_timeout`: seconds a sender waits for room in a full receive buffer before it skips
    the rest (the decoder then computes it).

    A shared cache server (`cache_server_url`, ``ipc:///path`` or ``tcp://host:port`` of an
    `lmcache cache-server`): the engine keeps no tiers of its own (no hot tier; local_disk,
    remote_url, P2P and PD belong in the server's configuration) and stores into and loads from the
    server's shared-memory L1, which other engines on the host share (`lmcache.cache_server`);
    `remote_timeout` bounds each request to it. While the server is away the engine computes
    everything and attaches again by itself when a server is back.

    One default differs from the seed on purpose: `remote_url` is None (no remote tier), not
    ``'lm://localhost:65432'``, so the default engine needs no server that nobody started; set
    `remote_url` (or ``LMCACHE_REMOTE_URL``) to use a remote store."""

    chunk_size: int = 256
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0
    local_disk: str | None = None
    max_local_disk_size: float = 0.0
    remote_url: str | None = None
    remote_serde: str | None = "naive"
    save_decode_cache: bool = False
    enable_blending: bool = False
    blend_recompute_ratio: float = 0.15
    blend_min_tokens: int = 256
    enable_p2p: bool = False
    lookup_url: str | None = None
    distributed_url: str | None = None
    error_handling: bool = False
    cache_policy: str = "LRU"
    blend_check_layers: list[int] = field(default_factory=lambda: [1])
    blend_special_str: str = " # # "
    remote_timeout: float = 5.0
    lookup_timeout: float = 1.0
    local_disk_serde: str = "naive"
    local_disk_fsync: bool = False
    p2p_ttl: float = 10.0
    controller_url: str | None = None
    kv_events_endpoint: str | None = None
    clear_hot_on_reset: bool = False
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    cachegen_quality: float = 1.0
    enable_pd: bool = False
    pd_role: str | None = None
    pd_buffer_size: int = 1 << 30
    pd_buffer_device: str = "cpu"
    pd_peer_host: str = "127.0.0.1"
    pd_peer_init_port: int | None = None
    transfer_channel: str = "nixl"
    nixl_backends: list[str] = field(default_factory=lambda: ["UCX"])
    pd_send_timeout: float = 2.0
    cache_server_url: str | None = None
    verify_rate: float = 0.01
    verify_max_mismatches: int = 3
    verify_seed: int = 0
    kv_encryption_key: str | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), _field_types()[f.name]))
        if isinstance(self.local_disk, str) and self.local_disk.startswith("file://"):
            self.local_disk = self.local_disk[len("file://") :]
        if isinstance(self.local_disk, str):
            self.local_disk = os.path.expanduser(self.local_disk)
        self._validate()
        if self.lookup_url is not None:
            self.lookup_url = _as_url(self.lookup_url)

    def _validate(self) -> None:
        schemes, serdes = remote_schemes(), serde_names()
        _check(self.chunk_size > 0, "chunk_size", self.chunk_size, "must be > 0")
        for name in ("max_local_cpu_size", "max_local_disk_size"):
            _check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        _check(self.local_disk != "", "local_disk", self.local_disk, "must be a path or None")
        load_keys(self.kv_encryption_key)  # a key file (or LMCACHE_KV_KEY) that does not parse: ValueError
        if self.remote_url is not None:
            scheme = self.remote_url.split("://", 1)[0] if "://" in self.remote_url else ""
            _check(scheme in schemes, "remote_url", redact_url(self.remote_url) or "(no '://')",
                   f"scheme must be one of {', '.join(s + '://' for s in schemes)}")
        _check(self.remote_serde is None or self.remote_serde in serdes, "remote_serde",
               self.remote_serde, f"must be one of {serdes}")
        _check(self.local_disk_serde in serdes, "local_disk_serde", self.local_disk_serde,
               f"must be one of {serdes}")
        _check(0.0 <= self.blend_recompute_ratio <= 1.0, "blend_recompute_ratio",
               self.blend_recompute_ratio, "must be in [0, 1]")
        _check(self.blend_min_tokens >= 0, "blend_min_tokens", self.blend_min_tokens, "must be >= 0")
        _check(len(self.blend_check_layers) > 0 and min(self.blend_check_layers) >= 0,
               "blend_check_layers", self.blend_check_layers, "must be non-empty layer ids >= 0")
        _check(self.cache_policy in POLICIES, "cache_policy", self.cache_policy,
               f"must be one of {list(POLICIES)}")
        _check(self.remote_timeout > 0, "remote_timeout", self.remote_timeout, "must be > 0")
        _check(0.25 <= self.cachegen_quality <= 4.0, "cachegen_quality", self.cachegen_quality,
               "must be in [0.25, 4]")
        _check(self.lookup_timeout > 0, "lookup_timeout", self.lookup_timeout, "must be > 0")
        _check(0.0 <= self.verify_rate <= 1.0, "verify_rate", self.verify_rate,
               "must be in [0, 1] (the fraction of lookups audited; 0 turns audits off)")
        _check(self.verify_max_mismatches >= 1, "verify_max_mismatches", self.verify_max_mismatches,
               "must be >= 1")
        _check(self.verify_seed >= 0, "verify_seed", self.verify_seed, "must be >= 0")
        if self.lookup_url is not None:
            try:
                scheme = parse_remote_url(_as_url(self.lookup_url)).scheme
            except ValueError:
                scheme = ""
            shown = redact_url(self.lookup_url) or self.lookup_url  # without its password
            _check(scheme in schemes and scheme != "lm", "lookup_url", shown,
                   "must be a Valkey/Redis URL (redis://, valkey://, rediss://, redis-sentinel://, "
                   "redis-cluster://) or 'host:port'")
        for name, lowest in (("distributed_url", 0), ("controller_url", 0)):
            url = getattr(self, name)
            if url is not None:
                host, _, port = url.rpartition(":")
                _check(bool(host) and port.isdigit() and lowest <= int(port) < 65536, name, url,
                       "must be 'host:port' (port 0 = any free port)")
        _check(self.p2p_ttl > 0, "p2p_ttl", self.p2p_ttl, "must be > 0")
        _check(self.metrics_port is None or 0 <= self.metrics_port < 65536, "metrics_port", self.metrics_port,
               "must be a TCP port (0 = any free port)")
        if self.enable_p2p:
            _check(self.lookup_url is not None and self.distributed_url is not None, "enable_p2p",
                   True, "needs lookup_url and distributed_url")
        _check(self.kv_events_endpoint is None or self.kv_events_endpoint.startswith(("tcp://", "ipc://")),
               "kv_events_endpoint", self.kv_events_endpoint, "must be tcp://HOST:PORT, tcp://*:PORT or ipc://PATH")
        self._validate_pd()
        self._validate_cache_server()

    def _validate_cache_server(self) -> None:
        url = self.cache_server_url
        if url is None:
            return
        scheme, _, where = url.partition("://")
        _check(scheme in ("ipc", "tcp") and bool(where), "cache_server_url", url,
               "must be ipc:///path or tcp://host:port (an `lmcache cache-server`)")
        own = {"local_disk": self.local_disk, "remote_url": self.remote_url,
               "enable_p2p": self.enable_p2p or None, "enable_pd": self.enable_pd or None}
        for name, value in own.items():
            _check(value is None, name, value, "an engine on a cache server keeps no tiers of its own: "
                   "configure them on the server (lmcache cache-server --config)")

    def _validate_pd(self) -> None:
        _check(self.pd_role in (None, "sender", "receiver"), "pd_role", self.pd_role,
               "must be 'sender' or 'receiver'")
        _check(self.transfer_channel in ("nixl", "tcp"), "transfer_channel", self.transfer_channel,
               "must be 'nixl' or 'tcp'")
        _check(self.pd_buffer_size > 0, "pd_buffer_size", self.pd_buffer_size, "must be > 0 bytes")
        _check(self.pd_buffer_device == "cpu", "pd_buffer_device", self.pd_buffer_device,
               "must be 'cpu' (GPU receive buffers are not built)")
        _check(self.pd_send_timeout >= 0, "pd_send_timeout", self.pd_send_timeout, "must be >= 0")
        _check(len(self.nixl_backends) > 0, "nixl_backends", self.nixl_backends, "must name a backend")
        port = self.pd_peer_init_port
        _check(port is None or 0 < port < 65536, "pd_peer_init_port", port, "must be a TCP port")
        if self.enable_pd:
            _check(self.pd_role is not None, "enable_pd", True, "needs pd_role 'sender' or 'receiver'")
            _check(self.pd_role != "receiver" or port is not None, "pd_role", self.pd_role,
                   "a receiver needs pd_peer_init_port (where it listens for KV)")

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GB)

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GB)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __repr__(self) -> str:
        """The fields, the URLs' passwords and auth tokens redacted (`redact_url`)."""
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in _SECRET_URLS:
            if shown[name] is not None:
                shown[name] = redact_url(shown[name])
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    # ---- constructors -------------------------------------------------------------------------

    @staticmethod
    def from_defaults(**kwargs: Any) -> LMCacheEngineConfig:
        unknown = set(kwargs) - set(_field_types())
        if unknown:
            raise ValueError(f"unknown config field(s): {sorted(unknown)}")
        return LMCacheEngineConfig(**kwargs)

    @staticmethod
    def from_env() -> LMCacheEngineConfig:
        """Defaults overwritten by ``LMCACHE_<FIELD>`` variables (typed parsing)."""
        return LMCacheEngineConfig.from_defaults(**_env_values())

    @staticmethod
    def from_file(file_path: str) -> LMCacheEngineConfig:
        return LMCacheEngineConfig.from_defaults(**_file_values(file_path))

    @staticmethod
    def from_legacy(*args: Any, **kwargs: Any) -> LMCacheEngineConfig:
        """Seed 000's constructor from seed 002's and upstream's legacy names (``backend=``,
        ``local_device=``, ``max_local_cache_size=``); its arguments and rules are those of
        `lmcache.compat.legacy_config.from_legacy`, imported on first call (the core never imports
        the compat edge at import time)."""
        from lmcache.compat.legacy_config import from_legacy

        return from_legacy(*args, **kwargs)

    @staticmethod
    def load(overrides: Mapping[str, Any] | None = None) -> LMCacheEngineConfig:
        """Defaults < ``LMCACHE_CONFIG_FILE`` < ``LMCACHE_*`` env < `overrides`."""
        values: dict[str, Any] = {}
        path = os.environ.get("LMCACHE_CONFIG_FILE")
        if path:
            values.update(_file_values(path))
        values.update(_env_values())
        values.update(overrides or {})
        return LMCacheEngineConfig.from_defaults(**values)


@dataclass
class LMCacheEngineMetadata:
    """What identifies whose KV this is. `kv_shape` = (num_layers, kv_count, chunk_size,
    num_kv_heads, head_size) of a full chunk, where `kv_count` is 2 (K and V per token and layer)
    or 1 (one latent per token and layer: MLA, with num_kv_heads 1 and head_size the latent width).
    `fmt` names the serving engine ("vllm", "huggingface"); the memory
    layout the connector stores is `layout` ("kv_blob" is the canonical one every engine shares).
    `model_fingerprint` distinguishes checkpoints that share a name (e.g. a hash of the weights).
    `state_layout` names the recurrent state a hybrid model keeps per request (linear attention,
    Mamba; "" for none): the engine then stores it at chunk boundaries (`LMCacheEngine.store_state`)
    and a lookup ends only at a boundary whose state it holds.
    A `worker_id` outside ``[0, world_size)`` (upstream's helpers build such metadata) only names
    the worker in the cache keys: it is accepted with one warning. `kv_dtype` may also be given
    by name ("bfloat16"). ValueError for a `kv_shape` of the wrong rank, `world_size` < 1 or an
    unknown dtype."""

    model_name: str
    world_size: int
    worker_id: int
    fmt: str
    kv_dtype: torch.dtype
    kv_shape: tuple[int, int, int, int, int]
    layout: str = "kv_blob"
    model_fingerprint: str = ""
    state_layout: str = ""

    def __post_init__(self) -> None:
        self.kv_shape = tuple(int(x) for x in self.kv_shape)  # type: ignore[assignment]
        _check(len(self.kv_shape) == 5 and self.kv_shape[1] in (1, 2) and min(self.kv_shape) > 0,
               "kv_shape", self.kv_shape,
               "must be (num_layers, kv_count (2, or 1 for MLA), chunk_size, num_kv_heads, head_size)")
        self.kv_dtype = _as_dtype(self.kv_dtype)
        _check(isinstance(self.world_size, int) and self.world_size > 0, "world_size", self.world_size,
               "must be an int > 0")
        _check(isinstance(self.worker_id, int), "worker_id", self.worker_id, "must be an int")
        if not 0 <= self.worker_id < self.world_size:
            log_once(logger, ("worker", self.worker_id, self.world_size),
                      "worker_id=%d is outside [0, world_size=%d): it only names this worker in the cache "
                      "keys", self.worker_id, self.world_size)

    @property
    def num_layers(self) -> int:
        return self.kv_shape[0]

    @property
    def kv_count(self) -> int:
        """Tensors per token and layer: 2 (K and V) or 1 (an MLA latent)."""
        return self.kv_shape[1]

    @property
    def hidden_dim(self) -> int:
        return self.kv_shape[3] * self.kv_shape[4]


# ---- helpers ----------------------------------------------------------------------------------

def _as_url(lookup_url: str) -> str:
    """A bare 'host:port' lookup_url means redis://host:port."""
    return lookup_url if "://" in lookup_url else "redis://" + lookup_url


def _as_dtype(dtype: Any) -> torch.dtype:
    """A torch dtype, also from its name ("bfloat16", "torch.float16"); ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise ValueError(f"invalid metadata value kv_dtype={dtype!r}: must be a torch.dtype (or its name)")


def _check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"invalid config value {name}={value!r}: {why}")


_TYPES: dict[str, Any] = {}


def _field_types() -> dict[str, Any]:
    if not _TYPES:
        hints = typing.get_type_hints(LMCacheEngineConfig)
        _TYPES.update({f.name: hints[f.name] for f in dataclasses.fields(LMCacheEngineConfig)})
    return _TYPES


def _coerce(name: str, value: Any, typ: Any) -> Any:
    """Convert `value` (possibly a string from env/YAML) to the field type, or raise ValueError."""
    args = typing.get_args(typ)
    optional = isinstance(typ, types.UnionType) and type(None) in args
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
            return None
        typ = next(a for a in args if a is not type(None))
    if typing.get_origin(typ) is list:
        if isinstance(value, str):
            value = [v for v in value.replace(" ", "").split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"invalid config value {name}={value!r}: expected a list")
        (elem,) = typing.get_args(typ)
        return [_coerce(name, v, elem) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"invalid config value {name}={value!r}: expected a bool")
    if typ is int:
        if isinstance(value, bool):
            raise ValueError(f"invalid config value {name}={value!r}: expected an int")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"invalid config value {name}={value!r}: expected an int")
    if typ is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if number is None:
            raise ValueError(f"invalid config value {name}={value!r}: expected a number")
        if not math.isfinite(number):  # an infinite size or timeout overflows where it is used
            raise ValueError(f"invalid config value {name}={value!r}: expected a finite number")
        return number
    if typ is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"invalid config value {name}={value!r}: expected a string")
    raise TypeError(f"unsupported config field type {typ!r} for {name}")


_KNOWN_ENV = frozenset(v.name for v in ENV_VARS)


def _env_values() -> dict[str, Any]:
    values: dict[str, Any] = {}
    fields = _field_types()
    for var, raw in os.environ.items():
        if not var.startswith(ENV_PREFIX):
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name in fields:
            values[name] = raw
        elif var not in _KNOWN_ENV:
            logger.warning("ignoring unknown environment variable %s (no config field %r)", var, name)
    return values


def _file_values(file_path: str) -> dict[str, Any]:
    try:
        with open(file_path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read LMCache config file {file_path!r}: {e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"LMCache config file {file_path!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"LMCache config file {file_path!r} must hold a mapping, got {type(data).__name__}")
    unknown = set(data) - set(_field_types())
    if unknown:
        unknown_names = sorted(unknown, key=str)  # YAML keys may be numbers too
        raise ValueError(f"LMCache config file {file_path!r} has unknown field(s): {unknown_names}")
    return dict(data)


# ---- names that moved to the compat edge ---------------------------------------------------------

_LEGACY_NAMES = frozenset({"LEGACY_BACKENDS", "LegacyTiers", "DEFAULT_LEGACY_DISK_GB", "default_local_disk"})


def __getattr__(name: str) -> Any:
    """`from_legacy`'s tables, still importable from here: they live in
    `lmcache.compat.legacy_config`, imported on first use."""
    if name in _LEGACY_NAMES:
        from lmcache.compat import legacy_config

        return getattr(legacy_config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
