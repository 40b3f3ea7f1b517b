"""vLLM's KV events on the wire, and a subscriber per instance that feeds them to a `KVIndex`.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:PORT"}'``) publishes each batch as a ZMQ multipart message ``[topic, seq (8 bytes, big
endian), payload]``; the payload is msgpack of ``KVEventBatch`` (``vllm/distributed/kv_events.py``):
an array ``[ts, events, data_parallel_rank]`` whose events are maps tagged by ``"type"``:
``BlockStored`` (block_hashes, parent_block_hash, token_ids, block_size, medium, ...),
``BlockRemoved`` (block_hashes, medium) and ``AllBlocksCleared``. Block hashes are ints or bytes.

The router decodes the arrays itself (importing vLLM costs ~18 s); `decode_batch` raises
ValueError on anything that is not such a batch. `EventSubscriber` runs one thread per instance:
a SUB socket with a receive high-water mark (a subscriber that falls behind drops batches at the
publisher instead of growing memory; the gap in sequence numbers is counted as ``missed``),
malformed messages counted and skipped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import zmq

logger = logging.getLogger(__name__)

BlockHash = int | bytes
MAX_TOKEN_ID = 1 << 32


class Stored(NamedTuple):
    block_hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None


class Removed(NamedTuple):
    block_hashes: list[BlockHash]
    medium: str | None


class Cleared(NamedTuple):
    pass


Event = Stored | Removed | Cleared
_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one ``KVEventBatch`` payload; ValueError if it is not one."""
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"not msgpack: {e}") from None
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        raise ValueError("not a KVEventBatch array [ts, events, ...]")
    return [_event(e) for e in batch[1]]


def _hashes(value: Any) -> list[BlockHash]:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise ValueError("block_hashes must be a list of ints or bytes")
    return value


def _event(raw: Any) -> Event:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "AllBlocksCleared":
        return Cleared()
    medium = raw.get("medium") if isinstance(raw, dict) else None
    if medium is not None and not isinstance(medium, str):
        raise ValueError(f"medium must be a string or null, not {medium!r}")
    if kind == "BlockRemoved":
        return Removed(_hashes(raw.get("block_hashes")), medium)
    if kind != "BlockStored":
        raise ValueError(f"unknown event {kind!r}")
    hashes, tokens, size, parent = (_hashes(raw.get("block_hashes")), raw.get("token_ids"),
                                    raw.get("block_size"), raw.get("parent_block_hash"))
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"block_size must be a positive int, not {size!r}")
    if not isinstance(tokens, list) or len(tokens) != size * len(hashes) \
            or not all(isinstance(t, int) and 0 <= t < MAX_TOKEN_ID for t in tokens):
        raise ValueError(f"token_ids must be {size} token ids (0 <= id < 2**32) per block for "
                         f"{len(hashes)} block(s)")
    if parent is not None and not isinstance(parent, int | bytes):
        raise ValueError(f"parent_block_hash must be an int, bytes or null, not {parent!r}")
    return Stored(hashes, parent, tokens, size, medium)


class EventSubscriber:
    """A thread reading one instance's event stream into `apply(events)` until `close()`.

    Counters: ``batches``, ``malformed`` (skipped), ``missed`` (batches lost to the high-water mark
    or a reconnect, from gaps in the sequence numbers)."""

    def __init__(self, endpoint: str, apply: Callable[[list[Event]], None], *, hwm: int = 1000,
                 topic: str = "") -> None:
        self.endpoint = endpoint
        self.batches = self.malformed = self.missed = 0
        self._apply = apply
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.SUB)
        self._sock.set_hwm(hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sock.connect(endpoint)
        self._last_seq: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kv-events {endpoint}")
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            self.take(self._sock.recv_multipart())
        self._sock.close(0)

    def take(self, frames: list[bytes]) -> None:
        """One received message: counted, applied, or (malformed) counted and skipped."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._skip(f"{len(frames)} frames; expected [topic, seq (8 bytes), payload]")
            return
        seq = int.from_bytes(frames[1], "big")
        if self._last_seq is not None and seq > self._last_seq + 1:
            self.missed += seq - self._last_seq - 1
        self._last_seq = seq
        try:
            events = decode_batch(frames[2])
        except ValueError as e:
            self._skip(str(e))
            return
        self.batches += 1
        self._apply(events)

    def _skip(self, why: str) -> None:
        self.malformed += 1
        logger.debug("kv events from %s: malformed message skipped: %s", self.endpoint, why)

    def counts(self) -> dict[str, int]:
        return {"batches": self.batches, "malformed": self.malformed, "missed": self.missed}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
