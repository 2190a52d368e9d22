"""Learner throughput and weight-sync cost, each against the plainest equivalent, in one run.

    python bench/learner.py [--model smollm2-135m|tiny] [--groups 4] [--k 4] [--tokens 48]
                            [--rounds 3]

1. `Learner.step` (groups -> batch, DeepSpeed engine, the preset's loss, one optimizer step)
   vs a bare torch loop on a copy of the same model: the same prebuilt batch, the same loss
   function, clip_grad_norm_ and AdamW. Samples/s and tokens/s, medians; target >= 0.85x.
2. Publishing the weights and loading them into an engine, via the Ray object store and via
   checkpoint files, vs a plain in-memory copy of the same bytes (GB/s and the ratio), for the
   tiny model and SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch


def learner_vs_bare(model_name: str, args: argparse.Namespace) -> None:
    from staleflow.actors.models import load_model
    from staleflow.buffer.records import synthetic_groups
    from staleflow.configs import parse_config
    from staleflow.learner.batch import build_batch
    from staleflow.learner.learner import Learner, response_logprobs
    from staleflow.learner.losses import LossInputs, loss_from_config

    cfg = parse_config(
        f"model: {{preset: {model_name}}}\n"
        "learner: {optimizer: {lr: 1.0e-6, grad_clip: 1.0}, "
        "loss: {name: rec-oneside-nois, epsilon_low: 0.6, epsilon_high: 2.0}}\n"
    )
    model, tokenizer = load_model(cfg.model)
    bare_model = copy.deepcopy(model)
    learner = Learner(cfg, model=model, tokenizer=tokenizer)
    groups = synthetic_groups(
        args.groups, args.k, args.tokens, vocab=len(tokenizer), prompt_tokens=24
    )
    batch = build_batch(groups, cfg.learner.loss.advantage, learner.pad_id, seed=0)
    loss_fn = loss_from_config(cfg.learner.loss)
    optimizer = torch.optim.AdamW(bare_model.parameters(), lr=1e-6)
    bare_model.eval()

    def bare_step() -> None:
        logp = response_logprobs(bare_model, batch, 1.0)
        out = loss_fn(LossInputs(logp, batch.behavior_logp, batch.advantages, batch.response_mask))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(bare_model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    samples = batch.num_sequences
    tokens = int(batch.response_mask.sum())
    learner.step(groups)  # warm-up, both
    bare_step()
    ours, bare = [], []
    for r in range(args.rounds):
        for side in ("ours", "bare") if r % 2 == 0 else ("bare", "ours"):
            start = time.perf_counter()
            learner.step(groups) if side == "ours" else bare_step()
            (ours if side == "ours" else bare).append(time.perf_counter() - start)
    t_ours, t_bare = statistics.median(ours), statistics.median(bare)
    print(
        f"[{model_name}] {samples} sequences, {tokens} response tokens/step, {args.rounds} rounds"
    )
    print(f"  bare torch loop : {samples / t_bare:8.2f} samples/s {tokens / t_bare:9.1f} tokens/s")
    print(f"  Learner.step    : {samples / t_ours:8.2f} samples/s {tokens / t_ours:9.1f} tokens/s")
    print(f"  ratio Learner/bare: {t_bare / t_ours:.2f}x (target >= 0.85x)")


def sync_costs(model_name: str) -> list[tuple[str, float]]:
    import ray

    from staleflow.actors.hf_engine import HFEngine
    from staleflow.actors.models import load_model
    from staleflow.configs.schema import ModelConfig
    from staleflow.learner.publish import CheckpointPublisher, RayPublisher

    model, tokenizer = load_model(ModelConfig(preset=model_name))
    from staleflow.learner.learner import untied

    # what a run publishes: a tied lm_head once
    arrays = {k: v.numpy().copy() for k, v in untied(model.state_dict()).items()}
    target_model, _ = load_model(ModelConfig(preset=model_name))
    engine = HFEngine(target_model, tokenizer)
    nbytes = sum(a.nbytes for a in arrays.values())
    results = []

    def timed(fn) -> float:
        fn()  # warm-up
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    copies = {k: np.empty_like(v) for k, v in arrays.items()}
    t_copy = timed(lambda: [np.copyto(copies[k], v) for k, v in arrays.items()])

    def via_ray() -> None:
        handle = RayPublisher().publish(arrays, version=1)
        engine.load_weights(handle.arrays(), handle.version)

    with tempfile.TemporaryDirectory() as tmp:
        publisher = CheckpointPublisher(tmp)

        def via_checkpoint() -> None:
            handle = publisher.publish(arrays, version=1)
            engine.load_weights(handle.arrays(), handle.version)

        t_ray, t_ckpt = timed(via_ray), timed(via_checkpoint)
    gb = nbytes / 1e9
    print(f"[{model_name}] weight sync of {gb * 1e3:.1f} MB (publish + load into an engine)")
    print(f"  memory copy : {t_copy * 1e3:8.1f} ms {gb / t_copy:6.2f} GB/s")
    for name, t in (("ray", t_ray), ("checkpoint", t_ckpt)):
        # the same way round as bench/sync.py's (and the target's): times a memcpy's time
        print(f"  {name:11} : {t * 1e3:8.1f} ms {gb / t:6.2f} GB/s  ({t / t_copy:.2f}x memcpy)")
        results.append((name, t))
    del ray
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "tiny"])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48, help="response tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    learner_vs_bare(args.model, args)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)  # fmt: skip
    for name in ("tiny", "smollm2-135m"):
        sync_costs(name)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
