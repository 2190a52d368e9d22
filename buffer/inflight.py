"""Commands sent now and read later, so the caller works while the server answers.

    call = InFlight.send(lane, [("EVAL", ...), ("XREADGROUP", ...)])  # lane: a Pinned
    ... decode what the last reply brought ...
    replies = call.replies()   # one per command (an error reply as its exception), or None

The producer sends each push's transaction with it, and the replay buffer's `take` uses it
to read the next batch while it decodes this one: on a small machine the round trip and the
server's work are then hidden behind the decode instead of added to it (bench/buffer.py). A
connection that fails, on sending or on reading, is not retried here: `replies()` returns
None and the caller recovers (what it sent must be safe to redo or to find again; see
ReplayBuffer.take).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from staleflow.buffer import resp
from staleflow.buffer.connection import Pinned

__all__ = ["LOST_REPLIES", "InFlight", "after_lost_reply"]

_LOST = (redis.ConnectionError, redis.TimeoutError, OSError)
LOST_REPLIES = 5  # a call whose connection drops this often in a row fails


def after_lost_reply(lost: int, client: redis.Redis, what: str) -> int:
    """One more attempt of `what` (a push, an ack: safe to send again) lost its connection
    before its replies: past LOST_REPLIES in a row, raise (the server answers pings but drops
    this call); otherwise wait for the server with the client's retries, or raise. Returns
    the count of attempts lost in a row."""
    lost += 1
    if lost > LOST_REPLIES:
        raise redis.ConnectionError(
            f"the connection dropped during each of {lost} attempts of {what}"
        )
    client.ping()
    return lost


class InFlight:
    """Commands written on a connection of a `Pinned` lane whose replies are not read yet."""

    def __init__(self, lane: Pinned, conn: Any, commands: Sequence[tuple[Any, ...]]) -> None:
        self._lane, self._conn, self.commands = lane, conn, commands

    @classmethod
    def send(cls, lane: Pinned, commands: Sequence[tuple[Any, ...]]) -> InFlight:
        """Write `commands` in one system call (resp.send) on a connection of `lane` (held
        until `replies`)."""
        packed = resp.pack(commands)  # a bad argument raises here, with nothing sent
        try:
            conn = lane.acquire()
        except _LOST:
            return cls(lane, None, commands)
        try:
            resp.send(conn, packed)
        except _LOST:
            conn.disconnect()
            lane.release(conn)
            return cls(lane, None, commands)
        except BaseException:
            conn.disconnect()
            lane.release(conn)
            raise
        return cls(lane, conn, commands)

    def replies(self) -> list[Any] | None:
        """The replies, parsed as redis-py's own commands would return them; an error reply
        is returned as its exception (the others are still read, so the connection stays
        in step). None if the connection failed: then nothing is known of what ran."""
        conn, self._conn = self._conn, None
        if conn is None:
            return None
        out: list[Any] = []
        parse: Any = self._lane.client.parse_response  # untyped in redis-py
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
            self._lane.release(conn)
        return out
