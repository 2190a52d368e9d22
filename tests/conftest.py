"""Shared fixtures: a real redis-server for the whole session, flushed before each test."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from staleflow.buffer.server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    from staleflow.buffer.server import RedisServerError, find_redis_server

    try:  # (valkey-server too, as the embedded server and `make redis` take it)
        find_redis_server()
    except RedisServerError:
        pytest.fail(
            "redis-server is not installed: run `apt-get install redis-server` (.ci/run does)"
        )
    with RedisServer(tmp_path_factory.mktemp("redis"), persistence=False) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session's server, emptied for this test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own with AOF on (for crash and restart tests)."""
    with RedisServer(tmp_path / "redis", persistence=True) as server:
        yield server


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """A real local Ray on loopback for the whole session (started on first use)."""
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from staleflow.cluster.placement import NO_PRESTART

    ray.init(
        address="local",  # never a cluster `ray start` left on this machine
        num_cpus=8,  # logical: two workers and a learner fit, the OS shares the 2 cores
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
        _system_config=NO_PRESTART,  # idle workers no actor here could use, as in a run
    )
    yield
    ray.shutdown()


@pytest.fixture
def ray_actors(ray_local: None) -> Iterator[Callable[..., object]]:
    """Kills the actors a test hands it when the test ends, passed or failed: one left by a
    failed assertion would hold the session Ray's resources (and its ports, its Redis
    clients) in the tests after it. `actor = ray_actors(Cls.remote(...))`; several at once
    come back as a tuple."""
    import ray

    handles: list[object] = []

    def keep(*started: object) -> object:
        handles.extend(started)
        return started[0] if len(started) == 1 else started

    yield keep
    for handle in handles:
        with contextlib.suppress(Exception):  # killed by the test already, or Ray is gone
            ray.kill(handle)
