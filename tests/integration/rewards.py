"""Reward functions the system tests give a `custom` task (imported by the rollout workers of
the session's Ray, which has the repository root on its path)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def one_slow_worker(meta: dict, text: str) -> float:
    """The first worker process to score a prompt with `meta['claim']` set claims
    `meta['marker']` and then takes `meta['sleep_s']` per response for the rest of the run;
    the others score at once. A real slow worker, so batches dispatched after its batch
    finish before it."""
    marker = meta["marker"]
    if not os.path.exists(marker) and not meta.get("claim"):
        return float(len(text))
    try:  # atomic: exactly one process wins
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    except FileExistsError:
        pass
    with open(marker) as f:
        if f.read() == str(os.getpid()):
            time.sleep(float(meta["sleep_s"]))
    return float(len(text))


def length(meta: dict, text: str) -> float:
    """The response's length: any reward will do where a test needs a `custom` task."""
    return float(len(text))


def expected(meta: dict, text: str) -> float:
    """The prompt's own `expect` field, whatever the response: a test knows each prompt's
    score in advance."""
    return float(meta["expect"])


def slow_once_marked(meta: dict, text: str) -> float:
    """The response's length, at once until the file `meta['marker']` exists, then after
    `meta['sleep_s']` seconds a response: a test makes what runs after a point slow."""
    if os.path.exists(meta["marker"]):
        time.sleep(float(meta["sleep_s"]))
    return float(len(text))


def slow_once_marked_task(
    tmp_path: Path, sleep_s: float, held_out_only: bool = False
) -> tuple[Path, list[str]]:
    """A `custom` task of 80 prompts scored by `slow_once_marked`: the marker that makes it
    slow once it exists (not made yet) and the task's config overrides. `held_out_only`:
    only the evaluation's prompts (the held-out split) are slow, training stays fast."""
    from staleflow.actors.tasks import _in_eval_split

    marker = tmp_path / "slow"
    rows = []
    for i in range(80):
        text = f"Say something #{i}"
        slow = not held_out_only or _in_eval_split(text)
        rows.append({"prompt": text, "marker": str(marker), "sleep_s": sleep_s if slow else 0})
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = ["task.name=custom", f"task.path={path}",
            "task.reward_fn=tests.integration.rewards:slow_once_marked"]  # fmt: skip
    return marker, task
