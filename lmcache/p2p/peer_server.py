"""`PeerServer`: an engine's own chunks, served read-only to its peers over the lm:// protocol.

Requests (keys are chunk key strings, `CacheEngineKey.to_string()`):
    GET     the chunk as a keyed blob (`serde.keyed_blob`: its key, then the checksummed blob,
            sealed with sealing on), so
            the peer can verify it got the chunk it asked for -> OK + value | NOT_FOUND
    EXISTS  whether this engine holds the chunk in a local tier -> OK | NOT_FOUND
    HEALTH  liveness and requests served by op
PUT, DELETE and LIST are refused (ERROR): peers never write here, and the key list is not
published. A frame carrying a value is a protocol error (the connection is closed), so a peer
can never make this server buffer more than a key. The shared secret (``LMCACHE_AUTH_TOKEN``),
frame timeout and key limits are `FrameServer`'s. Chunks are read on worker threads (a disk read
must not stall other connections); a chunk's memory is referenced until its bytes were handed to
the transport.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcache.cache_key import CacheEngineKey
from lmcache.memory_management import MemoryObj
from lmcache.server.protocol import Op, Status
from lmcache.server.server import FrameServer, Reply
from lmcache.storage_backend.serde import keyed_blob
from lmcache.storage_backend.serde.seal import Sealer
from lmcache.storage_backend.serde.serde import Serializer

READ_ONLY = b"this is a read-only peer server"


class PeerServer(FrameServer):
    blocking_dispatch = True

    def __init__(self, read_local: Callable[[CacheEngineKey], MemoryObj | None],
                 has_local: Callable[[CacheEngineKey], bool], serializer: Serializer,
                 sealer: Sealer | None = None, *,
                 auth_token: str | None = None, frame_timeout: float = 30.0) -> None:
        """`read_local(key)`: the chunk from a local tier (one reference for the caller) or None;
        `has_local(key)`: whether a local tier holds it; `sealer`: seals what is sent (peers
        open it with the same keys)."""
        super().__init__(auth_token=auth_token, max_value_bytes=0, frame_timeout=frame_timeout)
        self._read_local = read_local
        self._has_local = has_local
        self._serializer = serializer
        self._sealer = sealer

    def info(self) -> dict[str, Any]:
        return {"read_only": True}

    def dispatch(self, op: Op, key: bytes, value: bytes) -> Reply:
        if op not in (Op.GET, Op.EXISTS):
            return Reply(Status.ERROR, [READ_ONLY])
        try:
            chunk = CacheEngineKey.from_string(key.decode())
        except (UnicodeDecodeError, ValueError):
            return Reply(Status.NOT_FOUND)
        if op == Op.EXISTS:
            return Reply(Status.OK if self._has_local(chunk) else Status.NOT_FOUND)
        obj = self._read_local(chunk)
        if obj is None:
            return Reply(Status.NOT_FOUND)
        tensor = obj.tensor
        if tensor is None:
            obj.ref_count_down()
            return Reply(Status.NOT_FOUND)
        try:
            parts = keyed_blob.keyed_parts(key, self._serializer.to_parts(tensor), self._sealer)
        except BaseException:
            obj.ref_count_down()
            raise
        return Reply(Status.OK, parts, obj.ref_count_down)
