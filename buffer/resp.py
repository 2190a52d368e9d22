"""Commands in the Redis protocol (RESP), written in one system call from the caller's memory.

redis-py with hiredis copies every payload twice before sending (a memoryview into bytes, then
all arguments into one buffer), and without hiredis it sends a large argument with a write of
its own. `pack` copies only the small parts; a large argument (a group's token ids and
log-probs) stays where it is, and `send` hands the whole list to the kernel in one `sendmsg`.
On the 2-core machine, eight runs of bench/buffer.py each beside one of the version
before: a push of one 66 KB group went from 0.65-0.68x a raw redis-py XADD to 0.67-0.72x, and
push_many(8) from 0.73-0.77x to 0.77-0.81x. The same buffers written with one `sendall` each
were slower than redis-py (0.57x, in a throwaway prototype): each write wakes the server,
which then reads part of a command.

A TLS socket cannot write a vector: there the parts are joined and written once.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable, Sequence
from typing import Any

import redis

__all__ = ["pack", "send"]

_CUTOFF = 4096  # an argument at least this big is sent from its own memory, not copied
_IOV_MAX = 1024  # buffers per sendmsg (Linux's limit)


def _as_bytes(arg: Any) -> bytes | bytearray | memoryview:
    if isinstance(arg, bytes | bytearray):
        return arg
    if isinstance(arg, memoryview):
        if arg.c_contiguous:
            return arg.cast("B") if arg.format != "B" or arg.ndim != 1 else arg
        return arg.tobytes()
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, int | float) and not isinstance(arg, bool):
        return repr(arg).encode()  # as redis-py encodes numbers
    raise redis.DataError(
        f"invalid argument of type {type(arg).__name__} in a Redis command: "
        "expected bytes, a memoryview, str, int or float"
    )


def pack(commands: Iterable[Sequence[Any]]) -> list[bytes | bytearray | memoryview]:
    """The commands in RESP, as a list of buffers: small parts joined, each argument of at
    least 4 KB a view of the caller's memory (keep it unchanged until `send` returns)."""
    out: list[bytes | bytearray | memoryview] = []
    parts: list[bytes | bytearray | memoryview] = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            kind = type(arg)  # the common types first: this loop is most of a push's packing
            if kind is str:
                data: bytes | bytearray | memoryview = arg.encode()
            elif kind is bytes:
                data = arg
            elif kind is int:
                data = b"%d" % arg
            else:
                data = _as_bytes(arg)
            n = len(data)
            if n < _CUTOFF:
                parts += (b"$%d\r\n" % n, data, b"\r\n")
            else:
                parts.append(b"$%d\r\n" % n)
                out += (b"".join(parts), data)
                parts = [b"\r\n"]
    if parts:
        out.append(b"".join(parts))
    return out


def send(conn: Any, buffers: list[bytes | bytearray | memoryview]) -> None:
    """Write `buffers` (from `pack`) on a redis-py connection, connecting it if needed, with
    one `sendmsg` (per 1024 buffers; again for what a short write left). Raises OSError
    (socket.timeout included) as the socket does, or redis-py's errors from connecting or
    its health check: the caller disconnects the connection, as the command may have been
    sent in part. Strings go as UTF-8, as with redis-py's default encoding (the buffer's
    clients all use it)."""
    if conn._sock is None:  # redis-py's Connection is untyped; _sock is None until connected
        conn.connect()
    conn.check_health()  # redis-py's periodic PING (health_check_interval), as its sends do
    sock = conn._sock
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg under TLS: one joined write
        sock.sendall(b"".join(buffers))
        return
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV_MAX])
        if sent <= 0:
            raise ConnectionError("the socket accepted no bytes")
        while sent:
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
