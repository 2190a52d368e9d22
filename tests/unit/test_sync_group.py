"""Closing a weight-broadcast group (learner.sync_group.SyncGroup.close / reopen)."""

from __future__ import annotations

import logging
import threading

import torch

from staleflow.buffer.ports import free_port
from staleflow.learner.sync_group import SyncGroup


class Backend:
    """Stands in for a process group whose member died: its shutdown waits for that member
    (as ProcessGroupNCCL's does) and so never returns; its abort returns, unless `stuck`."""

    def __init__(self, stuck: bool = False) -> None:
        self.stuck = stuck
        self.calls: list[str] = []
        self.released = threading.Event()  # set at the test's end: no thread left blocked

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        assert self.released.wait(10), "shutdown of a group whose member died"

    def abort(self) -> None:
        self.calls.append("abort")
        if self.stuck:
            self.released.wait(60)


def test_reopening_after_a_member_was_lost_aborts_the_old_group():
    # The members change when one is lost (or added). The old group was shut down, which
    # under NCCL waits for the lost member and never returns; it is aborted now, and the new
    # group (a real gloo group, of one member here) opens.
    old = Backend()
    previous = SyncGroup("gloo", 0, 2, None, old)
    try:
        group = SyncGroup.reopen(previous, "gloo", "127.0.0.1", free_port(), 0, 1, 30)
    finally:
        old.released.set()
    assert old.calls == ["abort"]
    assert previous.group is None
    assert previous.store is None
    tensor = torch.arange(4.0)
    group.broadcast(tensor)  # works: a group of one keeps its own tensor
    assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
    group.close()


def test_a_backend_that_never_returns_is_left_behind_with_a_warning(caplog):
    stuck = Backend(stuck=True)
    group = SyncGroup("nccl", 1, 3, None, stuck)
    try:
        with caplog.at_level(logging.WARNING, logger="staleflow.learner.sync_group"):
            group.close(abort=True, wait_s=0.2)  # returns, where it waited forever
    finally:
        stuck.released.set()
    assert stuck.calls == ["abort"]
    assert "nccl broadcast group's abort did not return in 0.2 s; left behind" in caplog.text
    assert group.group is None


def test_closing_a_healthy_group_shuts_it_down_and_twice_is_harmless():
    backend = Backend()
    backend.released.set()  # every member is there: its shutdown returns
    group = SyncGroup("gloo", 0, 2, None, backend)
    group.close()
    group.close()  # nothing left to release
    assert backend.calls == ["shutdown"]
