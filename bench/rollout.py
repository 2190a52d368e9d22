"""Rollout throughput: the RolloutWorker as a Ray actor pushing to Redis vs bare `generate`.

    python bench/rollout.py [--model smollm2-135m|tiny] [--rounds 3] [--prompts 8] [--k 8]
                            [--max-new-tokens 32] [--threads 2]

Both sides use the same model, prompts, batch (prompts x K), max_new_tokens, sampling
(temperature 1, no truncation) and torch thread count, and run one after the other (never at
once), alternating which goes first. The worker's time is the wall time of `run_batch` seen
from the driver: generation, behaviour log-probs, scoring, building groups, pushing to Redis and
Ray's call overhead. The bare loop is `model.generate` and counting tokens. Medians over rounds;
the ratio is printed last (target >= 0.9x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch


def bare_generate(
    model, tokenizer, prompts: list[list[int]], k: int, max_new: int, seed: int
) -> int:
    """model.generate on the same left-padded batch; returns generated tokens (to eos incl.)."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
            top_p=1.0, max_new_tokens=max_new, num_return_sequences=k, pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    new = out[:, width:].numpy()
    total = 0
    for row in new:
        eos = np.flatnonzero(row == tokenizer.eos_token_id)
        total += int(eos[0]) + 1 if len(eos) else len(row)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "tiny"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    parser.add_argument("--k", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    args = parser.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from staleflow.actors.hf_engine import HFEngine
    from staleflow.actors.models import load_model
    from staleflow.actors.worker import RolloutWorker
    from staleflow.buffer.server import RedisServer
    from staleflow.configs import parse_config

    cfg = parse_config(
        f"""
model: {{preset: {args.model}}}
task: {{name: arithmetic, operations: ["+"], chat_template: {str(args.model != "tiny").lower()}}}
rollout: {{prompts_per_batch: {args.prompts}, group_size: {args.k},
          max_new_tokens: {args.max_new_tokens}, temperature: 1.0}}
buffer: {{capacity: 100000}}
"""
    )
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(cfg.model)

    with tempfile.TemporaryDirectory() as tmp, RedisServer(tmp) as server:
        ray.init(
            address="local",  # not a cluster `ray start` left on this machine
            num_cpus=args.threads, include_dashboard=False, _node_ip_address="127.0.0.1",
            log_to_driver=False, configure_logging=False,
        )  # fmt: skip
        threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        actor = (
            ray.remote(RolloutWorker)
            .options(num_cpus=args.threads, runtime_env={"env_vars": threads})
            .remote(cfg, run_id="bench", redis_url=server.url)
        )
        # the same prompts for both sides: the worker's own stream, encoded its way
        local = RolloutWorker(
            cfg, run_id="bench", engine=HFEngine(model, tokenizer), tokenizer=tokenizer
        )
        batches = [local.next_prompts(args.prompts) for _ in range(args.rounds + 1)]
        encoded = [[local.encode_prompt(p) for p in batch] for batch in batches]
        del local

        ray.get(actor.run_batch.remote(0, batches[0]))  # warm-up, both sides
        bare_generate(model, tokenizer, encoded[0], args.k, args.max_new_tokens, seed=0)

        worker_rates, bare_rates = [], []
        for r in range(1, args.rounds + 1):

            def run_worker(r: int = r) -> None:
                start = time.perf_counter()
                report = ray.get(actor.run_batch.remote(0, batches[r]))
                worker_rates.append(report.tokens / (time.perf_counter() - start))

            def run_bare(r: int = r) -> None:
                start = time.perf_counter()
                n = bare_generate(model, tokenizer, encoded[r], args.k, args.max_new_tokens, r)
                bare_rates.append(n / (time.perf_counter() - start))

            for side in (run_worker, run_bare) if r % 2 else (run_bare, run_worker):
                side()
        pushed = ray.get(actor.run_batch.remote(0, batches[0])).pushed
        ray.shutdown()

    worker, bare = statistics.median(worker_rates), statistics.median(bare_rates)
    print(
        f"model {args.model}, {args.prompts} prompts x {args.k} samples, "
        f"max_new_tokens {args.max_new_tokens}, {args.threads} threads, {args.rounds} rounds"
    )
    print(f"bare model.generate loop:              {bare:8.1f} tokens/s (median)")
    print(f"RolloutWorker (Ray actor, into Redis): {worker:8.1f} tokens/s (median)")
    print(f"groups pushed per batch: {pushed}")
    print(f"ratio worker/bare: {worker / bare:.2f}x (target >= 0.9x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
