"""Weight sync per method: publish on the learner's side + load into an engine, in one run.

    python bench/sync.py [--model smollm2-135m|tiny] [--rounds 5] [--device cpu|cuda]

The sender (a Ray actor holding the weights, as learner rank 0 does) and the receiver (this
process, with an HF engine on the same model) are separate processes, as in a run. Each method
is timed end to end (publish, transfer, copy into the engine's parameters), median of the
rounds, beside two bounds measured in the same run: a plain memcpy of the same bytes, timed
beside each row in every round (the ratio is the median of the rounds' ratios), and the
engine's own load of arrays already in this process (the copy no method can avoid).
Methods: ray (object store), checkpoint (safetensors files), ipc (the receiver reads the
sender's memory in place: CUDA IPC on a GPU, /dev/shm files on CPU), gloo (broadcast over a
process group; the nccl code path on CPU), and nccl when two GPUs are visible.

With --device cuda (the default when a GPU is visible) both ends hold the model on the GPU, as
colocated roles sharing one GPU do: each publish then starts from GPU memory (the copy to the
host that the learner's publish makes is timed with it), each load ends in GPU memory, and a
third bound is printed: the copy of the same bytes from host arrays into the GPU parameters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class Sender:
    """Learner rank 0's side: the weights, and each method's publish."""

    def __init__(self, model_name: str, directory: str, device: str) -> None:
        from staleflow.actors.models import load_model
        from staleflow.configs.schema import ModelConfig
        from staleflow.learner.learner import untied

        model, _ = load_model(ModelConfig(preset=model_name), device=device)
        self.tensors = untied(model.state_dict())  # what a run publishes: each tensor once
        self.arrays = {k: v.cpu().numpy() for k, v in self.tensors.items()}
        self.device = device
        self.directory = directory
        self.group: Any = None
        self.sharer: Any = None

    def publish(self, method: str, version: int) -> Any:
        from staleflow.learner.publish import CheckpointPublisher, RayPublisher

        # the learner's tensors, as rank 0 hands them over: from GPU memory each publish
        # copies them to the host (ray: a bucket at a time)
        arrays = self.arrays if self.device == "cpu" else self.tensors
        if method == "ray":
            return RayPublisher().publish(arrays, version)
        return CheckpointPublisher(self.directory, keep=2).publish(arrays, version)

    def share(self, version: int) -> Any:
        from staleflow.learner.ipc import WeightSharer

        self.sharer = self.sharer or WeightSharer(256 << 20)
        return self.sharer.share(self.tensors, version).buckets

    def discard(self, version: int) -> None:
        self.sharer.discard(version)

    def close(self) -> None:
        if self.sharer is not None:
            self.sharer.close()

    def layouts(self) -> Any:
        from staleflow.learner.publish import tensor_layouts

        return tensor_layouts(self.tensors, 256 << 20)

    def open(self, backend: str, port: int) -> None:
        from staleflow.learner.sync_group import SyncGroup

        self.group = SyncGroup.open(backend, "127.0.0.1", port, 0, 2, timeout_s=120)

    def send(self, version: int) -> float:
        from staleflow.learner.publish import broadcast_send

        return broadcast_send(self.group, self.tensors, 256 << 20, version).stats.seconds


def median_time(fn: Callable[[], Any], rounds: int) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def paired(
    fn: Callable[[], Any], bound: Callable[[], Any], rounds: int
) -> tuple[float, float, list[float]]:
    """`fn` timed beside `bound` in every round, their order alternating (a warm-up of each
    first): the median of fn's times, the median of the rounds' fn / bound ratios, and the
    bound's times. A bound timed once, before every method, moved with whatever else the
    machine did then (on the 2-core machine it ran 2.9x slower per byte in one run than in
    another, and every ratio with it)."""
    fn()
    bound()
    times, ratios, bounds = [], [], []
    for r in range(rounds):
        took: dict[int, float] = {}
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            start = time.perf_counter()
            (fn if i == 0 else bound)()
            took[i] = time.perf_counter() - start
        times.append(took[0])
        bounds.append(took[1])
        ratios.append(took[0] / took[1])
    return statistics.median(times), statistics.median(ratios), bounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "tiny"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here (use --device cpu)")
    device = args.device
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from staleflow.actors.hf_engine import HFEngine, load_named_arrays
    from staleflow.actors.models import load_model, prepare_model
    from staleflow.buffer.ports import free_port
    from staleflow.configs.schema import ModelConfig
    from staleflow.learner.publish import broadcast_receive
    from staleflow.learner.sync_group import SyncGroup

    prepare_model(ModelConfig(preset=args.model))
    from staleflow.cluster.placement import start_ray
    from staleflow.configs import parse_config

    gpus = torch.cuda.device_count()
    # the Ray a run of this model would start (its object store sized and pre-faulted)
    start_ray(None, parse_config(f"model: {{preset: {args.model}}}"), log_to_driver=False)
    model, tokenizer = load_model(ModelConfig(preset=args.model), device=device)
    engine = HFEngine(model, tokenizer)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    params = dict(model.state_dict(keep_vars=True))
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        gpu_share = {"num_gpus": 0.5} if device == "cuda" else {}
        sender = ray.remote(Sender).options(num_cpus=1, **gpu_share).remote(args.model, tmp, device)
        arrays = ray.get(sender.publish.remote("ray", 0)).arrays()
        local = {k: np.array(v) for k, v in arrays}
        nbytes = sum(a.nbytes for a in local.values())
        copies = {k: np.empty_like(v) for k, v in local.items()}

        def memcpy() -> None:
            for k, v in local.items():
                np.copyto(copies[k], v)

        ratio: dict[str, float] = {}  # each row's median per-round ratio to memcpy
        memcpy_s: list[float] = []

        def measure(name: str, fn: Callable[[], Any]) -> None:
            results[name], ratio[name], bounds = paired(fn, memcpy, args.rounds)
            memcpy_s.extend(bounds)

        if device == "cuda":
            on_gpu = {k: torch.empty(v.shape, dtype=torch.from_numpy(v).dtype, device="cuda")
                      for k, v in local.items()}  # fmt: skip

            def to_gpu() -> None:
                for k, v in local.items():
                    on_gpu[k].copy_(torch.from_numpy(v))
                sync()

            measure("host->GPU (bound)", to_gpu)
        measure("engine load only", lambda: (load_named_arrays(params, local), sync()))
        version = iter(range(1, 10_000))
        for method in ("ray", "checkpoint"):

            def via(method: str = method) -> None:
                handle = ray.get(sender.publish.remote(method, next(version)))
                engine.load_weights(handle.arrays(), handle.version)
                sync()

            measure(method, via)

        def via_ipc() -> None:
            v = next(version)
            buckets = ray.get(sender.share.remote(v))
            try:
                engine.receive_shared(buckets, v)  # synchronises the GPU before returning
            finally:
                ray.get(sender.discard.remote(v))

        measure("ipc", via_ipc)
        ray.get(sender.close.remote())

        if device == "cuda":
            print("gloo broadcast: not measured on cuda (it stands in for nccl on CPU; nccl "
                  "needs a GPU per end)")  # fmt: skip
        else:
            layouts = ray.get(sender.layouts.remote())
            port = free_port("127.0.0.1")
            opened = sender.open.remote("gloo", port)
            group = SyncGroup.open("gloo", "127.0.0.1", port, 1, 2, timeout_s=120)
            ray.get(opened)

            def via_gloo() -> None:
                v = next(version)
                sent = sender.send.remote(v)
                engine.load_weights(broadcast_receive(group, layouts), v)
                ray.get(sent)
                sync()

            measure("gloo broadcast", via_gloo)
            group.close()
    if gpus >= 2:
        print("nccl: two GPUs visible; run the gpu tests' NCCL broadcast for its figure")
    else:
        print(f"nccl: not measured here ({gpus} GPU visible; NCCL needs one GPU per end)")
    base = statistics.median(memcpy_s)
    print(f"[{args.model} on {device}] weight sync of {nbytes / 1e6:.1f} MB, publish + load "
          f"into an engine in another process, median of {args.rounds}; each row timed "
          "beside a memcpy of the same bytes in every round, x memcpy = the median of the "
          "rounds' ratios")  # fmt: skip
    print(f"  {'memcpy (bound)':17} {base * 1e3:8.1f} ms  {nbytes / 1e9 / base:6.2f} GB/s  "
          f"(median of its {len(memcpy_s)} runs)")  # fmt: skip
    for name, seconds in results.items():
        print(f"  {name:17} {seconds * 1e3:8.1f} ms  {nbytes / 1e9 / seconds:6.2f} GB/s  "
              f"{ratio[name]:5.2f}x memcpy")  # fmt: skip
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
