"""What a resume needs from a checkpoint besides the learner: the older published versions
the schedule still hands out (cluster.resume.Resume.check_old_weights), the drops counted
since (cluster.ledger.Counts.catch_up_drops), and the lock-step lag check a restored run goes
on with (cluster.schedule.Schedule.check_lag)."""

from __future__ import annotations

import pytest

from staleflow.cluster.ledger import Counts
from staleflow.cluster.resume import Resume, ResumeError
from staleflow.cluster.schedule import Flow, Schedule
from staleflow.configs import parse_config

BASE = """
model: {preset: tiny}
task: {name: digits, chat_template: false, eval_prompts: 0}
rollout: {num_workers: 1, prompts_per_batch: 2, group_size: 2}
run: {steps: 20}
sync: {mode: lockstep, interval: 1, offset: 3}
"""


def schedule(*overrides: str) -> Schedule:
    return Schedule(parse_config(BASE, list(overrides)))


def checkpoint_at_step_8(tmp_path, kept: list[int], versions: dict[int, int] | None = None):
    """A checkpoint at step 8 with 8 batches started, holding weights `kept`."""
    weights = tmp_path / "step-000008" / "weights"
    weights.mkdir(parents=True)
    for v in kept:
        (weights / f"weights-v{v:08d}.safetensors").write_bytes(b"")
    flow = Flow(steps=8, batches=8, batches_done=8)
    return Resume(tmp_path / "step-000008", 8, flow, Counts(), versions=versions or {})


def test_a_checkpoint_with_every_version_the_schedule_needs_resumes(tmp_path):
    # I=1, O=3: batch e uses v(e) = max(0, e - 4), so batches 9, 10, 11 use v5, v6, v7
    # (older than step 8) and batch 12 uses v8, which the resumed learner publishes itself
    r = checkpoint_at_step_8(tmp_path, kept=[5, 6, 7])
    old = r.check_old_weights(schedule(), "ray")
    assert sorted(old) == [5, 6, 7]
    assert old[5] == tmp_path / "step-000008" / "weights"


def test_a_missing_version_is_refused_with_the_reason(tmp_path):
    r = checkpoint_at_step_8(tmp_path, kept=[5, 6])
    with pytest.raises(ResumeError, match=r"needs weights v\[7\].*written before staleflow kept"):
        r.check_old_weights(schedule(), "ray")
    with pytest.raises(ResumeError, match=r"v\[5, 6, 7\].*sync.method nccl keeps no copy"):
        checkpoint_at_step_8(tmp_path / "b", kept=[]).check_old_weights(schedule(), "nccl")


def test_a_batch_redone_in_lockstep_needs_its_own_version(tmp_path):
    # batch 8 was running at the checkpoint with v4: lock-step redoes it with v4
    r = checkpoint_at_step_8(tmp_path, kept=[5, 6, 7], versions={8: 4})
    with pytest.raises(ResumeError, match=r"v\[4\]"):
        r.check_old_weights(schedule(), "ray")
    # async redoes it with the newest version, and hands out no older one: nothing needed
    async_ = schedule("sync.mode=async", "sync.offset=0")
    redone = checkpoint_at_step_8(tmp_path / "a", kept=[], versions={8: 4})
    assert redone.check_old_weights(async_, "ray") == {}


def test_check_lag_accepts_only_the_formula():
    s = schedule()  # I=1, O=3: lag(t) = (t - 1) - max(0, t - 4) = 0, 1, 2, 3, 3, ...
    assert [s.check_lag(t, lag, lag) for t, lag in [(1, 0), (2, 1), (4, 3), (9, 3)]] == [
        0, 1, 3, 3,
    ]  # fmt: skip
    with pytest.raises(RuntimeError, match=r"lockstep step 9: lag 2..3 but the schedule says 3"):
        s.check_lag(9, 2, 3)


def test_drops_made_after_the_checkpoint_count_on_resume():
    # the checkpoint counted 2 stale and 0 invalid; the buffer has dropped 5 and 1 since
    # started (its counts are final): 3 + 1 = 4 more, and the counts become the buffer's
    counts = Counts(trained=10, dropped_stale=2)
    stats = type("Stats", (), {"dropped_stale": 5, "dropped_invalid": 1})()
    assert counts.catch_up_drops(stats) == 4
    assert (counts.trained, counts.dropped_stale, counts.dropped_invalid) == (10, 5, 1)


def test_an_offset_past_the_run_keeps_only_the_version_its_batches_use():
    # The offline preset (sync.offset=1000000, I=1): every batch of a 160-step run uses v0.
    # Looking ahead to the batches after the offset (for a resume that lengthens the run)
    # counted v0..v159 as needed: every version stayed published (~3 GB each for a 1.5B
    # model) and went into every checkpoint. Now the look-ahead ends at twice run.steps.
    from staleflow.cluster.resume import versions_in_use, versions_to_keep

    s = schedule("sync.offset=1000000", "run.steps=160")
    end = Flow(steps=160, batches=160, batches_done=160)
    assert versions_in_use(s, end) == {0}
    assert versions_to_keep(s, Flow(steps=50, batches=51, running={51: (0, 2)})) == {0}
    # I=1, O=3 as before: past the run's 8 steps, batches 9-11 use v5-v7 (kept for a resume
    # that lengthens the run), and batch 12 uses v8, the newest
    assert versions_in_use(schedule("run.steps=8"), Flow(steps=8, batches=8)) == {5, 6, 7}
    # an offset just past the run: 2 x 8 batches look ahead; batches 12-16 use v1-v5
    assert versions_in_use(schedule("sync.offset=10", "run.steps=8"), Flow(steps=8, batches=8)
                           ) == {0, 1, 2, 3, 4, 5}  # fmt: skip


def test_a_resume_needs_the_versions_of_the_batches_it_makes(tmp_path):
    # O=10, a checkpoint at step 8 holding v0: resumed to 11 steps, batches 9-11 use v0 and
    # it goes on; the look-ahead past the run's end asked for v0-v7 (batches up to 18 at
    # offset 10), refusing it. Resumed to 14 steps, batches 12-14 use v1-v3: refused.
    r = checkpoint_at_step_8(tmp_path, kept=[0])
    assert sorted(r.check_old_weights(schedule("sync.offset=10", "run.steps=11"), "ray")) == [0]
    with pytest.raises(ResumeError, match=r"v\[1, 2, 3\]"):
        r.check_old_weights(schedule("sync.offset=10", "run.steps=14"), "ray")
