"""A run on a multi-node Ray cluster simulated on this machine (ray.cluster_utils.Cluster:
separate raylets, one per node, each with its own resources): learner ranks placed by their
placement group and meeting on rank 0's node, workers on other nodes reaching the embedded
Redis on the driver node's address, and every group accounted for."""

from __future__ import annotations

import json
import os

import pytest

from staleflow.cluster.placement import NO_PRESTART
from tests.integration.test_system import (
    assert_reconciled,
    ctrl_c,
    interrupted_summary,
    staleflow,
)
from tests.integration.tiny import TINY

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# no idle workers prestarted, as in the Ray a local run starts (the GCS gives every node this)
HEAD = {"include_dashboard": False, "_system_config": NO_PRESTART}


@pytest.fixture
def two_nodes():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Each node fits one learner rank and one rollout worker (1 CPU each), so spreading the
    # two ranks puts one on each node and the workers follow wherever CPUs are left.
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 2, **HEAD},
    )
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def test_two_node_run_spreads_the_learner_and_reconciles(tmp_path, two_nodes):
    (tmp_path / "c.yaml").write_text(TINY)
    proc = staleflow(
        "train", "c.yaml", "run.name=multi", "run.steps=4", "learner.num_ranks=2",
        "learner.placement=spread", "sync.offset=1", "--address", two_nodes.address,
        cwd=tmp_path,
    )  # fmt: skip
    out, _ = proc.communicate(timeout=500)  # under pytest-timeout's 600 s, so its message shows
    assert proc.returncode == 0, out[-3000:]
    assert "(the driver's node): run directory" in out  # where to find the outputs

    summary = json.loads((tmp_path / "runs/multi/summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["steps"] == 4
    assert_reconciled(summary)
    assert summary["groups"]["pushed"] > 0

    where = summary["placement"]
    nodes = where["node_addresses"]
    assert len(nodes) == 2
    learner_nodes = where["learner_nodes"]
    assert len(set(learner_nodes)) == 2, where  # spread: one rank per node
    # rank 0 and the rendezvous are on the same node
    assert where["rendezvous"].rsplit(":", 1)[0] == nodes[learner_nodes[0]]
    # the workers reached Redis at the driver node's address, not only loopback
    assert where["redis"].rsplit(":", 1)[0] == nodes[where["driver_node"]]
    assert "@" not in where["redis"]  # no password in the file
    # rank 0 wrote the checkpoint into the driver's run directory (an actor's working
    # directory is not the driver's: relative paths once sent them elsewhere)
    from staleflow.cluster.rundir import RunDir

    assert (RunDir(tmp_path / "runs/multi").latest_checkpoint() / "trainer.json").is_file()


def _ipc_run(tmp_path, address: str, workers: int) -> tuple[int, str, dict]:
    """A 2-step tiny run with sync.method ipc on the cluster at `address`: (exit code, its
    output, its summary.json)."""
    (tmp_path / "c.yaml").write_text(TINY)
    proc = staleflow(
        "train", "c.yaml", "run.name=ipc", "run.steps=2", f"rollout.num_workers={workers}",
        "sync.method=ipc", "sync.offset=0", "--address", address, cwd=tmp_path,
    )  # fmt: skip
    out, _ = proc.communicate(timeout=500)
    return proc.returncode, out, json.loads((tmp_path / "runs/ipc/summary.json").read_text())


def test_ipc_that_cannot_share_one_node_is_refused_before_anything_starts(tmp_path, two_nodes):
    # 2 CPUs a node: learner rank 0 and two workers (1 CPU each) share one placement-group
    # bundle of 3 CPUs under ipc, which no node holds (a worker elsewhere could not open the
    # learner's shared memory)
    returncode, out, summary = _ipc_run(tmp_path, two_nodes.address, workers=2)
    assert returncode != 0, out[-3000:]
    assert "learner rank 0 with rollout workers 0-1 (3 CPU, 0 GPU) fits on no node" in out, out
    assert "sync.method: ipc keeps learner rank 0 and every rollout worker" in out
    assert summary["status"] == "failed"
    assert summary["steps"] == 0


def test_ipc_keeps_the_workers_on_learner_rank_0s_node(tmp_path):
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # The driver's node has 1 CPU, the other 3. Placed on their own, rank 0 and the worker
    # (1 CPU each) end up apart: whichever node the rank takes, Ray puts the worker on the
    # other (the driver's node first while it has room), and ipc refused the run. In one
    # bundle of 2 CPUs, both go to the 3-CPU node.
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 1, **HEAD},
    )
    try:
        cluster.add_node(num_cpus=3)
        cluster.wait_for_nodes()
        returncode, out, summary = _ipc_run(tmp_path, cluster.address, workers=1)
    finally:
        cluster.shutdown()
    assert returncode == 0, out[-3000:]
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    where = summary["placement"]
    assert len(where["node_addresses"]) == 2
    assert where["worker_nodes"] == where["learner_nodes"] != [where["driver_node"]], where


def _nodes_of_batches(run) -> list[tuple[int, str]]:
    from staleflow.cluster.rundir import read_metrics

    return [
        (r["step"], r["node"])
        for r in read_metrics(run / "metrics.jsonl")
        if r["kind"] == "rollout"
    ]


def test_workers_scale_onto_a_new_node_and_survive_losing_one(tmp_path):
    """The learner on the head node, rollout workers on two others (pinned with custom
    resources); mid-run a third worker node joins and the run scales onto it, then one of the
    first two is removed: its worker is replaced on the new node and the run goes on."""
    from ray.cluster_utils import Cluster

    from tests.integration.test_system import status_of, wait_for

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 2, "resources": {"learner": 1}, **HEAD},
    )
    try:
        first = cluster.add_node(num_cpus=2, resources={"rollout": 1})
        second = cluster.add_node(num_cpus=2, resources={"rollout": 1})
        cluster.wait_for_nodes()
        (tmp_path / "c.yaml").write_text(TINY)
        proc = staleflow(
            "train", "c.yaml", "run.name=moving", "run.steps=1000000", "sync.offset=1",
            'rollout.resources={"rollout": 1}', 'learner.resources={"learner": 1}',
            "learner.optimizer.lr=3.0e-3", "rollout.prompts_per_batch=6",
            "--address", cluster.address, cwd=tmp_path,
        )  # fmt: skip
        run = tmp_path / "runs/moving"
        try:
            wait_for(lambda: status_of(run).get("step", 0) >= 3, 300, "step 3")
            summary_nodes = {first.node_id, second.node_id}
            assert {n for _, n in _nodes_of_batches(run)} <= summary_nodes

            third = cluster.add_node(num_cpus=2, resources={"rollout": 2})
            cluster.wait_for_nodes()
            from staleflow.cluster.rundir import RunDir

            RunDir(run).request_workers(3)
            wait_for(
                lambda: third.node_id in {n for _, n in _nodes_of_batches(run)}, 300,
                "a batch generated on the new node",
            )  # fmt: skip

            cluster.remove_node(first)  # its worker dies with it
            lost_at = status_of(run)["step"]
            # 5 more steps, and 20 in all so the reward check below sees some learning
            until = max(lost_at + 5, 20)
            wait_for(lambda: status_of(run).get("step", 0) >= until, 300, f"step {until}")
        finally:
            out = ctrl_c(proc)
        summary = interrupted_summary(run, out)
        assert [f["what"] for f in summary["faults"]] == ["rollout worker"]
        learner_nodes = summary["placement"]["learner_nodes"]
        head = next(n for n, a in summary["placement"]["node_addresses"].items()
                    if n not in {first.node_id, second.node_id, third.node_id})  # fmt: skip
        assert learner_nodes == [head]
        late = [n for step, n in _nodes_of_batches(run) if step > lost_at + 1]
        assert late
        assert first.node_id not in late  # nothing generated on the removed node after it left
        from staleflow.cluster.rundir import read_metrics

        rewards = [r["reward_mean"] for r in read_metrics(run / "metrics.jsonl")
                   if r["kind"] == "step"]  # fmt: skip
        assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3  # it learns (digits in replies)
    finally:
        cluster.shutdown()
