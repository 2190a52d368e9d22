"""The buffer's connection errors: what each says (failures injected, no server needed)."""

from __future__ import annotations

import pytest


def test_a_tls_url_that_times_out_suggests_redis_without_tls():
    # rediss:// to a server without TLS waits for a handshake that never comes and times
    # out (injected here: the real wait is minutes of retries)
    import redis

    from staleflow.buffer.connection import BufferConnectionError, translate_errors

    class Side:
        def __init__(self, url: str) -> None:
            self.url_for_display = url

        @translate_errors
        def call(self) -> None:
            raise redis.TimeoutError("Timeout connecting to server")

    with pytest.raises(BufferConnectionError, match=r"if the server has no TLS, use redis://"):
        Side("rediss://:***@127.0.0.1:6379/0").call()
    with pytest.raises(BufferConnectionError) as plain:
        Side("redis://:***@127.0.0.1:6379/0").call()
    assert "TLS" not in str(plain.value)


def test_only_a_server_answering_in_the_redis_protocol_counts_as_plain_redis():
    # the probe behind "has no TLS" (a real Redis answering it: tests/integration/test_buffer)
    import socket

    from staleflow.buffer.connection import answers_plain_redis
    from staleflow.buffer.ports import free_port

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        assert not answers_plain_redis("127.0.0.1", silent.getsockname()[1], timeout_s=0.5)
    assert not answers_plain_redis("127.0.0.1", free_port("127.0.0.1"))  # nothing listens
