"""The embedded redis-server: started private, found through the run directory, always stopped."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from staleflow.buffer.server import RedisServer, RedisServerError, read_server_url

pytestmark = pytest.mark.integration


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is gone for our purposes
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def wait_dead(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_private_server_lifecycle(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        pid = server.process.pid
        assert server.url.startswith("redis://:")
        assert "@127.0.0.1:" in server.url
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):  # a password is required
            redis.Redis(host="127.0.0.1", port=server.port, retry=None).ping()
        record = tmp_path / "redis" / "server.json"
        assert stat.S_IMODE(record.stat().st_mode) == 0o600  # it holds the password
        assert read_server_url(tmp_path / "redis") == server.url
    assert wait_dead(pid)
    assert not record.exists()


def test_a_server_starts_in_a_directory_whose_path_has_spaces_and_quotes(tmp_path):
    # redis.conf held `dir /home/x/My Project/...` unquoted: redis-server refused the line
    # (wrong number of arguments), so every run under such a path failed to start
    data = tmp_path / 'My "runs" dir' / "redis"
    with RedisServer(data, persistence=True) as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("dir")["dir"] == str(data)
        client.close()
    assert (data / "redis.log").is_file()


def test_a_server_for_other_nodes_listens_on_the_given_address_too(tmp_path):
    from ray.util import get_node_ip_address

    address = get_node_ip_address()  # the address Ray would give this node
    if address.startswith("127."):
        pytest.skip("this machine has no address besides loopback")
    with RedisServer(tmp_path / "redis", host=address) as server:
        assert f"@{address}:{server.port}/" in server.url  # what workers on other nodes get
        assert redis.Redis.from_url(server.url).ping()
        assert redis.Redis(host="127.0.0.1", port=server.port, password=server.password).ping()
        with pytest.raises(redis.AuthenticationError):  # still password-protected
            redis.Redis(host=address, port=server.port, retry=None).ping()


def test_stopped_when_the_block_raises(tmp_path):
    server = RedisServer(tmp_path).start()
    pid = server.process.pid

    def fail_inside() -> None:
        with server:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert wait_dead(pid)


_CHILD = """
import faulthandler, signal, sys, time
from staleflow.buffer.server import RedisServer
faulthandler.register(signal.SIGUSR1)  # the test asks for a stack if it hangs
# Stand in for a program at a terminal: a CI runner that starts jobs in the background hands
# them SIGINT ignored, and Python then installs no KeyboardInterrupt handler at all.
signal.signal(signal.SIGINT, signal.default_int_handler)
with RedisServer(sys.argv[1]) as server:
    print(server.process.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_stopped_on_ctrl_c_and_when_the_owner_dies(tmp_path, sig):
    owner = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid = int(owner.stdout.readline())
    assert alive(pid)
    # Ctrl-C unwinds the with-block; SIGTERM (no handler here) and SIGKILL kill the owner at
    # once and leave the server to the kernel's parent-death signal
    owner.send_signal(sig)
    try:
        owner.wait(timeout=60)
    except subprocess.TimeoutExpired:  # say where the owner was stuck
        owner.send_signal(signal.SIGUSR1)
        time.sleep(1)
        owner.kill()
        _, err = owner.communicate()
        pytest.fail(f"the owner did not exit within 60 s of {sig.name}; its stack:\n{err}")
    assert wait_dead(pid), f"redis-server {pid} outlived its owner after {sig.name}"


def test_signals_for_the_owners_process_tree_leave_the_server_to_its_owner(tmp_path):
    # `ray job stop` (and a RayJob's deletion) SIGTERMs the driver and every descendant at
    # once, and a terminal's Ctrl-C SIGINTs its foreground group. The server used to exit on
    # SIGTERM while the driver's clean stop still had to ack the last step's groups in it.
    with RedisServer(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        client.set("kept", "1")
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(server.process.pid, sig)
        time.sleep(0.5)  # a server that obeyed them is gone by now (it exits in milliseconds)
        assert server.process.poll() is None, "redis-server obeyed a signal meant for its owner"
        assert client.get("kept") == b"1"
        pid = server.process.pid
        client.close()
    assert wait_dead(pid)  # its owner still stops it


def test_missing_binary_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisServerError, match="apt-get install redis-server"):
        RedisServer(tmp_path)


def test_server_that_cannot_start_reports_why(tmp_path, redis_server):
    taken_port = redis_server.port  # already in use by the session's server
    with pytest.raises(RedisServerError, match=f"port {taken_port}"):
        RedisServer(tmp_path, port=taken_port, start_timeout_s=5).start()


def test_read_server_url_without_a_server(tmp_path):
    with pytest.raises(RedisServerError, match="no embedded Redis server recorded"):
        read_server_url(tmp_path)
    (tmp_path / "server.json").write_text(json.dumps({"nope": 1}))
    with pytest.raises(RedisServerError, match="not a server record"):
        read_server_url(tmp_path)
    (tmp_path / "server.json").write_text("[]")  # not a map: was a TypeError traceback
    with pytest.raises(RedisServerError, match="not a server record"):
        read_server_url(tmp_path)


def test_a_server_record_of_another_user_says_whose_it_is(tmp_path, monkeypatch):
    # server.json is written 0600 (it holds the password): another user's `buffer stats
    # --run-dir` got a PermissionError traceback. The tests run as root, whom file modes do
    # not stop, so the refusal is injected.
    (tmp_path / "server.json").write_text(json.dumps({"url": "redis://:pw@127.0.0.1:1/0"}))
    real = Path.read_text

    def refused(self, *args, **kwargs):
        if self.name == "server.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refused)
    with pytest.raises(RedisServerError, match="readable only by the user who started the run"):
        read_server_url(tmp_path)


def test_sync_log_writes_its_marker_under_appendfsync_always_then_restores_everysec(
    tmp_path, monkeypatch
):
    # A checkpoint calls sync_log before LATEST: with appendfsync everysec the last second of
    # pushes it counts could be lost with the machine. Redis replies to a write made under
    # `always` only after fsyncing the append-only file, which holds every earlier write
    # (strace on redis-server 7.0.15: an fdatasync before the reply). Here: the policy seen
    # by another client while the marker is written, the policy after, and the marker in the
    # log a restart replays.
    with RedisServer(tmp_path / "redis", persistence=True) as server:
        probe = redis.Redis.from_url(server.url)
        seen: list[str] = []
        real_set = redis.Redis.set

        def set_and_look(self, name, value, *args, **kwargs):
            seen.append(probe.config_get("appendfsync")["appendfsync"])
            return real_set(self, name, value, *args, **kwargs)

        monkeypatch.setattr(redis.Redis, "set", set_and_look)
        assert server.sync_log("staleflow:r:checkpointed") is True
        monkeypatch.setattr(redis.Redis, "set", real_set)
        assert seen == ["always"]
        assert probe.config_get("appendfsync")["appendfsync"] == "everysec"
        probe.close()
        server.kill()  # as a crash: the restart replays the append-only file
        server.start()
        assert redis.Redis.from_url(server.url).exists("staleflow:r:checkpointed") == 1
    with RedisServer(tmp_path / "plain") as server:  # no persistence: no log, nothing done
        assert server.sync_log("staleflow:r:checkpointed") is False
        assert redis.Redis.from_url(server.url).exists("staleflow:r:checkpointed") == 0
