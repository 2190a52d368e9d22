"""Multi-node runs where every node has its own network address, as on a real cluster.

`ray.cluster_utils.Cluster` puts every node on 127.0.0.1, where a rendezvous or a server bound
to loopback still works by accident. Here each node is a Linux network namespace with its own
address on a bridge (10.231.0.1-3, plus 10.232.0.1 on the head only, reachable from nowhere
else), and its own `ray start`: a process that tells a peer "connect to 127.0.0.1" fails here
as it would between machines. The third node also has a private mount over one directory,
standing in for a disk the other nodes do not share.

Needs root (ip netns, mount); skipped cleanly without it. The namespaces, their processes and
the mount go away with the fixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from staleflow.cluster.rundir import RunDir
from tests.integration.procs import clean_env
from tests.integration.test_system import assert_reconciled, assert_secret_in_no_file
from tests.integration.tiny import ONE_WORKER, TINY

# one xdist worker runs the whole module: its namespaces are a module fixture (made once)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("netns")]

SUBNET = "10.231.0"
UNROUTED = "10.232.0.1"  # on the head node only: no other node has a route to it
RAY = str(Path(sys.executable).with_name("ray"))


def _can_make_namespaces() -> str | None:
    """Why the tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns add, mount)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2 / util-linux)"
    # Everything Nodes.up needs, tried once in a throwaway namespace: a container can allow
    # `ip netns add` and still refuse a bridge, a veth pair or a mount namespace.
    probe = f"sfprobe{os.getpid()}"
    steps = [
        ["ip", "netns", "add", probe],
        ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb"],
        ["ip", "-n", probe, "link", "set", "va", "master", "br0", "up"],
        ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "none",
         tempfile.gettempdir()],
    ]  # fmt: skip
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                return f"{' '.join(step[:4])} failed here: {done.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _node_env(**extra: str) -> dict[str, str]:
    """This process's environment for a node's processes, less what an earlier in-process
    test left behind that a real node would not have: the learner pins gloo to the interface
    of its process's node (GLOO_SOCKET_IFNAME=lo here), which on another node is wrong."""
    return clean_env(**extra)


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class Nodes:
    """Three namespaces on one bridge, each running a Ray node; node 0 is the head."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.prefix = f"sf{os.getpid() % 100000}n"
        self.switch = f"{self.prefix}sw"
        self.names = [f"{self.prefix}{i}" for i in range(3)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(3)]
        self.private = base / "private"  # a tmpfs of its own on node 2
        self.shared = base / "shared"

    @property
    def head(self) -> str:
        return f"{self.addresses[0]}:6379"

    def up(self) -> None:
        self.private.mkdir(parents=True)
        self.shared.mkdir()
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", f"p{i}", "netns", self.switch, "type", "veth",
                "peer", "name", "eth0", "netns", ns)  # fmt: skip
            _sh("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", self.names[0], "addr", "add", f"{UNROUTED}/32", "dev", "lo")
        # node 0: the head (driver, embedded Redis); nodes 1 and 2 host the learner ranks and
        # the rollout workers (custom resources pin them); node 2 has a private directory
        self._ray(0, "--head", "--port", "6379", "--num-cpus", "2", "--include-dashboard",
                  "false", "--resources", '{"head": 1}')  # fmt: skip
        for i in (1, 2):
            labels = json.dumps({"learner": 1, "rollout": 1, f"node{i}": 1})
            self._ray(i, "--address", self.head, "--num-cpus", "2", "--resources", labels)

    def _ray(self, i: int, *args: str) -> None:
        command = [RAY, "start", "--node-ip-address", self.addresses[i], "--disable-usage-stats",
                   "--temp-dir", str(self.base / f"ray{i}"), *args]  # fmt: skip
        if i == 2:  # its own mount namespace, with a tmpfs over the private directory
            script = f'mount -t tmpfs tmpfs "{self.private}" && exec "$@"'
            command = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "-",
                       *command]  # fmt: skip
        env = _node_env(RAY_AUTH_MODE="disabled")
        done = subprocess.run(["ip", "netns", "exec", self.names[i], *command], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    def popen(self, i: int, *command: str, cwd: Path, env: dict[str, str] | None = None):
        """A process on node `i` (output merged into stdout, text)."""
        env = _node_env(RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1", **(env or {}))
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *command], cwd=cwd,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip

    def train(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
        """`staleflow train c.yaml ARGS --address HEAD` on the head node; (exit code, output)."""
        (cwd / "c.yaml").write_text(TINY)
        proc = self.popen(0, sys.executable, "-m", "staleflow.cluster.cli", "train", "c.yaml",
                          *args, "--address", self.head, cwd=cwd, env=env)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=500)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"staleflow train did not finish within 600 s:\n{out[-3000:]}")
        return proc.returncode, out

    def down(self) -> None:
        for ns in [*self.names, self.switch]:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.5)
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def nodes():
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    # short: Ray's socket paths under --temp-dir must fit in 107 characters
    base = Path(f"/tmp/sfns{os.getpid()}")
    shutil.rmtree(base, ignore_errors=True)
    cluster = Nodes(base)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


def _run_dir(nodes: Nodes, name: str) -> Path:
    work = nodes.shared / name
    work.mkdir()
    return work


def test_learner_ranks_and_workers_on_other_nodes_meet_at_real_addresses(nodes):
    """Driver and embedded Redis on node 0, the two learner ranks spread over nodes 1 and 2,
    a rollout worker on each of them: the ranks' rendezvous, gloo's own connections, the
    workers' pushes and the weight broadcast all cross nodes."""
    work = _run_dir(nodes, "spread")
    code, out = nodes.train(
        "run.name=spread", "run.steps=4", "learner.num_ranks=2", "learner.placement=spread",
        'learner.resources={"learner": 1}', 'rollout.resources={"rollout": 1}',
        "sync.method=gloo", "sync.offset=0", cwd=work,
    )  # fmt: skip
    assert code == 0, out[-4000:]
    summary = json.loads((work / "runs/spread/summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["steps"] == 4
    assert_reconciled(summary)
    assert summary["groups"]["trained"] == 4 * 2  # G = 2 groups a step

    where = summary["placement"]
    address = where["node_addresses"]
    assert address[where["driver_node"]] == nodes.addresses[0]
    learner = [address[n] for n in where["learner_nodes"]]
    assert sorted(learner) == nodes.addresses[1:]  # one rank on each of nodes 1 and 2
    workers = [address[n] for n in where["worker_nodes"]]
    assert sorted(workers) == nodes.addresses[1:]
    # rank 0's node address, not a loopback one, is where the ranks met
    assert where["rendezvous"].rsplit(":", 1)[0] == learner[0]
    # the embedded Redis listened on the head's address, and workers elsewhere reached it
    assert where["redis"].rsplit(":", 1)[0] == nodes.addresses[0]
    # rank 0 (on another node) wrote the checkpoint and trajectories into the driver's run
    # directory, not into a path relative to its own working directory
    assert (RunDir(work / "runs/spread").latest_checkpoint() / "trainer.json").is_file()
    assert len((work / "runs/spread/trajectories/steps.jsonl").read_text().splitlines()) == 4


def _server(nodes: Nodes, executable: str, address: str, port: str, password: str):
    """A Redis-compatible server on node 0 listening on `address` only."""
    proc = nodes.popen(0, executable, "--bind", address, "--port", port, "--requirepass",
                       password, "--save", "", "--appendonly", "no", cwd=nodes.base)  # fmt: skip
    time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[0]
    return proc


@pytest.fixture
def unrouted_redis(nodes):
    """A redis-server on node 0 bound only to an address no other node can route to."""
    executable = shutil.which("redis-server")
    assert executable, "redis-server is not installed (make redis installs it)"
    password = "netns-test-secret"
    proc = _server(nodes, executable, UNROUTED, "6391", password)
    yield f"redis://:{password}@{UNROUTED}:6391", password
    proc.kill()
    proc.communicate()


def test_an_external_server_on_the_head_serves_a_cluster_joined_separately(nodes):
    """The order a user follows: `ray start` on every node, a Redis server on the head's
    address, then `staleflow train --address` with its URL (from the environment, so the
    password is on no command line): workers and the learner on other nodes use it. (A run
    on valkey-server, as an external server, is tests/integration/test_servers.py's.)"""
    server = "redis-server"
    executable = shutil.which(server) or ""
    assert executable, "redis-server is not installed (make redis installs it)"
    password = f"{server}-secret"
    proc = _server(nodes, executable, nodes.addresses[0], "6392", password)
    try:
        work = _run_dir(nodes, server)
        code, out = nodes.train(
            "run.name=external", "run.steps=3", 'learner.resources={"node1": 1}',
            'rollout.resources={"rollout": 1}', ONE_WORKER, cwd=work,
            env={"STALEFLOW_REDIS_URL": f"redis://:{password}@{nodes.addresses[0]}:6392"},
        )  # fmt: skip
    finally:
        proc.kill()
        proc.communicate()
    assert code == 0, out[-4000:]
    summary = json.loads((work / "runs/external/summary.json").read_text())
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    assert summary["placement"]["redis"] == f"{nodes.addresses[0]}:6392"
    assert password not in out
    assert_secret_in_no_file(work / "runs/external", password)


def test_a_worker_that_cannot_reach_redis_fails_at_start_naming_the_address(nodes, unrouted_redis):
    url, password = unrouted_redis
    work = _run_dir(nodes, "unreachable")
    code, out = nodes.train(
        "run.name=unreachable", "run.steps=4", 'learner.resources={"head": 1}',
        'rollout.resources={"rollout": 1}', ONE_WORKER, cwd=work,
        env={"STALEFLOW_REDIS_URL": url},
    )  # fmt: skip
    assert code == 2, out[-4000:]
    error = next(line for line in out.splitlines() if line.startswith("error: "))
    # the driver (node 0) reaches the server, so it gets as far as starting the workers
    assert "cannot reach the replay buffer" in error, error
    assert "rollout worker" in error
    assert f"on {SUBNET}." in error  # names the worker's node
    assert f"{UNROUTED}:" in error  # and the address it tried
    assert password not in out
    # at start: after the run's own limits (30 min) it would be the test's 600 s timeout
    summary = json.loads((work / "runs/unreachable/summary.json").read_text())
    assert summary["status"] == "failed"


def test_a_loopback_redis_url_is_refused_up_front_on_a_multi_node_cluster(nodes):
    work = _run_dir(nodes, "loopback")
    code, out = nodes.train(
        "run.name=loopback", "run.steps=2", cwd=work,
        env={"STALEFLOW_REDIS_URL": "redis://:pw@127.0.0.1:6390"},
    )  # fmt: skip
    assert code == 2, out[-4000:]
    error = next(line for line in out.splitlines() if line.startswith("error: "))
    assert "127.0.0.1, a loopback address" in error, error
    assert nodes.addresses[1] in error
    assert nodes.addresses[2] in error
    assert ":pw@" not in out  # the password is not echoed


def test_a_learner_that_does_not_see_the_run_directory_fails_at_start(nodes):
    """Rank 0 pinned to node 2, where the run directory's parent is a private tmpfs: its
    checkpoints would land on that node's own disk. The run refuses at start."""
    work = nodes.private / "run"
    work.mkdir()
    code, out = nodes.train(
        "run.name=private", "run.steps=2", 'learner.resources={"node2": 1}',
        'rollout.resources={"rollout": 1}', ONE_WORKER, cwd=work,
    )  # fmt: skip
    assert code == 2, out[-4000:]
    error = next(line for line in out.splitlines() if line.startswith("error: "))
    assert "SharedStorageError" in error, error
    assert f"learner rank 0 on {nodes.addresses[2]} does not see the run directory" in error
    assert str(work / "runs/private") in error
    assert "run.output_dir" in error  # the fix
    assert not (work / "runs/private/checkpoints/LATEST").exists()


def test_the_same_run_directory_shared_by_every_node_passes_the_check(nodes):
    """sync.method checkpoint: rank 0 on node 2 publishes into the run directory, which the
    workers on nodes 1 and 2 read; on the shared directory the run goes through."""
    work = _run_dir(nodes, "checkpoint")
    code, out = nodes.train(
        "run.name=ckpt", "run.steps=3", 'learner.resources={"node2": 1}',
        'rollout.resources={"rollout": 1}', "sync.method=checkpoint", "sync.offset=1",
        cwd=work,
    )  # fmt: skip
    assert code == 0, out[-4000:]
    summary = json.loads((work / "runs/ckpt/summary.json").read_text())
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    where = summary["placement"]
    assert where["node_addresses"][where["learner_nodes"][0]] == nodes.addresses[2]
    assert (work / "runs/ckpt/checkpoints/LATEST").is_file()  # written where the driver reads
