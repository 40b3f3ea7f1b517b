"""`ReceiverServer`: the decode side of the KV channel (frames in `wire`).

A listening socket and a thread per sender connection, in the decode instance's worker. Chunks
are reserved in, written into and committed to a `SlotStore` (the "PDBackend" tier): inline bytes
are read from the socket straight into the reserved object, NIXL writes land there directly. A bad
frame, a broken connection, a sender that stalls between an offer and its `written`
(`NOTIF_TIMEOUT`, `FRAME_TIMEOUT`) or a NIXL write whose notification never comes frees the
connection's reservations (nothing half-written becomes visible) and closes that connection only;
other senders are unaffected.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lmcache.memory_management import MemoryObj
from lmcache.pd import nixl_agent
from lmcache.pd.wire import (
    MAX_CHUNKS_PER_OFFER,
    Chunk,
    SocketReader,
    WireError,
    byte_view,
    recv_into,
    recv_message,
    reply,
    send_message,
)
from lmcache.storage_backend.serde import seal
from lmcache.storage_backend.serde.blob_stream import readinto_exact
from lmcache.storage_backend.serde.seal import ForgedBlobError, Sealer
from lmcache.storage_backend.serde.serde import CorruptBlobError

logger = logging.getLogger(__name__)
FRAME_TIMEOUT = 30.0  # seconds a `written` frame, and then its inline bytes, may take to arrive
NOTIF_TIMEOUT = 30.0  # seconds from an offer's answer to its `written` (its NIXL write lands
#                       meanwhile), and from a `written` to its NIXL notification
PROGRESS_INTERVAL = 0.001  # seconds between NIXL progress calls while a write may be landing


class SlotStore(Protocol):
    @property
    def buffer(self) -> torch.Tensor: ...

    def reserve(self, chunks: Sequence[Chunk]) -> list[MemoryObj | str | None]:
        """Per chunk: a reserved object, HAVE, FOREIGN or None (no room)."""

    def commit(self, chunks: Sequence[Chunk], objs: Sequence[MemoryObj]) -> int: ...

    def abort(self, chunks: Sequence[Chunk], objs: Sequence[MemoryObj]) -> None: ...


class _Offer:
    """The chunks a connection reserved room for and has not written yet."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[Chunk, MemoryObj]] = {}

    def take(self) -> tuple[list[Chunk], list[MemoryObj]]:
        chunks = [c for c, _ in self.slots.values()]
        objs = [o for _, o in self.slots.values()]
        self.slots = {}
        return chunks, objs


class ReceiverServer:
    def __init__(self, host: str, port: int, store: SlotStore, channel: str,
                 nixl_backends: Sequence[str], sealer: Sealer | None = None) -> None:
        self.store = store
        self.sealer = sealer
        self.agent: nixl_agent.NixlAgent | None = None
        try:
            self._listener = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise ValueError(f"pd_peer_init_port: cannot listen for KV on {host}:{port}: {e}") from e
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        try:
            if channel == "nixl" and nixl_agent.available():
                self.agent = nixl_agent.NixlAgent(nixl_backends)
                self.agent.register(store.buffer)
        except BaseException:
            self._listener.close()
            raise
        self.num_bad_frames = 0
        self.num_forged = 0  # sealed chunks that did not open (each ended its connection)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="lmcache-pd-accept", daemon=True)
        self._thread.start()
        logger.info("receiving KV on %s (%s)", self.address, "nixl" if self.agent else "tcp")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="lmcache-pd-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        offer = _Offer()
        peer: str | None = None
        try:
            while (message := self._next_message(conn, offer)) is not None:
                op = message.get("op")
                if op == "hello":
                    peer = self._hello(conn, message, peer)
                elif op == "offer":
                    self._offer(conn, message, offer)
                elif op == "written":
                    self._written(conn, message, offer)
                else:
                    raise WireError(f"unknown op {op!r}")
        except WireError as e:
            self.num_bad_frames += 1
            logger.warning("closing a KV sender's connection: %s", e)
            try:
                send_message(conn, {"ok": False, "error": str(e)})
            except OSError:
                pass
        except (OSError, ValueError) as e:
            logger.debug("a KV sender's connection ended: %r", e)
        finally:
            chunks, objs = offer.take()
            if objs:
                self.store.abort(chunks, objs)
            if peer is not None and self.agent is not None:
                self.agent.remove_peer(peer)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _next_message(self, conn: socket.socket, offer: _Offer) -> dict[str, Any] | None:
        """The connection's next message. While it holds reservations (an offer not written yet),
        its `written` must start within NOTIF_TIMEOUT and arrive within FRAME_TIMEOUT more, or
        the connection ends and frees them (a sender that stalls without closing would otherwise
        hold them for good); meanwhile the NIXL agent is kept progressing (it has no progress
        thread of its own: the sender's write may be landing)."""
        if not offer.slots:  # idle between frames for as long as it likes, not within one
            return recv_message(conn, body_timeout=FRAME_TIMEOUT)
        deadline = time.monotonic() + NOTIF_TIMEOUT
        readable = select.poll()  # not select(): a vLLM process may hold more than 1024 files
        readable.register(conn, select.POLLIN)
        step = PROGRESS_INTERVAL if self.agent is not None else NOTIF_TIMEOUT
        while not readable.poll(max(0.0, min(step, deadline - time.monotonic())) * 1000):
            if time.monotonic() >= deadline:
                raise WireError(f"no `written` within {NOTIF_TIMEOUT:g} s of the offer")
            if self.agent is not None:
                self.agent.progress()
        conn.settimeout(FRAME_TIMEOUT)
        try:
            return recv_message(conn)
        except TimeoutError:
            raise WireError(f"a `written` frame took more than {FRAME_TIMEOUT:g} s to arrive") from None
        finally:
            conn.settimeout(None)

    def _hello(self, conn: socket.socket, message: dict[str, Any], peer: str | None) -> str | None:
        if bool(message.get("sealed")) != (self.sealer is not None):
            raise WireError("one side seals KV and the other does not: both need the same kv_encryption_key")
        theirs = message.get("nixl")
        if self.agent is None or not isinstance(theirs, str) or peer is not None:
            reply(conn, channel="tcp")
            return peer
        peer = self.agent.add_peer(theirs)
        reply(conn, channel="nixl", nixl=self.agent.metadata(), buffer=self.store.buffer.data_ptr())
        return peer

    def _offer(self, conn: socket.socket, message: dict[str, Any], offer: _Offer) -> None:
        raw = message.get("chunks")
        if not isinstance(raw, list) or not 0 < len(raw) <= MAX_CHUNKS_PER_OFFER:
            raise WireError(f"an offer lists 1..{MAX_CHUNKS_PER_OFFER} chunks")
        if offer.slots:
            raise WireError("a new offer before the previous one was written")
        chunks = [Chunk.from_json(c, self.store.buffer.nbytes) for c in raw]
        answers: list[Any] = []
        for i, (chunk, got) in enumerate(zip(chunks, self.store.reserve(chunks), strict=True)):
            if isinstance(got, MemoryObj):
                offer.slots[i] = (chunk, got)
                answers.append({"offset": got.metadata.address})
            else:
                answers.append(got)
        reply(conn, slots=answers)

    def _written(self, conn: socket.socket, message: dict[str, Any], offer: _Offer) -> None:
        inline = message.get("inline", [])
        notif = message.get("notif")
        if not isinstance(inline, list) or not all(isinstance(i, int) and i in offer.slots for i in inline) \
                or len(set(inline)) != len(inline):
            raise WireError("`inline` must list reserved slots of the offer, once each")
        if len(inline) < len(offer.slots) and (self.agent is None or not isinstance(notif, str)):
            raise WireError("slots not sent inline need the NIXL notification of their write")
        conn.settimeout(FRAME_TIMEOUT)
        for i in sorted(inline):
            chunk, obj = offer.slots[i]
            assert obj.tensor is not None
            self._receive(conn, chunk, byte_view(obj.tensor))
        conn.settimeout(None)
        if len(inline) < len(offer.slots):
            assert self.agent is not None and isinstance(notif, str)
            if not self.agent.wait_notif(notif.encode(), NOTIF_TIMEOUT):
                raise WireError(f"NIXL notification {notif!r} did not arrive in {NOTIF_TIMEOUT:.0f} s")
        chunks, objs = offer.take()
        reply(conn, committed=self.store.commit(chunks, objs))

    def _receive(self, conn: socket.socket, chunk: Chunk, view: memoryview) -> None:
        """One inline chunk into its slot (opened on the way where sealing is on)."""
        if self.sealer is None:
            recv_into(conn, view)
            return
        try:
            key = chunk.key.to_string().encode()
            opened = self.sealer.open(SocketReader(conn), len(view) + seal.OVERHEAD, key)
            readinto_exact(opened, view)
            opened.finish()
        except ForgedBlobError as e:
            self.num_forged += 1
            raise WireError(f"a sealed chunk did not open: {e}") from None
        except CorruptBlobError as e:  # the connection ended inside the chunk
            raise ConnectionError(str(e)) from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)
        if self.agent is not None:
            self.agent.close()
