"""The rollout worker: prompts in, scored groups tagged with their policy version out.

A plain class (Ray wraps it in cluster/). Given the policy version it must use, a batch
samples K responses per prompt with the engine, scores them with the task, builds one `Group`
per prompt and pushes the batch to the replay buffer. New weights are loaded only between
batches (`load_weights`; an actor runs one method at a time), so every group comes from exactly
one version, the one it is tagged with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from staleflow.actors.engine import RolloutEngine, SamplingParams, WeightsUpdate
from staleflow.actors.models import PromptTooLongError, prompt_ids
from staleflow.actors.tasks import Prompt, Task, make_task
from staleflow.buffer.ports import node_address
from staleflow.buffer.records import FINISH_REASONS, Group, Response, batch_group_id
from staleflow.buffer.replay import ReplayBuffer
from staleflow.learner.ipc import SharedWeights
from staleflow.learner.sync_group import ray_place

__all__ = [
    "BatchReport",
    "EvalReport",
    "PromptTooLongError",
    "RewardError",
    "RolloutWorker",
    "VersionMismatchError",
    "WeightLoadError",
]

logger = logging.getLogger(__name__)


class VersionMismatchError(RuntimeError):
    """The worker was asked for a policy version it does not have loaded."""


class WeightLoadError(RuntimeError):
    """Loading published weights into the engine failed (the cause is chained)."""


@dataclass(frozen=True)
class BatchReport:
    """What one rollout batch did."""

    worker_id: str
    policy_version: int
    groups: int
    responses: int
    tokens: int
    generate_s: float
    tokens_per_s: float
    reward_mean: float
    reward_std: float
    parse_failures: int
    pushed: int
    load_s: float = 0.0  # loading new weights at this batch's boundary
    reward_errors: int = 0  # responses whose reward function raised (scored 0)
    node: str = ""  # the Ray node it ran on ("" outside Ray)
    first_reward_error: str | None = None  # the first of them, quoted (prompt and error)


class RewardError(RuntimeError):
    """The task's reward function raised for more of a batch than task.max_reward_errors
    allows: the run stops (redoing the batch would fail the same way)."""


def check_reward_errors(
    who: str, limit: float, errors: int, responses: int, first: str | None, batch: int = 0
) -> None:
    """RewardError when the reward function failed for more than `limit`
    (task.max_reward_errors) of a batch's (or an evaluation's) responses, quoting its first
    failure there. `batch`: the responses of the driver's batch these are a part of (0: these
    are all of it). The worker checks its part with it, the driver the batch's parts added
    up (cluster.rollouts.Rollouts.finished)."""
    if not errors or errors <= limit * max(batch, responses):
        return
    whole = (
        f" (a part of a batch of {batch}, whose limit that already passes)"
        if batch > responses
        else ""
    )
    raise RewardError(
        f"{who}: the reward function failed for {errors} of {responses} "
        f"responses{whole} (task.max_reward_errors={limit:g}); the first error:\n{first}"
    )


@dataclass(frozen=True)
class EvalReport:
    """Held-out accuracy: the fraction of responses the task scores correct (Score.is_correct:
    arithmetic and gsm8k the right number, other tasks a reward of at least 1), the mean
    reward, and the responses whose answer could not be read or whose reward function failed."""

    policy_version: int
    prompts: int  # samples scored: held-out problems repeat when there are fewer than this
    accuracy: float
    reward_mean: float
    parse_failures: int
    temperature: float
    examples: tuple[tuple[str, str, float], ...] = ()  # (prompt, response, reward), a few
    reward_errors: int = 0
    problems: int = 0  # distinct held-out problems among the prompts


class RolloutWorker:
    """Samples, scores and pushes groups for one run (see the module docstring).

    Built from a run config; `engine`, `task` and `buffer` can be injected instead (tests,
    benchmarks). Without a buffer, batches are generated and reported but pushed nowhere.
    """

    def __init__(
        self,
        cfg: Any,
        *,
        run_id: str,
        worker_index: int = 0,
        redis_url: str | None = None,
        engine: RolloutEngine | None = None,
        tokenizer: Any = None,
        task: Task | None = None,
        buffer: ReplayBuffer | None = None,
        shared: Sequence[Any] = (),
    ) -> None:
        """`shared`: directories this worker must see as the driver wrote them (objects with
        `check(who)`, cluster/storage.py's SharedDir), checked before anything loads."""
        self.cfg = cfg
        self.run_id = run_id
        self.worker_id = f"{run_id}-w{worker_index}"
        for directory in shared:
            directory.check(f"rollout worker {worker_index} on {node_address()}")
        if buffer is None and redis_url is not None:
            buffer = ReplayBuffer.from_config(cfg.buffer, redis_url, run_id)
            # before the model loads: an unreachable server fails the start, naming it
            buffer.check_reachable(f"rollout worker {worker_index} on {node_address()}")
        if engine is None:
            engine, tokenizer = build_engine(cfg)
        if tokenizer is None:
            raise ValueError("an injected engine needs its tokenizer")
        self.engine, self.tokenizer = engine, tokenizer
        self.task = task if task is not None else make_task(cfg.task)
        if self.task.chat_template and not getattr(tokenizer, "chat_template", None):
            from staleflow.actors.models import ModelError, no_chat_template

            raise ModelError(no_chat_template(cfg.model.path or cfg.model.preset))
        self.buffer = buffer
        self.seed = cfg.rollout.seed + worker_index
        self._batches = 0
        self._logged_reward_error = False
        # Workers share the task's prompt stream but each starts at its own offset, so two
        # workers do not sample the same prompts in lock step.
        self._prompts = itertools.islice(self.task.train_prompts(), worker_index * 7919, None)

    @property
    def version(self) -> int:
        return self.engine.version

    def load_weights(self, weights: WeightsUpdate, version: int) -> int:
        """Install new weights (between batches); returns the version now loaded."""
        self.engine.load_weights(weights, version)
        return self.engine.version

    def load_published(self, handle: Any) -> int:
        """Install weights published by the learner (a `RayWeights` or `CheckpointWeights`
        from staleflow.learner.publish, fetched bucket by bucket; or a `SharedWeights` from
        staleflow.learner.ipc, opened in place). A failure raises `WeightLoadError` with the
        engine's own error as its cause."""
        with self._load_errors(f"loading weights v{handle.version} into the "
                               f"{type(self.engine).__name__}"):  # fmt: skip
            if not isinstance(handle, SharedWeights):
                return self.load_weights(handle.arrays(), handle.version)
            receive = getattr(self.engine, "receive_shared", None)
            if receive is None:
                raise TypeError(f"the {type(self.engine).__name__} cannot load shared weights")
            # a worker started after the check at start may be elsewhere
            handle.check_place(ray_place(), self.worker_id)
            receive(handle.buckets, handle.version)
            return self.engine.version

    def join_sync_group(
        self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """Join learner rank 0's broadcast group (sync.method nccl / gloo) as `rank`."""
        join = getattr(self.engine, "join_sync_group", None)
        if join is None:
            raise TypeError(f"the {type(self.engine).__name__} cannot receive broadcasts")
        join(host, port, rank, world_size, backend, timeout_s)

    def receive_broadcast(self, layouts: list[Any], version: int) -> int:
        """Receive one broadcast update (the learner sends it at the same time)."""
        with self._load_errors(f"receiving broadcast weights v{version}"):
            self.engine.receive_broadcast(layouts, version)  # type: ignore[attr-defined]
        return self.engine.version

    def place(self) -> tuple[str, list[str]]:
        """This worker's node id and GPU ids (sync.method ipc needs learner rank 0's)."""
        return ray_place()

    @contextlib.contextmanager
    def _load_errors(self, what: str) -> Iterator[None]:
        """Any error inside becomes a WeightLoadError naming the worker and what failed."""
        try:
            yield
        except Exception as exc:
            raise WeightLoadError(
                f"{self.worker_id}: {what} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _ensure(self, weights: Any) -> None:
        if weights is not None and weights.version != self.engine.version:
            self.load_published(weights)

    def next_prompts(self, n: int) -> list[Prompt]:
        return list(itertools.islice(self._prompts, n))

    def run_batch(
        self,
        policy_version: int,
        prompts: Sequence[Prompt] | None = None,
        weights: Any = None,
        ids: tuple[int, int] | None = None,
    ) -> BatchReport:
        """One rollout batch at `policy_version`: the loaded one, or `weights` (a published
        handle) loaded first, so a failed load fails this batch with its own error. `ids`
        (driver batch number, index of the first prompt in it) makes the group ids those of
        `batch_group_id`, so a batch done again pushes nothing twice."""
        loading = time.perf_counter()
        self._ensure(weights)
        load_s = time.perf_counter() - loading
        if policy_version != self.engine.version:
            raise VersionMismatchError(
                f"{self.worker_id} has policy version {self.engine.version} loaded but was asked "
                f"for {policy_version}; load_weights first"
            )
        rollout = self.cfg.rollout
        prompts = (
            list(prompts) if prompts is not None else self.next_prompts(rollout.prompts_per_batch)
        )
        # A driver's batch is seeded by its number and first prompt, whichever worker runs it:
        # a batch redone after a resume or on a replacement worker samples the same responses
        # (a worker's own count restarts at 0 in every new worker process)
        if ids is not None:
            seed = ((rollout.seed * 1_000_003 + ids[0]) * 1_000_003 + ids[1]) % (1 << 63)
        else:  # a worker used on its own (tests, scripts): its own count
            seed = self.seed * 1_000_003 + self._batches
        sampling = SamplingParams.from_config(rollout, seed=seed)
        self._batches += 1
        encoded = [self.encode_prompt(p) for p in prompts]
        start = time.perf_counter()
        completions = self.engine.generate(encoded, rollout.group_size, sampling)
        generate_s = time.perf_counter() - start
        groups, rewards, failures, errors, first_error = [], [], 0, 0, None
        for i, (prompt, tokens, samples) in enumerate(
            zip(prompts, encoded, completions, strict=True)
        ):
            responses = []
            for c in samples:
                score = self.task.score(prompt, c.text)
                if score.error is not None:
                    errors += 1
                    first_error = first_error or self._reward_error(score.error, prompt)
                else:
                    failures += not score.parsed
                rewards.append(score.reward)
                responses.append(
                    Response(
                        token_ids=c.token_ids,
                        behavior_logp=c.logprobs,
                        reward=score.reward,
                        finish_reason=c.finish_reason
                        if c.finish_reason in FINISH_REASONS
                        else "stop",
                        metadata=score.metadata(),
                    )
                )
            groups.append(
                Group.new(
                    run_id=self.run_id,
                    prompt_id=prompt.prompt_id,
                    task=self.task.name,
                    prompt_token_ids=tokens,
                    responses=responses,
                    policy_version=policy_version,
                    worker_id=self.worker_id,
                    group_id=batch_group_id(self.run_id, ids[0], ids[1] + i) if ids else None,
                )
            )
        # The limit is a batch's. A driver's part (`ids`) is judged against the whole batch's
        # responses, and the driver adds the parts up (Rollouts.finished): judged against its
        # own, whether a run stopped depended on how many workers shared the batch.
        batch = rollout.prompts_per_batch * rollout.group_size if ids is not None else 0
        self._check_reward_errors(errors, len(rewards), first_error, batch)
        pushed = sum(self.buffer.push_many(groups)) if self.buffer is not None else 0
        tokens = sum(g.num_tokens for g in groups)
        return BatchReport(
            worker_id=self.worker_id,
            policy_version=policy_version,
            groups=len(groups),
            responses=len(rewards),
            tokens=tokens,
            generate_s=generate_s,
            tokens_per_s=tokens / generate_s if generate_s > 0 else 0.0,
            reward_mean=statistics.fmean(rewards) if rewards else 0.0,
            reward_std=statistics.pstdev(rewards) if rewards else 0.0,
            parse_failures=failures,
            pushed=pushed,
            load_s=load_s,
            reward_errors=errors,
            node=_ray_node(),
            first_reward_error=first_error,
        )

    def _reward_error(self, error: str, prompt: Prompt) -> str:
        """A reward function's failure, as quoted in errors; its traceback is logged the
        first time this worker meets one."""
        described = f"prompt {prompt.prompt_id}: {error}"
        if not self._logged_reward_error:
            self._logged_reward_error = True
            logger.error(
                "%s: the reward function failed (scored 0, counted as a reward error; logged "
                "once): %s", self.worker_id, described,
            )  # fmt: skip
        return described

    def _check_reward_errors(
        self, errors: int, responses: int, first: str | None, batch: int = 0
    ) -> None:
        """`check_reward_errors` for this worker's batch part or evaluation."""
        check_reward_errors(
            self.worker_id, self.cfg.task.max_reward_errors, errors, responses, first, batch
        )

    def evaluate(
        self, n_prompts: int | None = None, temperature: float | None = None, weights: Any = None
    ) -> EvalReport:
        """Held-out accuracy of the loaded weights, or of `weights` loaded first (one sample
        per held-out prompt)."""
        self._ensure(weights)
        if self.engine.version < 0:
            raise VersionMismatchError(
                f"{self.worker_id}: a weight load failed partway, so its weights are of no "
                "version; load weights first"
            )
        n = n_prompts if n_prompts is not None else self.cfg.task.eval_prompts
        temp = temperature if temperature is not None else self.cfg.task.eval_temperature
        prompts = self.task.eval_prompts(n)
        sampling = dataclasses.replace(
            SamplingParams.from_config(self.cfg.rollout, seed=self.seed + 7), temperature=temp
        )
        completions = self.engine.generate([self.encode_prompt(p) for p in prompts], 1, sampling)
        scores = [self.task.score(p, c[0].text) for p, c in zip(prompts, completions, strict=True)]
        failed = [(s, p) for s, p in zip(scores, prompts, strict=True) if s.error is not None]
        if failed:  # as in training: logged, counted, and past the limit an error
            first = self._reward_error(failed[0][0].error or "", failed[0][1])
            self._check_reward_errors(len(failed), len(scores), first)
        examples = tuple(
            (p.text, c[0].text, s.reward)
            for p, c, s in itertools.islice(zip(prompts, completions, scores, strict=True), 3)
        )
        return EvalReport(
            policy_version=self.engine.version,
            prompts=len(prompts),
            problems=len({p.prompt_id for p in prompts}),
            accuracy=sum(s.is_correct for s in scores) / max(len(scores), 1),
            reward_mean=statistics.fmean(s.reward for s in scores) if scores else 0.0,
            parse_failures=sum(not s.parsed and s.error is None for s in scores),
            reward_errors=len(failed),
            temperature=temp,
            examples=examples,
        )

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of the prompt as the model sees it (chat template applied if asked);
        PromptTooLongError if they and rollout.max_new_tokens exceed the model's context."""
        ids = prompt_ids(self.tokenizer, [prompt.text], self.task.chat_template)[0]
        context = getattr(self.engine, "context_length", None)
        new = self.cfg.rollout.max_new_tokens
        if context is not None and len(ids) + new > context:
            raise PromptTooLongError(
                f"prompt {prompt.prompt_id} is {len(ids)} tokens; with rollout.max_new_tokens="
                f"{new} that exceeds the model's context of {context} tokens. Shorten or "
                "remove the prompt in the task file, or lower rollout.max_new_tokens"
            )
        return ids


def build_engine(cfg: Any) -> tuple[RolloutEngine, Any]:
    """The engine a run config asks for, with its tokenizer."""
    if cfg.rollout.engine == "vllm":
        from staleflow.actors.vllm_engine import VLLMEngine

        engine = VLLMEngine.from_config(cfg)
        return engine, engine.tokenizer
    from staleflow.actors.hf_engine import HFEngine
    from staleflow.actors.models import load_model
    from staleflow.learner.device import role_device

    device = role_device(cfg.rollout.gpus_per_worker, "rollout.gpus_per_worker")
    model, tokenizer = load_model(cfg.model, device=device)
    return HFEngine(model, tokenizer), tokenizer


def _ray_node() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ""
