"""Start-time checks for multi-node runs that need no cluster: the shared-directory marker,
the network interface gloo is pinned to, and the error a failed remote constructor shows."""

from __future__ import annotations

import pytest

from staleflow.cluster.storage import MARK, SharedDir, SharedStorageError


def test_a_marked_directory_passes_its_check(tmp_path):
    shared = SharedDir.mark(tmp_path / "run", "the run directory", "10.0.0.1")
    assert (tmp_path / "run" / MARK).read_text() == shared.token
    shared.check("learner rank 1 on 10.0.0.2")  # same storage: no error


def test_a_directory_the_actor_does_not_see_names_who_where_and_the_fix(tmp_path):
    shared = SharedDir.mark(tmp_path / "run", "the run directory", "10.0.0.1")
    (tmp_path / "run" / MARK).unlink()  # as on a node where the path is another, empty disk
    with pytest.raises(SharedStorageError) as caught:
        shared.check("learner rank 1 on 10.0.0.2", wait_s=0)
    message = str(caught.value)
    assert message.startswith("learner rank 1 on 10.0.0.2 does not see the run directory ")
    assert str(tmp_path / "run") in message
    assert "driver on 10.0.0.1" in message
    assert "is missing there" in message
    assert "run.output_dir" in message  # the fix


def test_a_directory_that_cannot_be_read_says_why(tmp_path):
    shared = SharedDir.mark(tmp_path / "run", "the run directory", "10.0.0.1")
    (tmp_path / "run" / MARK).unlink()
    (tmp_path / "run" / MARK).mkdir()  # reading it fails, and not for being absent
    with pytest.raises(SharedStorageError, match="cannot be read there: IsADirectoryError"):
        shared.check("learner rank 0 on 10.0.0.2", wait_s=0)


def test_another_runs_marker_is_not_taken_for_ours(tmp_path):
    ours = SharedDir.mark(tmp_path, "the run directory", "10.0.0.1")
    SharedDir.mark(tmp_path, "the run directory", "10.0.0.1")  # a later start overwrote it
    with pytest.raises(SharedStorageError, match="holds another run's token"):
        ours.check("rollout worker 0 on 10.0.0.3", wait_s=0)


def test_gloo_is_pinned_to_the_interface_holding_the_node_address(monkeypatch):
    from staleflow.learner.sync_group import gloo_on_node_interface, interface_of

    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("198.51.100.77") is None  # TEST-NET-2: held by no interface here
    # set, then unset, so that monkeypatch restores the variable's absence afterwards (a
    # plain delenv of an unset variable records nothing, and "lo" would leak to later tests)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "placeholder")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert gloo_on_node_interface("127.0.0.1") == "lo"
    import os

    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice is kept
    assert gloo_on_node_interface("127.0.0.1") == "eth7"


def test_a_remote_constructors_error_is_shown_as_its_last_line():
    import ray

    from staleflow.cluster.placement import _last_error

    text = (
        "The actor died because of an error raised in its creation task, "
        "ray::LearnerRank.__init__() (pid=1, ip=10.0.0.2)\n"
        '  File "placement.py", line 280, in __init__\n'
        "staleflow.cluster.storage.SharedStorageError: learner rank 1 on 10.0.0.2 does not "
        "see the run directory /runs/a: set run.output_dir."
    )
    error = ray.exceptions.RayActorError(None, text, True)
    assert _last_error(error) == (
        "SharedStorageError: learner rank 1 on 10.0.0.2 does not see the run directory "
        "/runs/a: set run.output_dir."
    )


def test_a_redis_url_only_this_machine_reaches_is_recognised():
    from staleflow.cluster.services import _machine_local

    assert _machine_local("redis://:pw@127.0.0.1:6390") == "127.0.0.1, a loopback address"
    assert _machine_local("rediss://u:p@127.0.0.2/0") == "127.0.0.2, a loopback address"
    assert _machine_local("redis://[::1]:6390") == "::1, a loopback address"
    assert _machine_local("redis://localhost:6390") == (
        "localhost, which resolves to a loopback address here"
    )
    assert _machine_local("unix:///run/redis.sock") == "a unix socket (/run/redis.sock)"
    assert _machine_local("redis://:pw@10.0.0.1:6379") is None  # other nodes may reach it
    assert _machine_local("redis://name.invalid:6379") is None  # each node resolves it


def test_free_port_avoids_the_ephemeral_range_outgoing_connections_draw_from():
    # a port handed out now and bound a moment later must not be one the kernel may give to
    # an outgoing connection in between (EADDRINUSE at the learners' rendezvous, twice)
    import socket

    from staleflow.buffer.ports import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = [free_port("127.0.0.1") for _ in range(20)]
    assert all(20000 <= p < low for p in ports), (low, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # and it is free
