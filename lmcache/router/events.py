"""vLLM's KV events on the wire, and a subscriber per instance that feeds them to a `KVIndex`.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:PORT"}'``) publishes each batch as a ZMQ multipart message ``[topic, seq (8 bytes, big
endian), payload]``; the payload is msgpack of ``KVEventBatch``. The router decodes it with the
wire format's own structs (`lmcache.kv_events`, the same as vLLM's: importing vLLM costs ~18 s);
`decode_batch` raises ValueError on anything that is not such a batch (nested too deeply
included), or whose ``BlockStored`` does not carry, per block, `block_size` token ids (0 <= id <
2**32) and, if it has extra keys, one entry of them (a cache server's stream, whose chunks may come
without token ids, is read with ``token_ids=False``: its blocks must then be digests, bytes).
`EventSubscriber` runs one thread per stream: a SUB socket with a receive high-water mark (a
subscriber that falls behind drops batches at the publisher instead of growing memory; the gap in
the sequence numbers of the batches it read is counted as ``missed``), malformed messages counted
and skipped (their sequence numbers are not trusted: a malformed batch counts as missed too).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgspec
import zmq

from lmcache.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

MAX_TOKEN_ID = 1 << 32
Event = BlockStored | BlockRemoved | AllBlocksCleared
_decoder = msgspec.msgpack.Decoder(KVEventBatch)

__all__ = ["MAX_TOKEN_ID", "BlockHash", "Event", "EventSubscriber", "decode_batch"]


def decode_batch(payload: bytes, token_ids: bool = True) -> list[Event]:
    """The events of one ``KVEventBatch`` payload; ValueError if it is not one."""
    try:
        events = _decoder.decode(payload).events
    except msgspec.DecodeError as e:  # ValidationError too
        raise ValueError(f"not a KVEventBatch: {e}") from None
    except RecursionError:  # msgspec's, for a value nested too deeply (in an event's extra keys)
        raise ValueError("not a KVEventBatch: nested too deeply") from None
    for event in events:
        if not isinstance(event, BlockStored):
            continue
        size, tokens = event.block_size, event.token_ids
        if not token_ids:
            if size <= 0 or not all(isinstance(h, bytes) for h in event.block_hashes):
                raise ValueError(f"BlockStored of a cache server: block_size={size} must be > 0 and the "
                                 "block hashes chunk digests (bytes)")
            continue
        blocks = len(event.block_hashes)
        if size <= 0 or len(tokens) != size * blocks or not all(0 <= t < MAX_TOKEN_ID for t in tokens):
            raise ValueError(f"BlockStored: token_ids must be block_size={size} (> 0) ids "
                             f"(0 <= id < 2**32) per block for {blocks} block(s)")
        if event.extra_keys is not None and len(event.extra_keys) != blocks:
            raise ValueError(f"BlockStored: {len(event.extra_keys)} extra-keys entries for {blocks} block(s)")
    return events


class EventSubscriber:
    """A thread reading one instance's event stream into `apply(events)` until `close()`.

    Counters: ``batches``, ``malformed`` (skipped; a message whose handling failed otherwise too,
    logged with its traceback: the thread goes on), ``missed`` (batches lost to the high-water mark
    or a reconnect, from gaps in the sequence numbers). ValueError if `endpoint` cannot be
    connected to."""

    def __init__(self, endpoint: str, apply: Callable[[list[Event]], None], *, hwm: int = 1000,
                 topic: str = "", token_ids: bool = True) -> None:
        """`token_ids`: see `decode_batch`."""
        self.endpoint = endpoint
        self._token_ids = token_ids
        self.batches = self.malformed = self.missed = 0
        self._apply = apply
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.SUB)
        self._sock.set_hwm(hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise ValueError(f"cannot subscribe to KV events at {endpoint!r}: {e}") from None
        self._last_seq: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kv-events {endpoint}")
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart()
                try:
                    self.take(frames)
                except Exception:  # a bug must not end the thread: the index would go stale silently
                    self.malformed += 1
                    logger.exception("kv events from %s: a message could not be applied; skipped",
                                     self.endpoint)
        finally:
            self._sock.close(0)

    def take(self, frames: list[bytes]) -> None:
        """One received message: counted, applied, or (malformed) counted and skipped."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._skip(f"{len(frames)} frames; expected [topic, seq (8 bytes), payload]")
            return
        try:
            events = decode_batch(frames[2], self._token_ids)
        except ValueError as e:
            self._skip(str(e))
            return
        seq = int.from_bytes(frames[1], "big")
        if self._last_seq is not None and seq > self._last_seq + 1:
            self.missed += seq - self._last_seq - 1
        self._last_seq = seq
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
