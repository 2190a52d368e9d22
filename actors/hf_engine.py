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
    token_stops,
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
        # Every id that ends a turn: the tokenizer's eos and the model's generation config's
        # (Llama 3 Instruct ends turns with <|eot_id|>, not its tokenizer's eos), as vLLM does.
        self.eos_ids = _end_ids(self.eos_id, getattr(model, "generation_config", None))
        self.pad_id = int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        )
        # A neutral base: only what we set below shapes the distribution.
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
            bos_token_id=tokenizer.bos_token_id,
        )  # fmt: skip
        self._params = dict(model.state_dict(keep_vars=True))
        self._sync_group: Any = None
        self._stop_plans: dict[tuple[str, ...], tuple[tuple[str, ...], list[int], Any]] = {}

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
            StoppingCriteriaList,
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
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        texts, stop_ids, candidates = self._stop_plan(sampling.stop)
        ends = _Ends(
            input_ids.shape[1], [*self.eos_ids, *stop_ids], texts, self.tokenizer, candidates
        )
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList([ends]),
            )
        new_tokens = out[:, input_ids.shape[1] :]
        logprobs = recorder.finish(new_tokens).cpu().numpy()
        tokens = new_tokens.cpu().numpy().astype(np.int32)
        completions = [
            self._completion(t, lp, end)
            for t, lp, end in zip(tokens, logprobs, ends.rows(len(tokens)), strict=True)
        ]
        if greedy:
            return [[c] * n for c in completions]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def load_weights(self, weights: WeightsUpdate, version: int) -> None:
        """Copy `weights` in and set the version. Once the first array is in, the weights are
        of no version (-1) until the last one is: a load that fails partway leaves a mix,
        which no batch or evaluation may use (a bad first array changes nothing)."""

        def copying() -> Iterator[tuple[str, Any]]:
            for item in as_named_arrays(weights):
                yield item
                # Asked for the next: this one was copied. Before that next is made: making
                # it can fail too (a bucket fetched or opened after the first one's arrays).
                self._version = -1

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

    def _stop_plan(self, stop: tuple[str, ...]) -> tuple[tuple[str, ...], list[int], Any]:
        """(text stop strings, stop token ids, the token ids that can complete a text stop
        string), made once per set of stop strings: only a token whose own text holds a stop
        string's last character (or part of a character) can complete it, so the other
        steps decode nothing. Decoding every unfinished row every step cost 2-4 ms a step
        for 256 rows."""
        plan = self._stop_plans.get(stop)
        if plan is None:
            texts, ids = token_stops(self.tokenizer, stop)
            candidates: frozenset[int] = frozenset()
            if texts:  # (no text stop string: no vocabulary to decode)
                last = {s[-1] for s in texts}
                pieces = self.tokenizer.batch_decode(
                    [[i] for i in range(len(self.tokenizer))], skip_special_tokens=True
                )
                candidates = frozenset(
                    i for i, piece in enumerate(pieces)
                    if "\ufffd" in piece or any(c in piece for c in last)
                )  # fmt: skip
            plan = self._stop_plans[stop] = (texts, ids, candidates)
        return plan

    def _completion(self, tokens: np.ndarray, logprobs: np.ndarray, end: int | None) -> Completion:
        """A row cut where `_Ends` saw it end (its first end-of-turn token, kept, or the token
        that completed a stop string); None: it ran to max_new_tokens. What generate put
        after the end is padding, never read as tokens (the pad id can be eos)."""
        reason = "length" if end is None else "stop"
        kept = tokens if end is None else tokens[:end]
        return Completion(
            token_ids=kept.copy(),
            logprobs=logprobs[: len(kept)].astype(np.float32),
            finish_reason=reason,
            text=self.tokenizer.decode(kept, skip_special_tokens=True),
        )


def _end_ids(eos_id: int, generation_config: Any) -> list[int]:
    """The tokenizer's eos first, then the other end ids the model's generation config names."""
    ids = [eos_id]
    configured = getattr(generation_config, "eos_token_id", None)
    for i in configured if isinstance(configured, list | tuple) else [configured]:
        if isinstance(i, int) and i >= 0 and i not in ids:
            ids.append(i)
    return ids


class _Ends:
    """Stopping criterion that sees only what each row generated, and records where it ended.

    transformers' own stop strings match the prompt's text too: with a prompt ending in
    "assistant\n" and stop "\n\n", a first token "\n" ended the row although its response
    holds no stop string, and the row's padding was then taken for generated tokens (as an
    eos where pad = eos). Here a row ends at its first end-of-turn token or when its
    generated text first contains a stop string, and `rows` says at which step."""

    def __init__(
        self,
        width: int,
        eos_ids: Sequence[int],
        stop: Sequence[str],
        tokenizer: Any,
        candidates: Any = None,
    ):
        self.width = width  # generated tokens start here in every row (left padding)
        self.eos_ids = set(eos_ids)
        self.stop = tuple(stop)
        self.tokenizer = tokenizer
        # tokens that can complete a stop string (HFEngine._stop_plan); None: any
        self.candidates = candidates
        # a stop string of c characters spans at most 4c byte-level tokens: decode only those
        self.window = 4 * max((len(s) for s in self.stop), default=0) + 4
        self.end: dict[int, int] = {}  # row -> tokens kept

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        steps = input_ids.shape[1] - self.width
        # one copy to the host a step (not a device sync per row)
        tails = input_ids[:, max(self.width, input_ids.shape[1] - self.window) :].tolist()
        for row, tail in enumerate(tails):
            if row in self.end:
                continue
            if tail[-1] in self.eos_ids:
                self.end[row] = steps
            elif self.stop and (self.candidates is None or tail[-1] in self.candidates):
                text = self.tokenizer.decode(tail, skip_special_tokens=True)
                if any(s in text for s in self.stop):
                    self.end[row] = steps
        done = [row in self.end for row in range(len(tails))]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def rows(self, n: int) -> list[int | None]:
        return [self.end.get(row) for row in range(n)]


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
