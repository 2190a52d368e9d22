"""Connecting to Redis by URL, with retries, and one clear error when it is gone."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from staleflow.configs.loader import redact_url
from staleflow.configs.schema import redis_url_problem

__all__ = ["BufferConnectionError", "Pinned", "connect", "translate_errors", "without_retries"]

P = ParamSpec("P")
R = TypeVar("R")


class BufferConnectionError(ConnectionError):
    """Redis could not be reached after retrying; the message names the URL (password masked)."""


class _RetryUnlessRefused(Retry):
    """Retry dropped connections with backoff, but never a refused password (redis-py's
    AuthenticationError is a ConnectionError, and retrying it only delays the error), nor a
    rediss:// handshake with a server that has no TLS. Such a server waits for the end of a
    command that the handshake's bytes never finish, so each attempt ran to the socket
    timeout and the retries (redis-py's connect retries nested in the command's) went on
    for minutes: after a timeout, `tls_target` (host, port, the URL to show) is probed once
    in plain text (once per connection: the nested retries see every timeout), and a server
    that answers in the Redis protocol ends it."""

    def __init__(
        self, *args: Any, tls_target: tuple[str, int, str] | None = None, give_up_s: float
    ) -> None:
        super().__init__(*args)
        self.tls_target = tls_target
        self.give_up_s = give_up_s
        self._probed = False
        self._deadline: float | None = None  # of the outermost call (each connection has its
        # own copy of this object, used by one thread at a time)

    def call_with_retry(
        self,
        do: Callable[[], R],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> R:
        def retryable(error: Exception) -> bool:
            if isinstance(error, redis.AuthenticationError) or _unknown_host(error):
                return False
            timeout = isinstance(error, redis.TimeoutError | socket.timeout)
            if self.tls_target and timeout and not self._probed:
                self._probed = True
                host, port, shown = self.tls_target
                if answers_plain_redis(host, port):
                    raise BufferConnectionError(
                        f"Redis at {shown} has no TLS: it answers plain-text Redis commands, "
                        "so the TLS handshake rediss:// starts never completes; use redis:// "
                        "(or enable TLS on the server)"
                    ) from error
            if self._deadline is not None and time.monotonic() >= self._deadline:
                return False  # the nested retries' time is spent: the error goes up now
            return is_retryable is None or is_retryable(error)

        # redis-py retries a connection inside each retry of the command that needs it, with
        # this same object: one deadline, set by the outermost call, bounds them all.
        outermost = self._deadline is None
        if outermost:
            self._deadline = time.monotonic() + self.give_up_s
        try:
            return super().call_with_retry(do, fail, retryable, with_failure_count)
        finally:
            if outermost:
                self._deadline = None


def _unknown_host(error: BaseException) -> bool:
    """A connection error whose cause is a host name that does not resolve (EAI_NONAME: no
    such name, not the transient EAI_AGAIN): retrying it only delays the error ~10 s."""
    cause = error.__cause__ or error.__context__
    return isinstance(cause, socket.gaierror) and cause.errno == socket.EAI_NONAME


def connect(
    url: str, *, retries: int = 8, socket_timeout_s: float = 30.0, give_up_s: float = 90.0
) -> redis.Redis:
    """A client for `url` (redis://, rediss:// with password, unix://) that retries dropped
    connections with exponential backoff before giving up: ~9 s of backoff for a server
    that refuses connections from the start. redis-py retries a connection inside each retry
    of the command that needs it, so a server lost mid-run (the embedded one restarting,
    reloading its AOF) is retried for up to about a minute, and a host that does not answer
    at all (a lost node: each attempt waits out a timeout) would take many minutes:
    `give_up_s` bounds each command's retries, nested ones included (the command in flight
    may first wait out its `socket_timeout_s`)."""
    problem = redis_url_problem(url)
    if problem:
        raise ValueError(f"Redis URL {redact_url(url)!r} {problem}")
    tls_target = None
    if url.startswith("rediss://"):
        parts = urlsplit(url)
        tls_target = (parts.hostname or "localhost", parts.port or 6379, redact_url(url))
    retry = _RetryUnlessRefused(
        ExponentialBackoff(cap=2.0, base=0.05), retries, tls_target=tls_target, give_up_s=give_up_s
    )
    tcp: dict[str, Any] = {} if url.startswith("unix://") else {"socket_keepalive": True}
    try:
        return redis.Redis.from_url(  # (a unix socket's connection takes no keepalive option)
            url,
            retry=retry,
            retry_on_error=[redis.ConnectionError, redis.TimeoutError, socket.timeout],
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=5.0,
            health_check_interval=30,
            **tcp,
        )
    except ValueError as exc:  # an option redis-py cannot read (?db=x, ?socket_timeout=y)
        raise ValueError(f"Redis URL {redact_url(url)!r}: {exc}") from None


def answers_plain_redis(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """True if the server at host:port answers a plain-text PING in the Redis protocol (a
    status or an error reply, e.g. +PONG or -NOAUTH); a TLS server answers with an alert or
    closes the connection."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(16)
    except OSError:
        return False
    return reply[:1] in (b"+", b"-")


def without_retries(client: redis.Redis) -> redis.Redis:
    """A client for the same server whose connections never retry a command by themselves."""
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0)}
    client = redis.Redis(connection_pool=redis.ConnectionPool(pool.connection_class, **kwargs))
    client.auto_close_connection_pool = True  # its own pool: close() closes its connections
    return client


class Pinned:
    """One connection of a client's pool kept for a hot path. Taking a connection from the
    pool and giving it back costs a lock and a poll of the socket for stray data: pushing
    one 66 KB group is 1.01-1.15x faster without (bench/buffer.py, pinned / pooled).
    One thread at a time gets the pinned connection; a caller that finds it busy gets a
    pooled one, so concurrent callers never wait on each other. Closing the pool closes it.

    The caller's contract is the pool's: read every reply it asked for, or disconnect the
    connection (it reconnects on its next send), before `release`."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._pool = client.connection_pool
        self._conn: Any = None
        self._lock = threading.Lock()

    def acquire(self) -> Any:
        """A connected connection (redis-py leaves Connection untyped); ConnectionError if
        none can be made."""
        if not self._lock.acquire(blocking=False):
            return self._pool.get_connection()
        try:  # once disconnected (after an error), it connects again on its next send
            if self._conn is None:
                self._conn = self._pool.get_connection()
        except BaseException:
            self._lock.release()
            raise
        return self._conn

    def release(self, conn: Any) -> None:
        if conn is self._conn:
            self._lock.release()
        else:
            self._pool.release(conn)


def translate_errors(method: Callable[P, R]) -> Callable[P, R]:
    """Turn redis-py's connection errors (after its retries) into one clear error."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        where = getattr(args[0], "url_for_display", "?")
        try:
            return method(*args, **kwargs)
        except redis.AuthenticationError as exc:
            if "required" in str(exc).lower():  # the URL has none
                raise BufferConnectionError(
                    f"Redis at {where} needs a password ({exc}); put it in the URL: "
                    "redis://:PASSWORD@host:port/0"
                ) from exc
            raise BufferConnectionError(
                f"Redis at {where} refused the password ({exc}); check the password in the URL"
            ) from exc
        except redis.exceptions.InvalidResponse as exc:
            raise BufferConnectionError(  # at first contact: most likely not a Redis server
                f"the server at {where} sent a reply that is not in the Redis protocol ({exc}); "
                "if it is not a Redis server, check the host and port in the URL"
            ) from exc
        except redis.ResponseError as exc:
            if "DB index is out of range" not in str(exc):
                raise
            raise BufferConnectionError(
                f"Redis at {where} has no such database ({exc}); use one it has, e.g. "
                "redis://...:port/0"
            ) from exc
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if _unknown_host(exc):
                raise BufferConnectionError(
                    f"Redis at {where}: its host name does not resolve ({exc}); check the host "
                    "in the URL"
                ) from exc
            tls = ""
            if where.startswith("rediss://") and "timeout" in str(exc).lower():
                tls = (
                    " (rediss:// waits for a TLS handshake: if the server has no TLS, use redis://)"
                )
            raise BufferConnectionError(
                f"Redis at {where} is unreachable after retrying ({exc}){tls}; "
                "start one or fix the URL; a run without buffer.redis_url (or its "
                "$STALEFLOW_REDIS_URL) starts an embedded server"
            ) from exc

    return wrapper
