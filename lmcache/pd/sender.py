"""`PDSender`: the prefill side of the KV channel (frames in `wire`).

After a prefill instance computed a prompt, its worker calls `send(receiver, tokens, ...)`: the
engine's objects for the prompt (what it just stored, or held already: `LMCacheEngine.held_prefix`)
are offered to the decoder's receiver, written into the room it reserved (NIXL writes from the
engine's registered arena, or the bytes inline on the TCP connection) and committed, before the
prefill request returns: when the proxy hears back, the decoder holds the KV.

A full receive buffer makes the sender offer the rest again, with short pauses, for at most
`pd_send_timeout` seconds, then skip it (the decoder computes it). That is capacity, not a
failure (the decoder has not yet claimed what it received): counted in ``pd_skipped_bytes`` and
summarized at most once per interval (`CapacityLog`, info level). Each receiver is a failure
domain of one `FailureDomains` guard (`lmcache.failures`): the connection and transfer code
raises, and the guard counts a send that failed (refused or broken connection, a timeout, an
answer that breaks the protocol: ``pd_send_failures``) and one not made while the receiver is
backed off from (``pd_send_skipped``), so that later prefills do not each wait for a dead one,
and logs one warning per incident (a flapping one at most once per interval). One connection
per receiver, reused; one that broke since its last use (the receiver restarted) is replaced at
once.

`counters()` is everything the sender counted (bytes sent, through NIXL, held already, skipped;
requests; the guard's failures and skips); the sender adds it to its engine's `EngineStats`, so
it appears in the engine's stats and metrics (``lmcache:pd_*_total``).
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.cache_key import CacheEngineKey
from lmcache.config import LMCacheEngineConfig
from lmcache.failures import FailureDomains
from lmcache.memory_management import MemoryObj, release_all
from lmcache.observability import CapacityLog, Counters, add_counts
from lmcache.pd import nixl_agent
from lmcache.pd.wire import FOREIGN, HAVE, Chunk, WireError, byte_view, expect_ok, recv_message, send_message
from lmcache.storage_backend.serde.seal import create_sealer, sealed_parts

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT = 2.0
REPLY_TIMEOUT = 60.0  # a receiver reading the inline bytes of a large prompt
NIXL_WRITE_TIMEOUT = 30.0


@dataclass
class _Link:
    sock: socket.socket
    nixl_peer: str | None = None
    remote_base: int = 0  # the receiver's buffer address (NIXL)

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        send_message(self.sock, message)
        return expect_ok(recv_message(self.sock))


@dataclass
class SendResult:
    """What one `send` did, in bytes."""

    sent: int = 0
    nixl: int = 0  # of `sent`, written through NIXL (the rest went inline on the TCP connection)
    had: int = 0  # the receiver held these already
    skipped: int = 0  # no room before `pd_send_timeout` (or not the receiver's model's KV)
    chunks: list[CacheEngineKey] = field(default_factory=list)  # the chunks now at the receiver


class PDSender:
    def __init__(self, engine: LMCacheEngine, config: LMCacheEngineConfig, rank: int) -> None:
        self.engine = engine
        self.rank = max(rank, 0)
        self.timeout = config.pd_send_timeout
        self.sealer = create_sealer(config.kv_encryption_key)  # seals the chunks sent inline
        self.agent: nixl_agent.NixlAgent | None = None
        self._arena: tuple[int, int] = (0, 0)
        arena = engine.memory_allocator.arena
        if config.transfer_channel == "nixl" and arena is not None and nixl_agent.available():
            self.agent = nixl_agent.NixlAgent(config.nixl_backends)
            self.agent.register(arena)
            self._arena = (arena.data_ptr(), arena.numel() * arena.element_size())
        self._links: dict[str, _Link] = {}
        self._faults = FailureDomains(lambda address: f"the KV receiver at {address}",
                                      consequence="KV not sent; the decoder computes it")
        self._full = CapacityLog(logger, "sends found the receive buffer full and skipped chunks after "
                                 "pd_send_timeout:", "chunks not sent, in pd_skipped_bytes")
        self._counts = Counters()
        engine.stats.include(self.counters)

    @property
    def channel(self) -> str:
        return "nixl" if self.agent is not None else "tcp"

    def send(self, receiver: str, tokens: torch.Tensor, *, extra_key: str | None = None,
             state_ends: Iterable[int] = ()) -> SendResult:
        """Send the KV this engine holds for the prompt `tokens` to `receiver` ("host:port" of
        the decoder's rank 0; rank r sends to port + r). Never raises for the receiver's faults
        (an empty result); ValueError for a malformed address."""
        address = _rank_address(receiver, self.rank)
        held = self.engine.held_prefix(tokens, extra_key=extra_key, state_ends=state_ends)
        try:
            result = self._faults.call(address, partial(self._send, address, held), SendResult())
        finally:
            release_all([obj for _, obj in held])
        for name, n in (("pd_sent_bytes", result.sent), ("pd_sent_nixl_bytes", result.nixl),
                        ("pd_had_bytes", result.had), ("pd_skipped_bytes", result.skipped),
                        ("pd_sent_requests", 1)):
            self._counts.add(name, n)
        return result

    def counters(self) -> dict[str, float]:
        """What this sender counted: ``pd_sent_bytes``, ``pd_sent_nixl_bytes``, ``pd_had_bytes``,
        ``pd_skipped_bytes``, ``pd_sent_requests`` and, summed over its receivers,
        ``pd_send_failures`` / ``pd_send_skipped`` (its guard's)."""
        faults = {f"pd_send_{name}": n for name, n in self._faults.counts().items()}
        return add_counts(self._counts.snapshot(), faults)

    def _send(self, address: str, held: list[tuple[CacheEngineKey, MemoryObj]]) -> SendResult:
        reused = address in self._links
        try:
            return self._send_once(address, held)
        except OSError as e:
            if not reused or isinstance(e, TimeoutError):
                raise
            # the receiver restarted since the connection was made: once more, on a new one
            return self._send_once(address, held)

    def _send_once(self, address: str, held: list[tuple[CacheEngineKey, MemoryObj]]) -> SendResult:
        result = SendResult()
        link = self._link(address)
        try:
            pending = held
            deadline = time.monotonic() + self.timeout
            pause = 0.005
            while pending:
                chunks = [_chunk(key, obj) for key, obj in pending]
                slots = link.request({"op": "offer", "chunks": [c.to_json() for c in chunks]})["slots"]
                if not isinstance(slots, list) or len(slots) != len(chunks):
                    raise WireError(f"the receiver answered {len(slots)} slots for {len(chunks)} chunks")
                reserved = [(i, slot) for i, slot in enumerate(slots) if isinstance(slot, dict)]
                if reserved:
                    result.nixl += self._write(link, reserved, pending)
                    result.sent += sum(chunks[i].nbytes for i, _ in reserved)
                for i, slot in enumerate(slots):
                    if slot == HAVE:
                        result.had += chunks[i].nbytes
                    elif slot == FOREIGN:
                        result.skipped += chunks[i].nbytes
                    if slot == HAVE or isinstance(slot, dict):
                        result.chunks.append(chunks[i].key)
                pending = [pending[i] for i, slot in enumerate(slots) if slot is None]
                if pending and time.monotonic() >= deadline:
                    result.skipped += sum(_chunk(k, o).nbytes for k, o in pending)
                    self._full.note(len(pending))
                    return result
                if pending:
                    time.sleep(pause)
                    pause = min(2 * pause, 0.1)
            return result
        except BaseException:
            self._drop(address)
            raise

    def _write(self, link: _Link, reserved: Sequence[tuple[int, dict[str, Any]]],
               pending: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> int:
        """Fill the reserved slots: NIXL writes for objects in the registered arena, the rest
        inline; then the receiver commits them. The bytes written through NIXL."""
        ranges: list[tuple[int, int, int]] = []
        inline: list[tuple[int, torch.Tensor]] = []  # (index in `pending`, its tensor)
        lo, size = self._arena
        for i, slot in reserved:
            tensor = pending[i][1].tensor
            assert tensor is not None
            offset = slot.get("offset")
            if not isinstance(offset, int) or offset < 0:
                raise WireError(f"bad slot {slot!r}")
            addr, n = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            if link.nixl_peer is not None and lo <= addr and addr + n <= lo + size:
                ranges.append((addr, link.remote_base + offset, n))
            else:
                inline.append((i, tensor))
        notif = None
        if ranges:
            assert self.agent is not None and link.nixl_peer is not None
            notif = uuid.uuid4().hex
            self.agent.write(link.nixl_peer, ranges, notif.encode(), NIXL_WRITE_TIMEOUT)
        send_message(link.sock, {"op": "written", "inline": [i for i, _ in inline], "notif": notif})
        for i, tensor in inline:
            for part in sealed_parts(self.sealer, pending[i][0].to_string().encode(), [byte_view(tensor)]):
                link.sock.sendall(part)
        committed = expect_ok(recv_message(link.sock)).get("committed")
        if committed != len(reserved):
            raise WireError(f"the receiver committed {committed} of {len(reserved)} chunks")
        return sum(n for _, _, n in ranges)

    def _link(self, address: str) -> _Link:
        link = self._links.get(address)
        if link is not None:
            return link
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(REPLY_TIMEOUT)
            link = _Link(sock)
            hello: dict[str, Any] = {"op": "hello", "sealed": self.sealer is not None}
            if self.agent is not None:
                hello["nixl"] = self.agent.metadata()
            answer = link.request(hello)
            if answer.get("channel") == "nixl" and self.agent is not None:
                link.nixl_peer = self.agent.add_peer(str(answer.get("nixl")))
                link.remote_base = int(answer.get("buffer", 0))
        except BaseException:
            sock.close()
            raise
        self._links[address] = link
        return link

    def _drop(self, address: str) -> None:
        link = self._links.pop(address, None)
        if link is not None:
            link.sock.close()
            if link.nixl_peer is not None and self.agent is not None:
                try:
                    self.agent.remove_peer(link.nixl_peer)
                except Exception:  # the peer is gone either way
                    logger.debug("removing NIXL peer %s failed", link.nixl_peer, exc_info=True)

    def close(self) -> None:
        for address in list(self._links):
            self._drop(address)
        if self.agent is not None:
            self.agent.close()
            self.agent = None


def _chunk(key: CacheEngineKey, obj: MemoryObj) -> Chunk:
    md = obj.metadata
    assert md.dtype is not None
    return Chunk(key, tuple(md.shape), md.dtype, md.fmt)


def _rank_address(receiver: str, rank: int) -> str:
    host, sep, port = receiver.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) + rank < 65536:
        raise ValueError(f"bad KV receiver address {receiver!r}: expected 'host:port'")
    return f"{host}:{int(port) + rank}"
