"""A run on a multi-node Ray cluster simulated on this machine (ray.cluster_utils.Cluster:
separate raylets, one per node, each with its own resources): learner ranks placed by their
placement group and meeting on rank 0's node, workers on other nodes reaching the embedded
Redis on the driver node's address, and every group accounted for."""

from __future__ import annotations

import json
import os

import pytest

from tests.integration.test_system import assert_reconciled, staleflow
from tests.integration.tiny import TINY

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def two_nodes():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Each node fits one learner rank and one rollout worker (1 CPU each), so spreading the
    # two ranks puts one on each node and the workers follow wherever CPUs are left.
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
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
    out, _ = proc.communicate(timeout=900)
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
