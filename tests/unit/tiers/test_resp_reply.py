"""`RespBulkReply` over a real socket pair: values, nil, errors and malformed replies."""

import socket

import pytest
from redis.exceptions import ResponseError

from lmcache.storage_backend.connectors.resp import RespBulkReply
from lmcache.storage_backend.serde.blob_stream import read_exact


def reply_from(data: bytes, pieces: int = 1) -> tuple[RespBulkReply, socket.socket]:
    """A reader over a socket whose peer sent `data` in `pieces` writes (all of it fits in the
    socket buffer, so the writes complete before the reader starts)."""
    a, b = socket.socketpair()
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        b.sendall(data[i:i + step])
    return RespBulkReply(a), b


@pytest.mark.parametrize("pieces", [1, 3, 50])
def test_value_is_delivered_exactly_and_the_terminator_consumed(pieces):
    value = bytes(range(256)) * 40
    reply, peer = reply_from(b"$%d\r\n" % len(value) + value + b"\r\n" + b"+NEXT\r\n", pieces)
    assert reply.header() == len(value)
    assert bytes(read_exact(reply, len(value))) == value
    reply.finish()
    assert reply.readinto(memoryview(bytearray(4))) == 0  # nothing beyond this value is read
    peer.close()


@pytest.mark.parametrize("pieces", [1, 7, 200])
def test_pipelined_replies_are_read_back_to_back(pieces):
    values = [b"a" * 3, None, bytes(range(200)) * 30, b"", b"tail"]
    wire = b"".join(b"$-1\r\n" if v is None else b"$%d\r\n" % len(v) + v + b"\r\n" for v in values)
    reply, peer = reply_from(wire, pieces)
    for i, v in enumerate(values):
        n = reply.header()
        if v is None:
            assert n is None
            continue
        assert n == len(v)
        if i == 2:  # read a part, skip the rest
            assert bytes(read_exact(reply, 10)) == v[:10]
            reply.skip_rest()
        else:
            assert bytes(read_exact(reply, n)) == v
        reply.finish()
    reply.check_drained()
    peer.close()


def test_bytes_after_the_last_expected_reply_are_an_error():
    reply, peer = reply_from(b"$1\r\nx\r\n$1\r\ny\r\n")
    assert reply.header() == 1 and bytes(read_exact(reply, 1)) == b"x"
    reply.finish()
    with pytest.raises(ConnectionError, match="unexpected bytes"):
        reply.check_drained()
    peer.close()


@pytest.mark.parametrize("nil", [b"$-1\r\n", b"_\r\n"])  # RESP2, RESP3
def test_nil_reply_is_none(nil):
    reply, peer = reply_from(nil)
    assert reply.header() is None
    peer.close()


def test_error_reply_raises_response_error():
    reply, peer = reply_from(b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        reply.header()
    peer.close()


@pytest.mark.parametrize("data", [b"+OK\r\n", b":12\r\n", b"$abc\r\n", b"x" * 100])
def test_unexpected_replies_are_connection_errors(data):
    reply, peer = reply_from(data)
    with pytest.raises(ConnectionError):
        reply.header()
    peer.close()


def test_bad_terminator_and_early_close_are_connection_errors():
    reply, peer = reply_from(b"$3\r\nabcXY")
    assert reply.header() == 3 and bytes(read_exact(reply, 3)) == b"abc"
    with pytest.raises(ConnectionError, match="terminator"):
        reply.finish()
    peer.close()
    reply, peer = reply_from(b"$10\r\nabc")
    assert reply.header() == 10
    peer.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError, match="middle"):
        read_exact(reply, 10)
    peer.close()
