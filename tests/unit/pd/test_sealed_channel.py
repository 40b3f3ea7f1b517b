"""The PD channel's TCP path with sealing on: chunks arrive exactly, and a chunk that does not
open (another key) or a side that does not seal is never served."""

from __future__ import annotations

import time

import pytest
import torch

from lmcache.pd.sender import PDSender
from tests.helpers.paged_kv import build_engine

from .test_channel import CHUNK, address, loaded, receiver_engine, stored

K1, K2 = (bytes([i]) * 32 for i in (1, 2))


def key_file(tmp_path, name: str, key: bytes) -> str:
    path = tmp_path / name
    path.write_text(key.hex() + "\n")
    return str(path)


@pytest.fixture
def sealed_pair(tmp_path):
    """`make(sender_key, receiver_key)`: (sender engine, PDSender, receiver engine) on TCP, each
    sealing with its key file (None: no sealing)."""
    made = []

    def make(tx_key: bytes | None, rx_key: bytes | None):
        rx_cfg = {"kv_encryption_key": key_file(tmp_path, "rx", rx_key)} if rx_key else {}
        tx_cfg = {"kv_encryption_key": key_file(tmp_path, "tx", tx_key)} if tx_key else {}
        rx = receiver_engine("tcp", **rx_cfg)
        tx = build_engine(CHUNK, transfer_channel="tcp", **tx_cfg)
        sender = PDSender(tx, tx.config, rank=0)
        made.append((tx, sender, rx))
        return tx, sender, rx

    yield make
    for tx, sender, rx in made:
        sender.close()
        tx.close()
        rx.close()


def test_sealed_chunks_arrive_exactly(sealed_pair):
    tx, sender, rx = sealed_pair(K1, K1)
    tokens, kv = stored(tx, 36)
    result = sender.send(address(rx), tokens)
    assert len(result.chunks) == 5 and result.skipped == 0
    got, n = loaded(rx, tokens)
    assert n == 36 and torch.equal(got, kv)
    assert rx.storage_manager.backends["PDBackend"].stats().counters["forged"] == 0
    rx.check_integrity()


def test_a_chunk_sealed_with_another_key_is_counted_and_never_served(sealed_pair):
    tx, sender, rx = sealed_pair(K1, K2)
    tokens, _ = stored(tx, 24)
    result = sender.send(address(rx), tokens)
    assert result.chunks == []
    assert rx.lookup(tokens) == 0
    tier = rx.storage_manager.backends["PDBackend"]
    assert tier.stats().counters["forged"] == 1
    deadline = time.monotonic() + 5  # the receiver frees the reservations as it closes the connection
    while tier.stats().gauges["reserved"] and time.monotonic() < deadline:
        time.sleep(0.01)
    tier.check_integrity(at_rest=True)


@pytest.mark.parametrize("keys", [(K1, None), (None, K1)], ids=["sender-seals", "receiver-seals"])
def test_a_side_that_does_not_seal_is_refused(sealed_pair, keys):
    tx, sender, rx = sealed_pair(*keys)
    tokens, _ = stored(tx, 16)
    assert sender.send(address(rx), tokens).chunks == []
    assert rx.lookup(tokens) == 0
    assert rx.storage_manager.backends["PDBackend"].server.num_bad_frames == 1
