"""The publish's flatten: a model's tensors copied into one flat buffer (CUDA IPC's share and
the nccl / gloo broadcast both start with it), beside an alternative and the bound, on the same
tensors in one run.

    python bench/flatten.py [--model smollm2-135m|tiny] [--rounds 7] [--device cpu|cuda]

  shipped:  learner.publish.flatten_tensors (a zero_ of each padding gap and a copy_ of each
            tensor into its slice: on a GPU one or two kernel launches per tensor);
  one cat:  a single torch.cat of the tensors and zero padding into the buffer (a few batched
            kernels, but byte-wise ones: the pieces are uint8 views);
  memcpy:   one copy of a tensor of the same bytes (the bound).
Each round allocates the buffer, as every publish does, and ends with the device's
synchronize; medians over rounds, ratios last. On CPU (2 cores, SmolLM2, medians of 11, three
runs) one cat took 0.92-1.02x the shipped loop's time: the copy is memory-bound there. What
decides it is a GPU, where the loop is launch-bound (272 tensors, as a run publishes them:
the tied lm_head once) and a byte-wise cat may not reach the copy engine's bandwidth:
`bash bench/gpu.sh flatten` measures it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from sync import median_time  # bench/sync.py: warm-up, then the median of the rounds


def one_cat(bucket: dict[str, Any], device: Any) -> Any:
    """The alternative: the same bytes in the same places, in one torch.cat."""
    from staleflow.learner.publish import ALIGN, bucket_offsets

    views = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in bucket.values()]
    starts, end = bucket_offsets(v.numel() for v in views)
    flat = torch.empty(end, dtype=torch.uint8, device=device)
    zeros = torch.zeros(ALIGN - 1, dtype=torch.uint8, device=device)
    pieces, done = [], 0
    for view, start in zip(views, starts, strict=True):
        if start > done:
            pieces.append(zeros[: start - done])
        pieces.append(view)
        done = start + view.numel()
    if pieces:
        torch.cat(pieces, out=flat)
    return flat


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "tiny"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here (use --device cpu)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    from staleflow.actors.models import load_model, prepare_model
    from staleflow.configs.schema import ModelConfig
    from staleflow.learner.learner import untied
    from staleflow.learner.publish import flatten_tensors

    prepare_model(ModelConfig(preset=args.model))
    model, _ = load_model(ModelConfig(preset=args.model), device=args.device)
    tensors = untied(model.state_dict())  # what a run publishes: a tied lm_head not twice
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    shipped, _ = flatten_tensors(tensors, args.device)
    if not torch.equal(shipped, one_cat(tensors, args.device)):
        print("FAILED: the two flattens wrote different bytes", file=sys.stderr)
        return 1
    del shipped
    # written first: an untouched CPU allocation reads as the shared zero page, faster than
    # any real memory, which flattered the bound
    source = torch.ones(nbytes, dtype=torch.uint8, device=args.device)
    results = {  # each timed up to the device's synchronize
        "shipped": median_time(
            lambda: (flatten_tensors(tensors, args.device), sync()), args.rounds
        ),
        "one cat": median_time(lambda: (one_cat(tensors, args.device), sync()), args.rounds),
        "memcpy": median_time(lambda: (source.clone(), sync()), args.rounds),
    }
    print(
        f"[{args.model}, {len(tensors)} tensors, {nbytes / 1e6:.0f} MB, {args.device}, "
        f"median of {args.rounds}]"
    )
    for name, seconds in results.items():
        print(f"{name:<11} {seconds * 1e3:9.2f} ms  {nbytes / seconds / 1e9:7.2f} GB/s")
    print(f"one cat / shipped: {results['one cat'] / results['shipped']:.2f}x")
    print(f"shipped / memcpy: {results['shipped'] / results['memcpy']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
