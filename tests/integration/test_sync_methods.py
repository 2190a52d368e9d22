"""Weight sync methods through the real driver, and the refusals that keep a run from hanging:
real Ray (the session's `ray_local`, 8 CPUs, no GPU), real Redis, real DeepSpeed."""

from __future__ import annotations

import pytest

from staleflow.cluster.resources import PlacementError
from staleflow.cluster.schedule import lag

from .tiny import run_driver, steps_of

pytestmark = pytest.mark.integration


def assert_on_policy_and_reconciled(summary, records, steps):
    assert summary["status"] == "completed"
    assert summary["groups"]["reconciled"], summary["groups"]
    rows = steps_of(records)
    assert [r["lag_max"] for r in rows] == [0.0] * steps
    # lag 0 and ratio pi / mu = 1 on every token: the workers sampled with exactly the
    # learner's current weights, so every publish reached every engine bit for bit
    for r in rows:
        assert r["ratio_min"] == pytest.approx(1.0, abs=1e-4), r["step"]
        assert r["ratio_max"] == pytest.approx(1.0, abs=1e-4), r["step"]


@pytest.mark.parametrize("method", ["gloo", "checkpoint"])
def test_lockstep_on_policy_run_with_each_sync_method(tmp_path, ray_local, method):
    steps = 4
    _cfg, run, summary, records = run_driver(
        tmp_path, f"sync.method={method}", "sync.offset=0", f"run.steps={steps}"
    )
    assert_on_policy_and_reconciled(summary, records, steps)
    published = sorted(p.name for p in (run.path / "weights").glob("weights-v*"))
    if method == "checkpoint":  # default directory: <run dir>/weights, the newest two kept
        assert published == ["weights-v00000003.safetensors", "weights-v00000004.safetensors"]
    else:
        assert published == []


def test_gloo_broadcast_keeps_the_interval_schedule_and_evaluates_on_it(tmp_path, ray_local):
    # I = 2: batches 1-2 on v0, 3-4 on v2; evaluation every 2 steps uses the broadcast weights
    steps = 4
    _cfg, _run, summary, records = run_driver(
        tmp_path, "sync.method=gloo", "sync.interval=2", "run.eval_every=2",
        "task.eval_prompts=4", f"run.steps={steps}",
    )  # fmt: skip
    assert summary["status"] == "completed"
    assert [r["lag_max"] for r in steps_of(records)] == [lag(t, 2, 0) for t in range(1, 5)]
    assert sorted(summary["accuracy_by_step"]) == ["0", "2", "4"]
    assert summary["groups"]["reconciled"]


def test_async_gloo_run_reconciles(tmp_path, ray_local):
    _cfg, _run, summary, records = run_driver(
        tmp_path, "sync.method=gloo", "sync.mode=async", "sync.offset=0",
        "buffer.max_staleness=2", "run.steps=5",
    )  # fmt: skip
    assert summary["status"] == "completed"
    assert summary["groups"]["reconciled"], summary["groups"]
    assert max(r["lag_max"] for r in steps_of(records)) <= 2


def test_a_gpu_share_the_cluster_lacks_is_refused_before_any_actor_starts(tmp_path, ray_local):
    # the reported hang: workers asking for a GPU on a cluster with none waited forever
    import ray

    with pytest.raises(PlacementError) as err:
        run_driver(tmp_path, "rollout.gpus_per_worker=0.5", "learner.gpus_per_rank=0.5")
    assert "learner rank 0 (1 CPU, 0.5 GPU) fits on no node" in str(err.value)
    assert "= 3 CPU, 1.5 GPU; the cluster has" in str(err.value)
    assert ": 8 CPU, 0 GPU" in str(err.value)
    # nothing was started: every CPU of the session's Ray is free again
    assert ray.available_resources().get("CPU") == 8.0


def test_nccl_on_cpu_roles_is_refused_not_replaced(tmp_path, ray_local):
    with pytest.raises(PlacementError, match=r"sync\.method: nccl needs the learner and every"):
        run_driver(tmp_path, "sync.method=nccl", "sync.offset=0")
