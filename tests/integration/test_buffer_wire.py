"""The buffer's own writes (buffer.resp, InFlight) against a real redis-server: large groups
sent from their own memory, pushes of more than 1024 buffers, TLS, and the ack's recovery
from a lost reply or a server without its scripts."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
import redis

from staleflow.buffer.connection import BufferConnectionError
from staleflow.buffer.inflight import InFlight
from staleflow.buffer.records import synthetic_groups
from staleflow.buffer.replay import ReplayBuffer
from staleflow.buffer.server import find_redis_server, free_port

pytestmark = pytest.mark.integration


def test_large_groups_arrive_bit_for_bit(redis_url):
    # 2048-token responses: every array is far above the 4 KB cutoff, so each is written
    # from the group's own memory (not copied into the command)
    groups = synthetic_groups(5, k=4, tokens=2048, prompt_tokens=1500, seed=3)
    buffer = ReplayBuffer(redis_url, "run")
    assert buffer.push_many(groups[:3]) == [True] * 3
    assert [buffer.push(g) for g in groups[3:]] == [True, True]
    taken = buffer.take(5, learner_version=3)
    assert taken.groups == groups  # Group.__eq__ compares every array exactly
    assert buffer.ack(taken.receipts) == 5


def test_a_push_of_more_than_1024_buffers_arrives_whole(redis_url):
    # 400 groups of 2 arrays above the cutoff each: ~1,600 buffers, more than one sendmsg
    groups = synthetic_groups(400, k=2, tokens=1100, seed=4)
    buffer = ReplayBuffer(redis_url, "run", capacity=400)
    assert buffer.push_many(groups) == [True] * 400
    taken = buffer.take(400, learner_version=3)
    assert taken.groups == groups
    stats = buffer.stats()
    assert (stats.pushed, stats.length) == (400, 400)


def test_an_ack_is_one_evalsha_and_after_the_server_lost_its_scripts_runs_once(redis_url):
    client = redis.Redis.from_url(redis_url)
    with ReplayBuffer(redis_url, "run", read_ahead=False) as buffer:
        buffer.push_many(synthetic_groups(6, k=2, tokens=8))
        assert buffer.ack(buffer.take(2, learner_version=3).receipts) == 2  # loads the script
        client.config_resetstat()
        assert buffer.ack(buffer.take(2, learner_version=3).receipts) == 2
        stats = client.info("commandstats")
        # one EVALSHA that ran, no EVAL: the fast path, not a NOSCRIPT and a resend
        assert stats["cmdstat_evalsha"]["calls"] == 1
        assert stats["cmdstat_evalsha"]["failed_calls"] == 0
        assert "cmdstat_eval" not in stats
        client.script_flush()  # as a restarted server would have it
        client.config_resetstat()
        assert buffer.ack(buffer.take(2, learner_version=3).receipts) == 2
        stats = client.info("commandstats")
        # NOSCRIPT (a failed EVALSHA, nothing ran), then the body once
        assert stats["cmdstat_evalsha"]["failed_calls"] == 1
        assert stats["cmdstat_eval"]["calls"] == 1
        counts = buffer.stats()
        assert (counts.acked, counts.length, counts.pending) == (6, 0, 0)
    client.close()


def _lose_replies(monkeypatch, times: int) -> list:
    """The next `times` InFlight calls run on the server, then their connection drops
    before the replies are read (what they were is recorded)."""
    real, lost = InFlight.replies, []

    def lost_reply(self):
        replies = real(self)
        if len(lost) < times:
            lost.append(replies)
            return None
        return replies

    monkeypatch.setattr(InFlight, "replies", lost_reply)
    return lost


def test_push_and_ack_statuses_expire_after_the_same_time(redis_url):
    # A push's statuses and an ack's count are kept STATUS_TTL_S for a resend, then expire:
    # one constant for both scripts (the ack's used to be a literal of its own).
    from staleflow.buffer.scripts import STATUS_TTL_S

    with ReplayBuffer(redis_url, "run", read_ahead=False) as buffer:
        groups = synthetic_groups(2, k=2, tokens=8)
        buffer.push_many(groups)
        assert buffer.push(groups[0]) is False  # a push with a duplicate keeps its statuses
        buffer.ack(buffer.take(2, learner_version=0).receipts)
        ttls = {}
        for kind in ("push", "ack"):
            (key,) = buffer.client.keys(buffer.keys.prefix + kind + ":*")
            ttls[kind] = buffer.client.ttl(key)
        # TTL rounds down to whole seconds, and a loaded machine may stall between the two;
        # the ack's literal was 600, STATUS_TTL_S is 600: halving either fails this
        assert all(STATUS_TTL_S - 30 <= t <= STATUS_TTL_S for t in ttls.values()), ttls


def test_an_ack_whose_reply_was_lost_is_sent_again_and_applied_once(redis_url, monkeypatch):
    with ReplayBuffer(redis_url, "run", read_ahead=False) as buffer:
        buffer.push_many(synthetic_groups(3, k=2, tokens=8))
        taken = buffer.take(3, learner_version=3)
        lost = _lose_replies(monkeypatch, 1)
        # sent again, it returns what it did the first time (its status key), not 0
        assert buffer.ack(taken.receipts) == 3
        assert lost == [[3]]
        stats = buffer.stats()
        assert (stats.acked, stats.length, stats.pending) == (3, 0, 0)  # counted once


def test_a_resent_ack_does_not_release_a_replay_taken_meanwhile(redis_url, monkeypatch):
    # replay sampling, max_reuse 3: the ack of a replay makes the group replayable again,
    # and a take hands it out again before the resent ack arrives. Before acks kept a
    # status, the resend found that hand-out pending, released it and counted a third
    # training (deleting the group while it was out).
    with ReplayBuffer(redis_url, "run", sampling="replay", max_reuse=3,
                      read_ahead=False) as buffer:  # fmt: skip
        buffer.push(synthetic_groups(1, k=2, tokens=8)[0])
        assert buffer.ack(buffer.take(1, learner_version=3).receipts) == 1  # training 1
        second = buffer.take(1, learner_version=3)
        assert [r.replay for r in second.receipts] == [True]
        lost = _lose_replies(monkeypatch, 1)
        real_ping, third = buffer._consumer.client.ping, []

        def take_then_ping():  # what another take could do between the drop and the resend
            monkeypatch.undo()  # (replies as usual from here on)
            third.append(buffer.take(1, learner_version=3))
            return real_ping()

        monkeypatch.setattr(buffer._consumer.client, "ping", take_then_ping)
        assert buffer.ack(second.receipts) == 1  # training 2, its reply lost, then resent
        assert lost == [[1]]
        assert [r.replay for r in third[0].receipts] == [True]  # handed out a third time
        stats = buffer.stats()
        # two trainings acked; the third hand-out is still out, and the group is kept
        assert (stats.acked, stats.pending, stats.length) == (2, 1, 1)
        assert buffer.ack(third[0].receipts) == 1  # training 3 = max_reuse: now it goes
        stats = buffer.stats()
        assert (stats.acked, stats.pending, stats.length) == (3, 0, 0)


def test_an_ack_whose_connection_always_drops_fails(redis_url, monkeypatch):
    with ReplayBuffer(redis_url, "run", read_ahead=False) as buffer:
        buffer.push_many(synthetic_groups(2, k=2, tokens=8))
        taken = buffer.take(2, learner_version=3)
        calls = []

        def dropped(self):  # as a connection that drops before every reply
            conn, self._conn = self._conn, None
            conn.disconnect()
            self._lane.release(conn)
            calls.append(1)

        monkeypatch.setattr(InFlight, "replies", dropped)
        with pytest.raises(BufferConnectionError, match="each of 6 attempts of an ack of 2 groups"):
            buffer.ack(taken.receipts)
        assert len(calls) == 6


# ----------------------------------------------------------------------------- TLS


@pytest.fixture
def tls_url(tmp_path: Path):
    """A redis-server of this test's own that speaks only TLS, with a self-signed
    certificate; the URL trusts that certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost", "-addext",
         "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port("127.0.0.1")
    server = subprocess.Popen(
        [find_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
         str(cert), "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        context = ssl.create_default_context(cafile=str(cert))
        deadline = time.monotonic() + 15
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as raw:
                    context.wrap_socket(raw, server_hostname="127.0.0.1").close()
                break
            except OSError as exc:
                if server.poll() is not None:
                    output = server.stdout.read().decode() if server.stdout else ""
                    low = output.lower()  # a build without TLS refuses its directives
                    if "tls" in low and ("bad directive" in low or "not supported" in low):
                        pytest.skip(f"this redis-server has no TLS: {output[-300:]}")
                    raise AssertionError(f"redis-server with TLS did not start: {output}") from exc
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    finally:
        server.terminate()
        server.wait(10)


def test_push_take_and_ack_over_tls(tls_url):
    # A TLS socket has no sendmsg: the buffer joins the parts and writes them once
    groups = synthetic_groups(6, k=4, tokens=2048, seed=5)
    buffer = ReplayBuffer(tls_url, "run")
    assert buffer.push_many(groups[:4]) == [True] * 4
    assert [buffer.push(g) for g in groups[4:]] == [True, True]
    assert buffer.push(groups[0]) is False  # still idempotent
    assert isinstance(buffer._producer._lane._conn._sock, ssl.SSLSocket)  # the path under test
    first = buffer.take(3, learner_version=3)
    second = buffer.take(3, learner_version=3, ack=first.receipts)
    assert first.groups + second.groups == groups
    assert buffer.ack(second.receipts) == 3
    stats = buffer.stats()
    assert (stats.pushed, stats.acked, stats.length) == (6, 6, 0)


def test_push_take_and_ack_over_a_unix_socket(tmp_path: Path):
    # unix:// URLs are accepted: the same one-sendmsg writes on an AF_UNIX socket
    path = tmp_path / "redis.sock"
    server = subprocess.Popen(
        [find_redis_server(), "--port", "0", "--unixsocket", str(path), "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 15
        while not path.exists():
            assert server.poll() is None, "redis-server did not start"
            assert time.monotonic() < deadline, "redis-server made no socket in 15 s"
            time.sleep(0.05)
        groups = synthetic_groups(4, k=4, tokens=2048, seed=6)
        buffer = ReplayBuffer(f"unix://{path}", "run")
        assert buffer.push_many(groups[:3]) == [True] * 3
        assert buffer.push(groups[3]) is True
        assert buffer._producer._lane._conn._sock.family == socket.AF_UNIX
        taken = buffer.take(4, learner_version=3)
        assert taken.groups == groups
        assert buffer.ack(taken.receipts) == 4
        assert buffer.stats().length == 0
    finally:
        server.terminate()
        server.wait(10)
