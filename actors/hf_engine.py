"""The Hugging Face engine: transformers `generate` with behaviour log-probs.

Sampling runs through `generate` with our own logits processors (temperature, then top-k, then
top-p, then a recorder) and a neutral generation config, so no model-specific default (a
repetition penalty, a default top-k of 50, ...) silently changes the distribution that the
recorded log-probs describe. The recorder keeps one step of log-probabilities at a time, not
the whole [steps, batch, vocab] history.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from staleflow.actors.engine import (
    Completion,
    SamplingParams,
    WeightsUpdate,
    as_named_arrays,
    check_parameter,
)
from staleflow.actors.models import context_of

__all__ = ["HFEngine", "load_named_arrays"]


class HFEngine:
    """A causal LM and its tokenizer, generating batches of K samples per prompt."""

    def __init__(self, model: Any, tokenizer: Any, version: int = 0) -> None:
        from transformers import GenerationConfig

        self.model = model.eval()
        self.tokenizer = tokenizer
        self._version = version
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        )
        # A neutral base: only what we set below shapes the distribution.
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.eos_id, pad_token_id=self.pad_id, bos_token_id=tokenizer.bos_token_id
        )
        self._params = dict(model.state_dict(keep_vars=True))
        self._sync_group: Any = None

    @property
    def version(self) -> int:
        return self._version

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context_length(self) -> int | None:
        """Tokens the model can attend over (prompt + response), if its config says."""
        return context_of(self.model.config)

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Completion]]:
        from transformers import (
            GenerationConfig,
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        if not prompts:
            return []
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        input_ids, attention_mask = self._left_pad(prompts)
        greedy = sampling.temperature == 0
        processors: list[Any] = []
        if not greedy:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                processors.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                processors.append(TopPLogitsWarper(sampling.top_p))
        recorder = _LogprobRecorder()
        processors.append(recorder)
        # temperature, top-k and top-p are applied by our own warpers, before the recorder
        neutral = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        config = GenerationConfig(
            do_sample=not greedy,
            **neutral,
            max_new_tokens=sampling.max_new_tokens,
            num_return_sequences=1 if greedy else n,  # greedy samples are all the same
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            stop_strings=list(sampling.stop) or None,
        )
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                logits_processor=LogitsProcessorList(processors),
                tokenizer=self.tokenizer if sampling.stop else None,
            )
        new_tokens = out[:, input_ids.shape[1] :]
        logprobs = recorder.finish(new_tokens).cpu().numpy()
        tokens = new_tokens.cpu().numpy().astype(np.int32)
        completions = [
            self._completion(t, lp, sampling) for t, lp in zip(tokens, logprobs, strict=True)
        ]
        if greedy:
            return [[c] * n for c in completions]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def load_weights(self, weights: WeightsUpdate, version: int) -> None:
        """Copy `weights` in and set the version. Once the first array is in, the weights are
        of no version (-1) until the last one is: a load that fails partway leaves a mix,
        which no batch or evaluation may use (a bad first array changes nothing)."""

        def copying() -> Iterator[tuple[str, Any]]:
            for i, item in enumerate(as_named_arrays(weights)):
                if i == 1:  # asked for the second: the first was copied
                    self._version = -1
                yield item

        load_named_arrays(self._params, copying())
        self._version = version

    def join_sync_group(
        self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """Join the learner's broadcast group (staleflow.learner.sync_group) as `rank`."""
        from staleflow.learner.sync_group import SyncGroup

        self._sync_group = SyncGroup.reopen(
            self._sync_group, backend, host, port, rank, world_size, timeout_s
        )

    def receive_broadcast(self, layouts: list[Any], version: int) -> None:
        """Receive one broadcast update straight into the model's parameters."""
        from staleflow.learner.publish import broadcast_receive

        if self._sync_group is None:
            raise RuntimeError("receive_broadcast before join_sync_group")
        self.load_weights(broadcast_receive(self._sync_group, layouts), version)

    def receive_shared(self, buckets: list[Any], version: int) -> None:
        """Load a version learner rank 0 shares in place (staleflow.learner.ipc): each bucket
        is opened as views of the learner's memory and copied into the parameters. The device
        is synchronised before returning, so nothing reads that memory once this returns."""
        from staleflow.learner.ipc import open_bucket

        def opened() -> Iterator[tuple[str, Any]]:
            for bucket in buckets:
                yield from open_bucket(bucket).items()

        try:
            self.load_weights(opened(), version)
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------------- internals

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _completion(
        self, tokens: np.ndarray, logprobs: np.ndarray, sampling: SamplingParams
    ) -> Completion:
        """Cut a row where generation really ended: its first eos (kept), or where a stop
        string first completes, whichever is earlier; else it ran to max_new_tokens. (The pad
        token can equal eos, so padding after a stop string must not be read as an eos.)"""
        end, reason = len(tokens), "length"
        eos = np.flatnonzero(tokens == self.eos_id)
        if len(eos):
            end, reason = int(eos[0]) + 1, "stop"
        if sampling.stop:
            cut = self._stop_string_end(tokens[:end], sampling.stop)
            if cut is not None:
                end, reason = cut, "stop"
        kept = tokens[:end]
        return Completion(
            token_ids=kept.copy(),
            logprobs=logprobs[:end].astype(np.float32),
            finish_reason=reason,
            text=self.tokenizer.decode(kept, skip_special_tokens=True),
        )

    def _stop_string_end(self, tokens: np.ndarray, stop: Sequence[str]) -> int | None:
        """Smallest prefix length whose text contains a stop string (binary search)."""

        def has_stop(length: int) -> bool:
            text = self.tokenizer.decode(tokens[:length], skip_special_tokens=True)
            return any(s in text for s in stop)

        if not len(tokens) or not has_stop(len(tokens)):
            return None
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if has_stop(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo


class _LogprobRecorder:
    """Logits processor placed last: keeps log_softmax of the final scores of the previous
    step and, once the next step reveals which token was drawn, the log-prob of that token."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.taken: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.taken.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[rows, steps] log-probs of `new_tokens` (the generated part of each row)."""
        if self.previous is None:
            return torch.zeros(new_tokens.shape, dtype=torch.float32)
        last = self.previous.gather(1, new_tokens[:, -1:]).squeeze(1)
        return torch.stack([*self.taken, last], dim=1)


def load_named_arrays(params: dict[str, torch.Tensor], weights: WeightsUpdate) -> int:
    """Copy named numpy arrays into `params` in place; returns how many were copied.

    int16 arrays are bfloat16 bit patterns (numpy has no bfloat16). Raises KeyError naming
    unknown parameters and ValueError on a shape mismatch; nothing is copied for a bad entry.
    """
    count = 0
    with torch.no_grad():
        for name, array in as_named_arrays(weights):
            target = params.get(name)
            check_parameter(name, array.shape, None if target is None else target.shape, params)
            if isinstance(array, torch.Tensor):  # received by broadcast, maybe on the GPU
                source = array
            else:
                with warnings.catch_warnings():  # read-only arrays (object store's) are only read
                    warnings.filterwarnings("ignore", message="The given NumPy array is not writ")
                    source = torch.from_numpy(np.ascontiguousarray(array))
            if source.dtype == torch.int16:
                source = source.view(torch.bfloat16)
            target.data.copy_(source.to(dtype=target.dtype, device=target.device))
            count += 1
    return count
