"""Commands sent now and read later, so the caller works while the server answers.

    call = InFlight.send(client, [("EVAL", ...), ("XREADGROUP", ...)])
    ... decode what the last reply brought ...
    replies = call.replies()   # one per command (an error reply as its exception), or None

The replay buffer's `take` uses it to read the next batch while it decodes this one: on a
small machine the round trip and the server's work are then hidden behind the decode instead
of added to it (bench/buffer.py). A connection that fails, on sending or on reading, is not
retried here: `replies()` returns None and the caller recovers (what it sent must be safe to
redo or to find again; see ReplayBuffer.take).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

__all__ = ["InFlight"]

_LOST = (redis.ConnectionError, redis.TimeoutError, OSError)


class InFlight:
    """Commands written on a pooled connection whose replies are not read yet."""

    def __init__(self, client: redis.Redis, conn: Any, commands: Sequence[tuple[Any, ...]]):
        self._client, self._conn, self.commands = client, conn, commands

    @classmethod
    def send(cls, client: redis.Redis, commands: Sequence[tuple[Any, ...]]) -> InFlight:
        """Write `commands` in one packed send on a connection taken from the client's pool
        (held until `replies`)."""
        pool = client.connection_pool
        try:
            conn: Any = pool.get_connection()  # redis-py leaves Connection methods untyped
        except _LOST:
            return cls(client, None, commands)
        try:
            conn.send_packed_command(conn.pack_commands(commands))
        except _LOST:
            conn.disconnect()
            pool.release(conn)
            return cls(client, None, commands)
        except BaseException:
            conn.disconnect()
            pool.release(conn)
            raise
        return cls(client, conn, commands)

    def replies(self) -> list[Any] | None:
        """The replies, parsed as redis-py's own commands would return them; an error reply
        is returned as its exception (the others are still read, so the connection stays
        in step). None if the connection failed: then nothing is known of what ran."""
        conn, self._conn = self._conn, None
        if conn is None:
            return None
        out: list[Any] = []
        parse: Any = self._client.parse_response  # untyped in redis-py
        try:
            for name, *_ in self.commands:
                try:
                    out.append(parse(conn, name))
                except redis.ResponseError as exc:
                    out.append(exc)
        except _LOST:
            conn.disconnect()
            return None
        except BaseException:  # replies left unread: the connection cannot be reused as is
            conn.disconnect()
            raise
        finally:
            self._client.connection_pool.release(conn)
        return out
