"""A subscriber to KV events written against vLLM's own classes (as a router would be)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

LMCACHE_MEDIA = ("CPU", "STORAGE")


class Subscriber:
    """A ZMQ SUB (bound; vLLM connects) that decodes every batch with vLLM's decoder and keeps
    the blocks each medium holds."""

    def __init__(self) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.lock = threading.Lock()
        self.held: dict[str, set[Any]] = defaultdict(set)  # medium -> block hashes
        self.blocks: dict[tuple[Any, tuple[int, ...]], Any] = {}  # (parent, tokens) -> hash
        self.seqs: list[int] = []
        self.undecodable = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(100):
                continue
            _topic, seq, payload = self.sock.recv_multipart()
            try:
                batch = self.decoder.decode(payload)
            except msgspec.DecodeError:
                self.undecodable += 1
                continue
            with self.lock:
                self.seqs.append(int.from_bytes(seq, "big"))
                for event in batch.events:
                    self._apply(event)

    def _apply(self, event: Any) -> None:
        kind = type(event).__name__
        if kind == "AllBlocksCleared":
            self.held.clear()
        elif event.medium not in LMCACHE_MEDIA:
            return
        elif kind == "BlockStored":
            parent, bs = event.parent_block_hash, event.block_size
            for i, h in enumerate(event.block_hashes):
                self.blocks[(parent, tuple(event.token_ids[i * bs : (i + 1) * bs]))] = h
                self.held[event.medium].add(h)
                parent = h
        else:
            self.held[event.medium].difference_update(event.block_hashes)

    def prefix(self, tokens: list[int], medium: str, block_size: int) -> int:
        """Tokens of `tokens`' longest prefix whose blocks the events say `medium` holds."""
        with self.lock:
            parent, n = None, 0
            while n + block_size <= len(tokens):
                h = self.blocks.get((parent, tuple(tokens[n : n + block_size])))
                if h is None or h not in self.held[medium]:
                    break
                parent, n = h, n + block_size
            return n

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()

    def leading(self, hashes: Sequence[Any], medium: str) -> int:
        """How many of `hashes`, from the first, the events say `medium` holds."""
        with self.lock:
            return next((i for i, h in enumerate(hashes) if h not in self.held[medium]), len(hashes))
