"""The trajectory record (cluster/trajectories.py) across a crash and resumes."""

from __future__ import annotations

from staleflow.buffer.records import synthetic_groups
from staleflow.cluster.trajectories import TrajectoryLog, read_trajectories


def test_a_record_torn_by_a_crash_is_cut_before_the_resumed_run_appends(tmp_path):
    # the torn bytes stayed in groups.bin and the resumed run appended after them: the next
    # read took the torn header's length across the new record and failed (replay, and the
    # second resume's truncate, which a learner rank runs as it loads)
    groups = synthetic_groups(4, k=2, tokens=16, seed=1)
    log = TrajectoryLog(tmp_path)
    log.record(1, 0, groups[:2])
    log.close()
    whole = (tmp_path / "groups.bin").stat().st_size
    with open(tmp_path / "groups.bin", "ab") as f:  # a crash mid-write: a header for 64
        f.write((64).to_bytes(8, "little") + b"partial")  # bytes, 7 of them written
    for resume_at, new in ((1, groups[2:3]), (2, groups[3:])):  # two resumes
        log = TrajectoryLog(tmp_path)
        log.truncate(resume_at)
        if resume_at == 1:
            assert (tmp_path / "groups.bin").stat().st_size == whole  # the torn bytes cut
        log.record(resume_at + 1, resume_at, new)
        log.close()
    steps, stored = read_trajectories(tmp_path)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert sorted(stored) == sorted(g.group_id for g in groups)
    assert stored[groups[3].group_id] == groups[3]
