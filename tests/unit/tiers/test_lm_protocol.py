import pytest

from lmcache.server import protocol
from lmcache.server.lru_store import LRUByteStore
from lmcache.server.protocol import Op, ProtocolError, Status


def test_request_header_round_trips():
    frame = protocol.pack_request(Op.PUT, b"key", 10)
    assert protocol.unpack_request(frame[: protocol.HEADER_SIZE], 100) == (Op.PUT, 3, 10)
    assert frame[protocol.HEADER_SIZE :] == b"key"


@pytest.mark.parametrize("head, match", [
    (b"\0" * 16, "bad frame header"),
    (protocol.HEADER.pack(protocol.MAGIC, protocol.VERSION, 99, 0, 0), "unknown op"),
    (protocol.HEADER.pack(protocol.MAGIC, protocol.VERSION, Op.GET, protocol.MAX_KEY_BYTES + 1, 0), "key"),
    (protocol.HEADER.pack(protocol.MAGIC, protocol.VERSION, Op.PUT, 1, 101), "frame limit"),
    (protocol.HEADER.pack(protocol.MAGIC, protocol.VERSION, Op.GET, 1, 5), "carries no value"),
])
def test_bad_request_headers_raise_protocol_error(head, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.unpack_request(head, 100)


def test_oversize_key_is_refused_by_the_client_side_packer():
    with pytest.raises(ValueError, match="exceeds"):
        protocol.pack_request(Op.GET, b"k" * (protocol.MAX_KEY_BYTES + 1))


def test_response_and_key_list_round_trip():
    assert protocol.unpack_response(protocol.pack_response(Status.NOT_FOUND, 7)) == (Status.NOT_FOUND, 7)
    keys = [b"a", b"", b"x" * 300]
    assert protocol.unpack_key_list(protocol.pack_key_list(keys)) == keys
    with pytest.raises(ProtocolError):
        protocol.unpack_key_list(protocol.pack_key_list(keys)[:-1])


def test_lru_store_evicts_least_recently_used_within_capacity():
    s = LRUByteStore(10)
    assert s.put(b"a", b"1234") and s.put(b"b", b"1234")
    assert s.get(b"a") == b"1234"  # a is now most recent
    assert s.put(b"c", b"1234")
    assert s.keys() == [b"a", b"c"] and s.used == 8 and s.num_evicted == 1
    assert not s.put(b"d", b"x" * 11) and s.contains(b"a")
    assert s.put(b"a", b"12") and s.used == 6  # overwrite replaces the old size
    assert s.delete(b"a") and not s.delete(b"a") and s.keys(b"c") == [b"c"]
