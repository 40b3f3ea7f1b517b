"""A vLLM-CPU engine with ``--kv-events-config`` publishes LMCache's tiers in vLLM's KV events: a
subscriber decoding with vLLM's own `KVEventBatch` reads every batch, and the prefix the events
say each tier holds is what the engine's lookup reports, after evictions from a small hot tier
and after a clear (with the next engine step)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import defaultdict
from typing import Any

import msgspec
import pytest
import zmq

pytest.importorskip("vllm")

from tests.helpers.servers import free_port
from tests.helpers.vllm_engines import lmcache_transfer_config, sentence_text, start_llm, stop_llm

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

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


def _post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _agree(sub: Subscriber, port: int, prompts: list[list[int]], bs: int, timeout: float = 1.0) -> None:
    """Within `timeout` s the events' view of each tier equals the engine's lookup, per prompt."""
    deadline = time.monotonic() + timeout
    while True:
        want, got = [], []
        for tokens in prompts:
            tiers = _post(port, "/lookup", {"tokens": tokens})["tiers"]
            want.append((tiers["Hot"] // bs * bs, tiers["LocalDiskBackend"] // bs * bs))
            got.append((sub.prefix(tokens, "CPU", bs), sub.prefix(tokens, "STORAGE", bs)))
        if want == got:
            return
        assert time.monotonic() < deadline, f"events say {got}, lookup says {want}"
        time.sleep(0.05)


def test_lmcache_tiers_in_vllm_kv_events_match_lookup_through_eviction_and_clear(tmp_path):
    from vllm import SamplingParams
    from vllm.config import KVEventsConfig

    sub = Subscriber()
    port = free_port()
    # a chunk of SmolLM2 in fp32 is ~11.8 MB: the hot tier keeps 4 of the 9 chunks, the disk all
    transfer = lmcache_transfer_config(chunk_size=256, max_local_cpu_size=0.05, local_disk=str(tmp_path / "disk"),
                                       max_local_disk_size=1.0, controller_url=f"127.0.0.1:{port}")
    llm = start_llm(transfer, kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                               endpoint=sub.endpoint))
    try:
        bs = llm.llm_engine.vllm_config.cache_config.block_size
        tok = llm.get_tokenizer()
        prompts = [tok.encode(sentence_text(seed, 520))[:600] for seed in (71, 72, 73)]
        once = SamplingParams(max_tokens=1, temperature=0.0)
        for tokens in prompts:
            llm.generate({"prompt_token_ids": tokens}, once, use_tqdm=False)
        time.sleep(1.0)  # the disk's writes end in the background: their events leave with a step
        llm.generate({"prompt_token_ids": [1, 2, 3]}, once, use_tqdm=False)
        _agree(sub, port, prompts, bs)
        assert sub.prefix(prompts[0], "CPU", bs) == 0 < sub.prefix(prompts[0], "STORAGE", bs)  # evicted
        assert sub.prefix(prompts[-1], "CPU", bs) == 512  # 600 tokens: the trailing partial block is not reported

        assert _post(port, "/clear", {"tier": "hot"})["cleared"]["Hot"] > 0
        llm.generate({"prompt_token_ids": [4, 5, 6]}, once, use_tqdm=False)
        _agree(sub, port, prompts, bs)
        assert all(sub.prefix(t, "CPU", bs) == 0 and sub.prefix(t, "STORAGE", bs) == 512 for t in prompts)
        with sub.lock:
            assert sub.undecodable == 0 and sub.seqs == list(range(len(sub.seqs)))
    finally:
        stop_llm(llm)
        sub.close()
