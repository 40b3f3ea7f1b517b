"""Sealed blobs (`serde.seal`): what opens, what does not (tampering, moving, truncation, retired
keys), rotation, the disk tier with sealing on, and that key material never leaks into config,
reprs or errors."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.cli import main as cli_main
from lmcache.config import LMCacheEngineConfig
from lmcache.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.storage_backend.serde import CorruptBlobError, ForeignSerdeError, create_serde, seal
from lmcache.storage_backend.serde.blob import HEADER_SIZE, SERDE_IDS
from lmcache.storage_backend.serde.blob_stream import BufferStream, read_blob
from lmcache.storage_backend.serde.seal import (
    OVERHEAD,
    ForgedBlobError,
    Sealer,
    key_id,
    parse_keys,
    read_blob_sealed,
    read_whole_sealed,
    write_key_file,
)
from tests.helpers import WRITE_WAIT

from .conftest import SHAPE

K1, K2, K3 = (bytes([i]) * 32 for i in (1, 2, 3))
CHUNK_KEY = b"kv_blob@test-model@1@0@" + b"ab" * 16 + b"@bfloat16"
OTHER_KEY = b"kv_blob@test-model@1@0@" + b"cd" * 16 + b"@bfloat16"


def sealed_blob(sealer: Sealer, meta, seed: int = 0,
                chunk_key: bytes = CHUNK_KEY) -> tuple[bytes, torch.Tensor]:
    t = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    ser, _ = create_serde("naive", LMCacheEngineConfig.from_defaults(), meta)
    return bytes(sealer.seal(chunk_key, ser.to_parts(t))), t


def open_blob(sealer: Sealer | None, blob: bytes, meta, allocator, chunk_key: bytes = CHUNK_KEY):
    _, deser = create_serde("naive", LMCacheEngineConfig.from_defaults(), meta)
    return read_blob_sealed(BufferStream(blob), len(blob), chunk_key, sealer, SERDE_IDS["naive"], deser,
                            allocator.allocate)


def test_a_sealed_blob_opens_to_the_same_tensor_and_hides_it(meta, allocator):
    blob, t = sealed_blob(Sealer([K1]), meta)
    assert t.view(torch.uint8).numpy().tobytes()[:64] not in blob
    obj = open_blob(Sealer([K1]), blob, meta, allocator)
    assert torch.equal(obj.tensor, t)
    obj.ref_count_down()
    assert allocator.used_bytes == 0


def test_two_seals_of_the_same_chunk_differ_by_nonce(meta):
    a, _ = sealed_blob(Sealer([K1]), meta)
    b, _ = sealed_blob(Sealer([K1]), meta)
    assert a != b and len(a) == len(b)


@pytest.mark.parametrize("piece", [100, None], ids=["small-pieces", "default"])
def test_a_blob_sealed_piece_by_piece_opens_like_one_sealed_whole(meta, allocator, monkeypatch, piece):
    """`pieces` (encrypted as taken, for writers done with each piece at once) and `seal` (a new
    buffer) give blobs that open alike; taking the pieces again gives the same bytes (a writer
    may retry); two blobs taken in turn in one thread each get their own piece buffer."""
    if piece is not None:
        monkeypatch.setattr(seal, "SEAL_PIECE", piece)
    sealer = Sealer([K1])
    ser, _ = create_serde("naive", LMCacheEngineConfig.from_defaults(), meta)
    t1, t2 = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
              for seed in (1, 2))
    p1, p2 = sealer.pieces(CHUNK_KEY, ser.to_parts(t1)), sealer.pieces(OTHER_KEY, ser.to_parts(t2))
    first = b"".join(bytes(p) for p in p1)
    assert b"".join(bytes(p) for p in p1) == first and len(first) == p1.nbytes
    a, b = bytearray(), bytearray()
    for x, y in zip(p1, p2, strict=False):  # in turn: the second blob's pieces in a buffer of their own
        a += x
        b += y
    assert bytes(a) == first and len(b) == p2.nbytes
    fresh = bytes(sealer.seal(CHUNK_KEY, ser.to_parts(t1)))
    assert len(fresh) == len(first) == ser_len(ser, t1) + OVERHEAD
    for blob, key, t in ((first, CHUNK_KEY, t1), (bytes(b), OTHER_KEY, t2), (fresh, CHUNK_KEY, t1)):
        obj = open_blob(sealer, blob, meta, allocator, key)
        assert torch.equal(obj.tensor, t)
        obj.ref_count_down()
    with pytest.raises(ValueError, match="does not fit"):
        sealer.seal_into(CHUNK_KEY, ser.to_parts(t1), memoryview(bytearray(len(fresh) - 1)))


def test_a_piece_kept_past_the_next_one_raises_instead_of_showing_other_bytes(meta, monkeypatch):
    monkeypatch.setattr(seal, "SEAL_PIECE", 100)
    ser, _ = create_serde("naive", LMCacheEngineConfig.from_defaults(), meta)
    kept = list(Sealer([K1]).pieces(CHUNK_KEY, ser.to_parts(torch.zeros(SHAPE, dtype=torch.bfloat16))))
    with pytest.raises(ValueError, match="released"):
        bytes(kept[1])  # the first ciphertext piece: its buffer has held later pieces since


def ser_len(ser, t: torch.Tensor) -> int:
    return sum(memoryview(p).nbytes for p in ser.to_parts(t))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_byte_of_header_nonce_ciphertext_or_tag_is_forged(meta, allocator, data):
    blob, _ = sealed_blob(Sealer([K1]), meta)
    region = data.draw(st.sampled_from(["header", "nonce", "ciphertext", "tag"]))
    lo, hi = {"header": (0, 16), "nonce": (16, 28), "ciphertext": (36, len(blob) - 16),
              "tag": (len(blob) - 16, len(blob))}[region]
    pos = data.draw(st.integers(lo, hi - 1))
    bit = data.draw(st.integers(0, 7))
    bad = bytearray(blob)
    bad[pos] ^= 1 << bit
    with pytest.raises(ForgedBlobError):
        open_blob(Sealer([K1]), bytes(bad), meta, allocator)
    assert allocator.used_bytes == 0  # nothing read from a forged blob is kept


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(1, 200))
def test_a_truncated_sealed_blob_is_forged(meta, allocator, cut):
    blob, _ = sealed_blob(Sealer([K1]), meta)
    with pytest.raises(ForgedBlobError):
        open_blob(Sealer([K1]), blob[:-cut], meta, allocator)


def test_a_plaintext_the_reader_chokes_on_is_forged_unless_it_authenticates(meta):
    """The plaintext is unauthenticated until the tag is checked: a reader's own error on it (not
    a CorruptBlobError) is reported as tampering when the tag fails, and as itself when not."""
    blob, _ = sealed_blob(Sealer([K1]), meta)
    tampered = bytearray(blob)
    tampered[seal.HEADER_SIZE + 8 + 7] ^= 0x80  # a ciphertext bit over the first shape dim

    def choke(stream, length):
        raise OverflowError("a dim does not fit")

    with pytest.raises(ForgedBlobError):
        Sealer([K1]).open(BufferStream(tampered), len(tampered), CHUNK_KEY).read(choke)
    with pytest.raises(OverflowError):
        Sealer([K1]).open(BufferStream(blob), len(blob), CHUNK_KEY).read(choke)


def test_a_blob_copied_under_another_chunk_key_is_forged(meta, allocator):
    blob, _ = sealed_blob(Sealer([K1]), meta)
    with pytest.raises(ForgedBlobError):
        open_blob(Sealer([K1]), blob, meta, allocator, chunk_key=OTHER_KEY)


def test_a_valid_header_with_another_key_is_forged_and_a_retired_key_too(meta, allocator):
    blob, _ = sealed_blob(Sealer([K2]), meta)
    forged = blob[:8] + key_id(K1) + blob[16:]  # claims K1's id, sealed with K2
    with pytest.raises(ForgedBlobError, match="authenticate"):
        open_blob(Sealer([K1]), forged, meta, allocator)
    with pytest.raises(ForgedBlobError, match="not configured"):
        open_blob(Sealer([K1, K3]), blob, meta, allocator)  # K2 retired


def test_rotation_seals_with_the_first_key_and_opens_with_every_configured_one(meta, allocator):
    old, t = sealed_blob(Sealer([K1]), meta)
    rotated = Sealer([K2, K1])
    new, _ = sealed_blob(rotated, meta)
    assert new[8:16] == key_id(K2) and old[8:16] == key_id(K1)
    for blob in (old, new):
        obj = open_blob(rotated, blob, meta, allocator)
        assert torch.equal(obj.tensor, t)
        obj.ref_count_down()


def test_sealing_on_rejects_unsealed_blobs_and_sealing_off_keeps_sealed_ones_as_foreign(meta, allocator):
    t = torch.zeros(SHAPE, dtype=torch.bfloat16)
    ser, deser = create_serde("naive", LMCacheEngineConfig.from_defaults(), meta)
    plain = b"".join(bytes(p) for p in ser.to_parts(t))
    with pytest.raises(ForgedBlobError, match="unsealed"):
        open_blob(Sealer([K1]), plain, meta, allocator)
    sealed, _ = sealed_blob(Sealer([K1]), meta)
    with pytest.raises(ForeignSerdeError):
        read_blob(BufferStream(sealed), len(sealed), SERDE_IDS["naive"], deser, allocator.allocate)


def test_under_a_seal_the_tag_checks_the_payload_and_its_checksum_is_not_recomputed(meta, allocator):
    """The tag covers the blob header, checksum included, and every payload byte, so the opened
    payload is not hashed again: a blob sealed with a wrong inner checksum (only a key holder can
    make one) opens, while the same blob unsealed is refused for that checksum."""
    t = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ser, deser = create_serde("naive", LMCacheEngineConfig.from_defaults(), meta)
    head, *payload = (bytes(p) for p in ser.to_parts(t))
    bad_head = head[:HEADER_SIZE - 8] + bytes(8)  # the checksum field zeroed
    plain = b"".join([bad_head, *payload])
    with pytest.raises(CorruptBlobError, match="checksum"):
        read_blob(BufferStream(plain), len(plain), SERDE_IDS["naive"], deser, allocator.allocate)
    sealed = bytes(Sealer([K1]).seal(CHUNK_KEY, [bad_head, *payload]))
    obj = open_blob(Sealer([K1]), sealed, meta, allocator)
    assert torch.equal(obj.tensor, t)
    obj.ref_count_down()
    cut = bytes(Sealer([K1]).seal(CHUNK_KEY, [bad_head, payload[0][:-2]]))  # lengths still checked
    with pytest.raises(CorruptBlobError, match="payload bytes"):
        open_blob(Sealer([K1]), cut, meta, allocator)
    assert allocator.used_bytes == 0


def test_a_whole_blob_opens_for_a_decoding_serde(meta):
    blob, _ = sealed_blob(Sealer([K1]), meta)
    whole = read_whole_sealed(BufferStream(blob), len(blob), CHUNK_KEY, Sealer([K1]))
    assert len(whole) == len(blob) - OVERHEAD
    with pytest.raises(ForgedBlobError):
        read_whole_sealed(BufferStream(blob), len(blob), OTHER_KEY, Sealer([K1]))


def test_key_text_parsing_and_errors_never_echo_key_material(tmp_path):
    assert parse_keys(f"# newest first\n{K2.hex()}\n\n{K1.hex()}  # old\n", "f") == [K2, K1]
    assert parse_keys(f"{K2.hex()},{K1.hex()}", "env") == [K2, K1]
    secret = "ab" * 31 + "zz"
    with pytest.raises(ValueError) as e:
        parse_keys(secret, "LMCACHE_KV_KEY")
    assert secret not in str(e.value) and "line 1" in str(e.value)
    with pytest.raises(ValueError) as e:
        LMCacheEngineConfig.from_defaults(kv_encryption_key=K1.hex())  # material where a path goes
    assert K1.hex() not in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        LMCacheEngineConfig.from_defaults(kv_encryption_key=str(tmp_path / "missing"))


@pytest.mark.parametrize("value", [
    f"{K1.hex()}\n{K2.hex()}",  # key text one per line, as a key file holds it
    K1.hex()[:-1],  # a digit short
    "0x" + K1.hex(),
    f"{K1.hex()}  # the new key",
    f"{K1.hex()};{K2.hex()}",
], ids=["lines", "short", "0x", "comment", "semicolons"])
def test_key_material_where_the_key_file_path_goes_is_never_echoed(value):
    """`kv_encryption_key` names a key file: a value that holds key material in any form (not
    only the exact comma-separated one) is refused without being repeated in the error."""
    with pytest.raises(ValueError) as e:
        LMCacheEngineConfig.from_defaults(kv_encryption_key=value)
    assert K1.hex()[:32] not in str(e.value) and K1.hex()[:32] not in repr(e.value.__cause__)


def test_a_key_file_in_a_directory_named_with_hex_digits_is_a_path(tmp_path):
    directory = tmp_path / ("ab" * 32)
    directory.mkdir()
    path = key_file(directory, "kv.key", K1)
    assert seal.load_keys(path) == [K1]


def test_key_material_is_not_in_config_repr_dict_or_logs(monkeypatch, tmp_path, caplog, meta, allocator):
    monkeypatch.setenv("LMCACHE_KV_KEY", K3.hex())
    caplog.set_level(logging.DEBUG)
    config = LMCacheEngineConfig.from_defaults(local_disk=str(tmp_path), max_local_disk_size=0.01)
    backend = LocalDiskBackend(config, meta, allocator.allocate)
    try:
        assert backend.sealer is not None
        texts = [repr(config), str(config.to_dict()), repr(backend.sealer), caplog.text]
        assert not any(K3.hex() in t or K3.hex().upper() in t for t in texts)
        assert key_id(K3).hex() in repr(backend.sealer)
    finally:
        backend.close()


def test_keygen_writes_a_0600_key_file_and_refuses_to_overwrite(tmp_path, capsys):
    path = str(tmp_path / "kv.key")
    assert cli_main(["keygen", path]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    keys = parse_keys(open(path).read(), path)
    assert len(keys) == 1 and key_id(keys[0]).hex() in capsys.readouterr().out
    with pytest.raises(SystemExit, match="refusing"):
        cli_main(["keygen", path])
    with pytest.raises(FileExistsError):
        write_key_file(path)
    assert parse_keys(open(path).read(), path) == keys


# ---- the disk tier with sealing on --------------------------------------------------------------

def key_file(tmp_path, name: str, *keys: bytes) -> str:
    path = tmp_path / name
    path.write_text("".join(k.hex() + "\n" for k in keys))
    return str(path)


def disk(disk_config, meta, allocator, path: str) -> LocalDiskBackend:
    return LocalDiskBackend(disk_config(kv_encryption_key=path), meta, allocator.allocate)


def stored(backend: LocalDiskBackend, key, obj) -> None:
    backend.submit_put_task(key, obj)
    assert backend.puts.flush(WRITE_WAIT)


def test_disk_files_are_sealed_and_read_back(tmp_path, disk_config, meta, allocator, key, make_obj):
    backend = disk(disk_config, meta, allocator, key_file(tmp_path, "k", K1))
    obj = make_obj(1)
    expected = obj.tensor.clone()
    stored(backend, key(1), obj)
    obj.ref_count_down()
    (file,) = [e for e in os.scandir(backend.path) if e.name.endswith(".kvc")]
    assert expected.view(torch.uint8).numpy().tobytes()[:64] not in open(file.path, "rb").read()
    got = backend.get_blocking(key(1))
    assert torch.equal(got.tensor, expected)
    got.ref_count_down()
    backend.close()


def test_disk_forged_moved_truncated_and_retired_files_are_counted_deleted_misses(
        tmp_path, disk_config, meta, allocator, key, make_obj):
    path = key_file(tmp_path, "k", K1)
    writer = disk(disk_config, meta, allocator, path)
    for i in range(4):
        obj = make_obj(i)
        stored(writer, key(i), obj)
        obj.ref_count_down()
    writer.close()
    files = {i: os.path.join(writer.path, writer._stem(key(i)) + ".kvc") for i in range(4)}
    with open(files[0], "r+b") as f:  # truncated
        f.truncate(os.path.getsize(files[0]) - 5)
    data = bytearray(open(files[1], "rb").read())  # a byte of ciphertext flipped
    data[-100] ^= 1
    open(files[1], "wb").write(data)
    moved = open(files[2], "rb").read()  # key 2's blob copied under key 3's name (header fixed up)
    k2, k3 = key(2).to_string().encode(), key(3).to_string().encode()
    open(files[3], "wb").write(moved.replace(k2, k3, 1))
    reader = disk(disk_config, meta, allocator, path)
    got = reader.batched_get([key(i) for i in range(4)])
    assert [obj is None for obj in got] == [True, True, False, True]  # key 2's own file is intact
    assert reader.stats().counters["forged"] == 3
    got[2].ref_count_down()
    reader.close()
    assert [os.path.exists(files[i]) for i in range(4)] == [False, False, True, False]
    retired = disk(disk_config, meta, allocator, key_file(tmp_path, "k2", K2))  # K1 retired
    assert retired.get_blocking(key(2)) is None
    assert retired.stats().counters["forged"] == 1 and not os.path.exists(files[2])
    retired.close()


def test_a_disk_file_whose_ciphertext_flips_a_shape_dim_to_overflow_is_a_forged_miss(
        tmp_path, disk_config, meta, allocator, key, make_obj):
    """GCM is malleable before the tag check: the flipped bit reaches the blob header's first
    dim (>= 2**63) as plaintext; it is a forged miss, deleted and counted, not an error."""
    backend = disk(disk_config, meta, allocator, key_file(tmp_path, "k", K1))
    obj = make_obj(1)
    stored(backend, key(1), obj)
    obj.ref_count_down()
    path = backend._key_to_path(key(1))
    data = bytearray(open(path, "rb").read())
    data[8 + len(key(1).to_string()) + seal.HEADER_SIZE + 8 + 7] ^= 0x80
    open(path, "wb").write(data)
    assert backend.get_blocking(key(1)) is None
    counters = backend.stats().counters
    assert (counters["forged"], counters["corrupt"]) == (1, 1) and not os.path.exists(path)
    backend.close()
    assert allocator.used_bytes == 0


def test_key_rotation_across_a_restart(tmp_path, disk_config, meta, allocator, key, make_obj):
    old = disk(disk_config, meta, allocator, key_file(tmp_path, "old", K1))
    obj = make_obj(7)
    expected = obj.tensor.clone()
    stored(old, key(7), obj)
    obj.ref_count_down()
    old.close()
    rotated = disk(disk_config, meta, allocator, key_file(tmp_path, "rotated", K2, K1))
    got = rotated.get_blocking(key(7))
    assert got is not None and torch.equal(got.tensor, expected)
    stored(rotated, key(8), got)  # new blobs are sealed with the new key
    got.ref_count_down()
    rotated.close()
    assert open(os.path.join(rotated.path, rotated._stem(key(8)) + ".kvc"), "rb").read().find(key_id(K2)) > 0
