"""NIXL, as the KV channel uses it: one agent per process side, host memory (DRAM) only.

`NixlAgent` wraps NIXL's Python agent (``nixl._api``, or ``nixl_cu12._api`` when only the wheel
is installed): register a buffer once (registering does not touch its pages), exchange agent
metadata through the channel's own frames, WRITE lists of ``(address, length)`` ranges into a peer
and wait for them, and collect the peer's notification that the bytes landed. `available()` says
whether NIXL can be imported here; nothing else in the package imports it.

The agent runs without NIXL's progress thread: that thread polls without pause and keeps a whole
core busy for the life of the process, idle or not (vLLM's NixlConnector runs with it). Transfers
progress when their sides call in instead: the writer while it waits for its write (`write`), the
target while a write into it may be under way (`progress`, `wait_notif`). NIXL logs every
agent's creation at INFO on stdout; unless ``NIXL_LOG_LEVEL`` says otherwise, only its warnings
are shown.
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from lmcache.observability import log_once

_API: Any = None


def _api() -> Any:
    global _API
    if _API is None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
            try:
                _API = importlib.import_module(name)
                break
            except ImportError:
                continue
        else:
            raise ImportError("NIXL is not installed (pip install nixl-cu12)")
    return _API


def available() -> bool:
    try:
        _api()
    except ImportError as e:
        log_once(logging.getLogger(__name__), "no-nixl", "%s: the KV channel uses TCP", e,
                 level=logging.INFO)
        return False
    return True


class NixlError(RuntimeError):
    """A NIXL transfer failed or did not finish in time."""


class NixlAgent:
    def __init__(self, backends: Sequence[str]) -> None:
        api = _api()
        self.name = f"lmcache-{uuid.uuid4().hex[:12]}"
        config = api.nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        self._agent = api.nixl_agent(self.name, config)
        self._registered: list[Any] = []
        self._notifs: set[bytes] = set()
        self._notif_lock = threading.Lock()

    def register(self, buffer: torch.Tensor) -> None:
        """Make `buffer` (contiguous host memory) a source or target of transfers."""
        self._registered.append(self._agent.register_memory(buffer))

    def metadata(self) -> str:
        return base64.b64encode(self._agent.get_agent_metadata()).decode()

    def add_peer(self, metadata: str) -> str:
        """Know the agent `metadata` describes; its name."""
        try:
            raw = base64.b64decode(metadata, validate=True)
        except ValueError as e:
            raise ValueError(f"bad NIXL agent metadata: {e}") from None
        name = self._agent.add_remote_agent(raw)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def write(self, peer: str, ranges: Sequence[tuple[int, int, int]], notif: bytes,
              timeout: float) -> None:
        """Copy each ``(local address, remote address, length)`` into `peer`'s registered memory,
        then `peer` gets `notif`; returns when done. NixlError on failure or after `timeout` s."""
        local = self._agent.get_xfer_descs([(src, n, 0) for src, _, n in ranges], "DRAM")
        remote = self._agent.get_xfer_descs([(dst, n, 0) for _, dst, n in ranges], "DRAM")
        handle = self._agent.initialize_xfer("WRITE", local, remote, peer, notif)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise NixlError(f"NIXL write to {peer} still running after {timeout:.0f} s")
                time.sleep(0.0002)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise NixlError(f"NIXL write to {peer} failed ({state})")
        finally:
            self._agent.release_xfer_handle(handle)

    def progress(self) -> None:
        """Lets writes into this agent's memory progress; keeps the notifications that arrived."""
        with self._notif_lock:
            for messages in self._agent.get_new_notifs().values():
                self._notifs.update(messages)

    def wait_notif(self, notif: bytes, timeout: float) -> bool:
        """Wait until a peer's notification `notif` arrived (each is consumed once)."""
        deadline = time.monotonic() + timeout
        while True:
            self.progress()
            with self._notif_lock:
                if notif in self._notifs:
                    self._notifs.discard(notif)
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0002)

    def close(self) -> None:
        for descs in self._registered:
            try:
                self._agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001 - closing: nothing left to do about it
                pass
        self._registered = []
