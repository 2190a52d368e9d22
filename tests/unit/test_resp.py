"""buffer.resp without a server: what `pack` writes, and `send` through short writes."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from staleflow.buffer import resp


def joined(buffers) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in buffers)


def test_pack_writes_the_redis_protocol_for_every_argument_type():
    ids = np.arange(3, dtype=np.int32)  # 12 bytes: small, joined with the rest
    packed = resp.pack([("SET", "clé", b""), ("X", 7, -2, 0.5, bytearray(b"ab"), ids.data)])
    # "clé" is 4 bytes in UTF-8; numbers go as redis-py writes them (repr); the int32 view
    # as its 12 raw bytes, little-endian
    assert joined(packed) == (
        b"*3\r\n$3\r\nSET\r\n$4\r\ncl\xc3\xa9\r\n$0\r\n\r\n"
        b"*6\r\n$1\r\nX\r\n$1\r\n7\r\n$2\r\n-2\r\n$3\r\n0.5\r\n$2\r\nab\r\n"
        b"$12\r\n\x00\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00\r\n"
    )
    assert len(packed) == 1  # nothing large: one buffer


def test_pack_leaves_large_arguments_in_place():
    tokens = np.arange(2048, dtype=np.int32)  # 8192 bytes, above the 4 KB cutoff
    packed = resp.pack([("XADD", "s", "*", "tok", tokens.data, "v", 1)])
    # head, the array's own memory, tail: the payload is not copied
    assert len(packed) == 3
    assert isinstance(packed[1], memoryview)
    assert packed[1].obj is tokens
    assert joined(packed) == (
        b"*7\r\n$4\r\nXADD\r\n$1\r\ns\r\n$1\r\n*\r\n$3\r\ntok\r\n$8192\r\n"
        + tokens.tobytes()
        + b"\r\n$1\r\nv\r\n$1\r\n1\r\n"
    )


@pytest.mark.parametrize("bad", [None, True, {"a": 1}, np.int64(3)])
def test_pack_refuses_what_redis_py_would_refuse(bad):
    with pytest.raises(redis.DataError, match=f"type {type(bad).__name__}"):
        resp.pack([("SET", "k", bad)])


class ShortWrites:
    """A socket that takes at most `most` bytes a call, and `iov` buffers at most."""

    def __init__(self, most: int) -> None:
        self.most, self.received, self.calls, self.iov = most, bytearray(), 0, 0

    def sendmsg(self, buffers):
        self.calls += 1
        self.iov = max(self.iov, len(buffers))
        data = b"".join(bytes(b) for b in buffers)[: self.most]
        self.received += data
        return len(data)


class Conn:
    def __init__(self, sock) -> None:
        self._sock, self.health_checks = sock, 0

    def check_health(self) -> None:
        self.health_checks += 1


@pytest.mark.parametrize("most", [1, 777, 8192, 1 << 30])
def test_send_finishes_after_short_writes(most):
    rng = np.random.default_rng(0)
    big = [rng.integers(0, 255, size=n, dtype=np.uint8).data for n in (5000, 9001, 4096)]
    commands = [("XADD", "s", "*", "a", big[0], "b", big[1]), ("SET", "k", big[2]), ("PING",)]
    packed = resp.pack(commands)
    conn = Conn(ShortWrites(most))
    resp.send(conn, packed)
    assert bytes(conn._sock.received) == joined(packed)
    assert conn.health_checks == 1  # redis-py's periodic health check, as its sends do
    if most == 1 << 30:
        assert conn._sock.calls == 1  # everything in one system call


def test_send_passes_at_most_1024_buffers_a_call():
    parts = [np.full(4096, i % 251, dtype=np.uint8).data for i in range(1500)]
    packed = resp.pack([("RPUSH", "k", *parts)])
    assert len(packed) > 3000
    conn = Conn(ShortWrites(1 << 30))
    resp.send(conn, packed)
    assert conn._sock.iov == 1024
    assert conn._sock.calls == 3
    assert bytes(conn._sock.received) == joined(packed)
