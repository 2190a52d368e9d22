"""The vLLM worker extension's broadcast receive (actors.vllm_engine.WeightLoaderExtension
.staleflow_receive) on a real two-member gloo group: learner rank 0 sends in one thread, the
extension receives in another. vLLM itself is not needed: the stand-in below is its model
runner's `reload_weights`, which reads the weights iterator once, in order."""

from __future__ import annotations

import threading
from typing import Any

import torch

from staleflow.actors.vllm_engine import WeightLoaderExtension
from staleflow.buffer.ports import free_port
from staleflow.learner.publish import broadcast_send, tensor_layouts
from staleflow.learner.sync_group import SyncGroup

# three buckets of 2 x 1 KB tensors each (float32 [256])
TENSORS = {f"layer{i}.weight": torch.full((256,), float(i)) for i in range(6)}
BUCKET_BYTES = 2048
TIMEOUT_S = 15  # the group's: a member left waiting in a collective fails after it


class Runner:
    """Stands in for vLLM's model runner: reads the iterator, noting for each tensor how many
    buckets the group had received when the loader got it; `fail_at` raises there."""

    def __init__(self, received: list[int], fail_at: int | None = None) -> None:
        self.received = received
        self.fail_at = fail_at
        self.seen: list[tuple[str, int, float]] = []

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        for i, (name, tensor) in enumerate(weights_iterator):
            if i == self.fail_at:
                raise RuntimeError("the loader failed")
            self.seen.append((name, self.received[0], float(tensor.view(torch.float32)[0])))


def _receive(runner: Runner, layouts: Any, port: int, out: dict[str, Any]) -> None:
    group = SyncGroup.open("gloo", "127.0.0.1", port, 1, 2, TIMEOUT_S)
    real = group.broadcast

    def counted(tensor: torch.Tensor, src: int = 0) -> None:
        real(tensor, src)
        runner.received[0] += 1

    group.broadcast = counted  # type: ignore[method-assign]
    engine = WeightLoaderExtension()
    engine.model_runner = runner
    engine._staleflow_group = group
    try:
        out["loaded"] = engine.staleflow_receive([list(layout) for layout in layouts])
    except Exception as exc:
        out["error"] = exc
    finally:
        group.close()


def _broadcast(runner: Runner) -> dict[str, Any]:
    """Send TENSORS from rank 0 while the extension receives; what each side ended with."""
    layouts = tensor_layouts(TENSORS, BUCKET_BYTES)
    assert len(layouts) == 3
    port, out = free_port(), {}
    receiver = threading.Thread(target=_receive, args=(runner, layouts, port, out))
    receiver.start()
    sender = SyncGroup.open("gloo", "127.0.0.1", port, 0, 2, TIMEOUT_S)
    try:
        out["sent"] = broadcast_send(sender, TENSORS, BUCKET_BYTES, version=4).version
    finally:
        receiver.join(60)
        sender.close()
    assert not receiver.is_alive()
    return out


def test_a_broadcast_is_loaded_bucket_by_bucket_as_it_arrives():
    # Each tensor reaches the loader after its own bucket arrived and before the next: the
    # buckets were collected in a list first (every tensor seen after all 3 had arrived), a
    # second copy of the model on the engine's GPU during every update.
    runner = Runner(received=[0])
    out = _broadcast(runner)
    assert out == {"sent": 4, "loaded": 6}
    assert [(name, value) for name, _, value in runner.seen] == [
        (f"layer{i}.weight", float(i)) for i in range(6)
    ]
    assert [buckets for _, buckets, _ in runner.seen] == [1, 1, 2, 2, 3, 3]


def test_a_load_failing_partway_still_receives_the_rest_and_reports_its_own_error():
    # The loader fails at the first bucket's second tensor: the two buckets after it are still
    # received, so learner rank 0's broadcast completes and the engine's error is the
    # loader's. Streamed without that, rank 0's broadcast failed too (the engine left the
    # collective: "Connection closed by peer"), which stops a run as the learner's failure.
    runner = Runner(received=[0], fail_at=1)
    out = _broadcast(runner)
    assert out["sent"] == 4
    assert str(out["error"]) == "the loader failed"
    assert runner.received == [3]
