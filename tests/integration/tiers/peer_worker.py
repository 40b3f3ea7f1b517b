"""An engine in its own process that shares its chunks with peers (run as a script with
PYTHONPATH = repository root):

    peer_worker.py LOOKUP_URL TTL SEED:TOKENS [SEED:TOKENS ...]

stores, for each SEED:TOKENS, the paged KV `paged_kv(SEED)` of `tokens_for(SEED, TOKENS)`, prints
``ready HOST:PORT`` (its peer server) once the lookup service has its registrations, then serves
until killed."""

from __future__ import annotations

import sys
import time

import torch

from tests.helpers.paged_kv import PagedKV, build_engine

CHUNK = 8


def paged_kv(seed: int) -> PagedKV:
    torch.manual_seed(seed)
    return PagedKV(num_blocks=64)


def tokens_for(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(1000 + seed))


def peer_engine(lookup_url: str, ttl: float, **cfg):
    return build_engine(CHUNK, enable_p2p=True, lookup_url=lookup_url, distributed_url="127.0.0.1:0",
                        p2p_ttl=ttl, remote_timeout=2.0, **cfg)


def main(lookup_url: str, ttl: str, *specs: str) -> None:
    engine = peer_engine(lookup_url, float(ttl))
    for spec in specs:
        seed, n = (int(x) for x in spec.split(":"))
        kv = paged_kv(seed)
        engine.store(tokens_for(seed, n), kvcaches=kv.layers, slot_mapping=kv.slots_for(n))
    peer = engine.storage_manager.backends["PeerBackend"]
    assert peer.lookup.flush(10)  # type: ignore[attr-defined]
    print("ready", peer.address, flush=True)  # type: ignore[attr-defined]
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(*sys.argv[1:])
