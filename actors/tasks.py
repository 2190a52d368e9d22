"""Tasks: a prompt source plus a verifiable reward (a pure function of the prompt and the text).

    task = make_task(cfg.task)
    prompt = next(task.train_prompts())
    score = task.score(prompt, "The answer is 7.")   # Score(reward=1.0, parsed=True, ...)

Built in: `arithmetic` (seeded a+b, a-b, a*b), `digits` (a toy reward for smoke tests),
`gsm8k` (local JSONL), `reasoning_gym:<name>` (any reasoning-gym dataset, optional extra) and
`custom` (prompts from a JSONL file, reward from an import path). Rewards never raise on strange
model output: they return 0 with `parsed=False`, which the rollout worker counts. Held-out
evaluation prompts are disjoint from training prompts where a split by a hash of the problem
makes them so (arithmetic, gsm8k, custom); reasoning-gym's held-out set is another seed's
draw, which can repeat a few training questions.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import itertools
import json
import logging
import math
import random
import re
import traceback
import unicodedata
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

__all__ = [
    "ArithmeticTask",
    "CustomTask",
    "DigitsTask",
    "GSM8KTask",
    "Prompt",
    "PromptStream",
    "ReasoningGymTask",
    "Score",
    "Task",
    "TaskError",
    "extract_final_number",
    "make_task",
]


class TaskError(ValueError):
    """A task that cannot be built: a missing file, a broken line, a bad import path."""


@dataclass(frozen=True)
class Prompt:
    """One problem: `text` is the user message, `answer` the reference, `metadata` task data."""

    prompt_id: str
    text: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


EXTRACTED_CHARS = 256  # of a score's extracted answer kept with the response


@dataclass(frozen=True)
class Score:
    """A reward, whether an answer could be read from the text at all, and what was read."""

    reward: float
    parsed: bool
    extracted: str | None = None
    error: str | None = None  # the reward function raised: its traceback (reward is 0)
    correct: bool | None = None  # for held-out accuracy; None: reward >= 1

    def metadata(self) -> dict[str, Any]:
        """What a response record keeps of the score. `extracted` is cut to EXTRACTED_CHARS:
        a reasoning-gym answer is the response's whole last line, and one over the buffer's
        4096-character limit failed the batch's push, on every redo (the same seeds)."""
        extracted = self.extracted
        if extracted is not None and len(extracted) > EXTRACTED_CHARS:
            extracted = extracted[: EXTRACTED_CHARS - 1] + "\u2026"
        return {"parsed": self.parsed, "extracted": extracted}

    @property
    def is_correct(self) -> bool:
        """What held-out accuracy counts: the task's own verdict where it gives one (a bonus
        such as arithmetic's format_reward never makes a wrong answer right), else reward >= 1."""
        return self.correct if self.correct is not None else self.reward >= 1.0


class Task(Protocol):
    name: str
    chat_template: bool

    def train_prompts(self) -> Iterator[Prompt]:
        """An endless, seeded stream of training prompts."""
        ...

    def eval_prompts(self, n: int) -> list[Prompt]:
        """`n` held-out prompts (repeating the held-out set if it is smaller than `n`)."""
        ...

    def score(self, prompt: Prompt, response: str) -> Score: ...


class PromptStream:
    """A task's training prompts in the order the run takes them, with a digest of every
    prompt taken so far (id, text, answer, metadata): a resumed run checks it continues the
    stream its checkpoint was made on (cluster.resume), as an edited task file would not."""

    def __init__(self, prompts: Iterator[Prompt]) -> None:
        self._prompts = prompts
        self._hash = hashlib.sha256()
        self.taken = 0

    def take(self, n: int) -> list[Prompt]:
        out = list(itertools.islice(self._prompts, n))
        for p in out:
            fields = [p.prompt_id, p.text, p.answer, _canonical(p.metadata)]
            self._hash.update(json.dumps(fields, ensure_ascii=False).encode() + b"\n")
        self.taken += len(out)
        return out

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()


def _canonical(value: Any) -> Any:
    """`value` as plain JSON, the same in every process: keys sorted, sets ordered, any other
    object by its type's name (a repr could hold a memory address)."""
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return [[str(k), _canonical(v)] for k, v in items]
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_canonical(v) for v in value), key=repr)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return f"<{type(value).__name__}>"


# ----------------------------------------------------------------------------- answers

# A comma is read only as a thousands separator (1,234,567): "(3,4)" holds the numbers 3 and
# 4, not 34, and "12,5" holds 12 and 5. A minus sign counts only where it cannot be a hyphen
# or a subtraction: "3-5" and "step-2" end in 5 and 2, not -5 and -2. ".5" is 0.5, but a
# point after a word, a digit or a point starts no number ("e.g.5", "1.5.3", "...3": 5, 3, 3).
_NUMBER = re.compile(
    r"(?:(?<![\w.])-)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])\.\d+)"
)


def extract_final_number(text: str) -> float | None:
    """The last number in `text` ("12.0", "-3", "1,234", full-width digits), or None."""
    matches = _NUMBER.findall(_normalise_number_text(text))
    for raw in reversed(matches):
        try:
            value = float(raw.replace(",", ""))
        except ValueError:
            continue
        if math.isfinite(value):
            return value
    return None


def _normalise_number_text(text: str) -> str:
    """Full-width digits as ASCII, the unicode minus as '-'."""
    return unicodedata.normalize("NFKC", text).replace("\u2212", "-")


def _numbers_equal(value: float | None, reference: float) -> bool:
    return value is not None and abs(value - reference) < 1e-6


def format_number(value: float) -> str:
    """A number as text, exactly: 1234567 (not 1.23457e+06, which is another number), 0.5."""
    return str(int(value)) if value.is_integer() else repr(value)


EVAL_FRACTION = 0.1


def _in_eval_split(key: str, fraction: float = EVAL_FRACTION) -> bool:
    """Deterministic held-out split by a hash of the problem: about `fraction` of all keys,
    and a larger fraction holds out a superset of a smaller one's problems."""
    return zlib.crc32(key.encode()) % 1000 < round(fraction * 1000)


def _split_by_hash(
    prompts: list[Prompt], fraction: float = EVAL_FRACTION
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held out): about `fraction` held out by a hash of the prompt text."""
    held_out = [_in_eval_split(p.text, fraction) for p in prompts]
    train = [p for p, h in zip(prompts, held_out, strict=True) if not h]
    return train, [p for p, h in zip(prompts, held_out, strict=True) if h]


def _no_training(path: str, n: int, split: bool, what: str) -> str:
    """Why a task file gave nothing to train on: empty, or every line held out by the hash."""
    if not n or not split:
        return f"{path}: no training {what} (the file has none)"
    return (
        f"{path}: all {n} {what} fell into the held-out split (task.eval_fraction holds out "
        "a share chosen by a hash of each text): add more, or lower task.eval_fraction"
    )


def _shuffled_epochs(prompts: list[Prompt], seed: int) -> Iterator[Prompt]:
    """An endless stream: every prompt once per epoch, each epoch in a new seeded order."""
    rng = random.Random(seed)
    while True:
        order = list(prompts)
        rng.shuffle(order)
        yield from order


def _repeat_to(items: list[Prompt], n: int, what: str) -> list[Prompt]:
    if n == 0:
        return []
    if not items:
        raise TaskError(
            f"{what} has no held-out prompts for task.eval_prompts={n}: raise "
            "task.eval_fraction or add problems (gsm8k: or give task.eval_path), or set "
            "task.eval_prompts: 0 to evaluate nothing"
        )
    return [items[i % len(items)] for i in range(n)]


# ----------------------------------------------------------------------------- arithmetic


class ArithmeticTask:
    """a op b with operands of up to `difficulty` digits; reward 1 for the exact integer as
    the final number, plus `format_reward` when the response is just that number."""

    chat_template: bool

    def __init__(
        self,
        difficulty: int = 1,
        operations: tuple[str, ...] = ("+", "-", "*"),
        format_reward: float = 0.0,
        seed: int = 0,
        chat_template: bool = True,
        eval_fraction: float = EVAL_FRACTION,
    ) -> None:
        self.name = "arithmetic"
        self.eval_fraction = eval_fraction
        self.high = 10**difficulty
        self.operations = tuple(operations)
        self.format_reward = format_reward
        self.seed = seed
        self.chat_template = chat_template
        eval_count = sum(
            _in_eval_split(self._key(a, op, b), eval_fraction)
            for a in range(min(self.high, 100))
            for b in range(min(self.high, 100))
            for op in self.operations
        )
        if eval_count == 0:
            raise TaskError("arithmetic: this difficulty/operations leave no held-out problems")

    @staticmethod
    def _key(a: int, op: str, b: int) -> str:
        return f"{a}{op}{b}"

    def _prompt(self, a: int, op: str, b: int) -> Prompt:
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Prompt(
            prompt_id=f"arith:{a}{op}{b}",
            text=f"What is {a} {op} {b}? Answer with just the number.",
            answer=str(result),
        )

    def _draw(self, rng: random.Random, held_out: bool) -> Prompt:
        while True:
            a, b = rng.randrange(self.high), rng.randrange(self.high)
            op = rng.choice(self.operations)
            if _in_eval_split(self._key(a, op, b), self.eval_fraction) == held_out:
                return self._prompt(a, op, b)

    def train_prompts(self) -> Iterator[Prompt]:
        rng = random.Random(self.seed)
        while True:
            yield self._draw(rng, held_out=False)

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n == 0:
            return []
        rng = random.Random(f"eval-{self.seed}")
        distinct: dict[str, Prompt] = {}
        for _ in range(50 * max(n, 1)):
            if len(distinct) >= n:
                break
            p = self._draw(rng, held_out=True)
            distinct.setdefault(p.prompt_id, p)
        return _repeat_to(list(distinct.values()), n, "arithmetic")

    def score(self, prompt: Prompt, response: str) -> Score:
        value = extract_final_number(response)
        if value is None:
            return Score(0.0, parsed=False)
        correct = _numbers_equal(value, float(prompt.answer))
        reward = 1.0 if correct else 0.0
        if self.format_reward and re.fullmatch(r"\s*-?\d+\s*\.?\s*", response):
            reward += self.format_reward
        return Score(reward, parsed=True, extracted=format_number(value), correct=correct)


class DigitsTask:
    """A toy task for smoke tests and the tiny model: arithmetic prompts, reward = the share of
    the response's non-space characters that are digits. Even a random model earns partial
    reward, so RL has signal from the first step; accuracy counts all-digit responses."""

    def __init__(self, seed: int = 0, chat_template: bool = False) -> None:
        self._prompts = ArithmeticTask(1, ("+",), 0.0, seed, chat_template)
        self.name = "digits"
        self.chat_template = chat_template

    def train_prompts(self) -> Iterator[Prompt]:
        return self._prompts.train_prompts()

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self._prompts.eval_prompts(n)

    def score(self, prompt: Prompt, response: str) -> Score:
        chars = [c for c in response if not c.isspace()]
        if not chars:
            return Score(0.0, parsed=False)
        return Score(sum(c in "0123456789" for c in chars) / len(chars), parsed=True)


# ----------------------------------------------------------------------------- gsm8k


class GSM8KTask:
    """GSM8K from local JSONL files: {"question": ..., "answer": "... #### 42"} per line."""

    def __init__(
        self,
        path: str,
        eval_path: str | None = None,
        seed: int = 0,
        chat_template: bool = True,
        eval_fraction: float = EVAL_FRACTION,
    ) -> None:
        self.name = "gsm8k"
        self.chat_template = chat_template
        self.seed = seed
        rows = _read_gsm8k(Path(path))
        if eval_path is not None:
            self.train = rows
            self.eval = _read_gsm8k(Path(eval_path))
            trained = {p.text.strip() for p in rows}
            both = [p for p in self.eval if p.text.strip() in trained]
            if both:  # held-out accuracy is then partly training accuracy
                # (a warning, not an error: a published split may repeat a few questions)
                logger.warning(
                    "%s: %d of its %d questions are also in %s (the first at %s): held-out "
                    "accuracy counts them, though they are trained on; remove them from one "
                    "file, or leave task.eval_path unset to hold out task.eval_fraction of "
                    "task.path", eval_path, len(both), len(self.eval), path, both[0].prompt_id,
                )  # fmt: skip
        else:  # hold out a fraction by a hash of the question
            self.train, self.eval = _split_by_hash(rows, eval_fraction)
        if not self.train:
            raise TaskError(_no_training(path, len(rows), eval_path is None, "problems"))

    def train_prompts(self) -> Iterator[Prompt]:
        return _shuffled_epochs(self.train, self.seed)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return _repeat_to(self.eval, n, "gsm8k")

    def score(self, prompt: Prompt, response: str) -> Score:
        value = extract_final_number(response)
        if value is None:
            return Score(0.0, parsed=False)
        correct = _numbers_equal(value, float(prompt.answer))
        return Score(
            1.0 if correct else 0.0, parsed=True, extracted=format_number(value), correct=correct
        )


def _read_gsm8k(path: Path) -> list[Prompt]:
    rows = []
    for line_no, obj in _read_jsonl(path):
        question, answer = obj.get("question"), obj.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str) or "####" not in answer:
            raise TaskError(
                f"{path}:{line_no}: needs a 'question' string and an 'answer' string ending in "
                "'#### <number>'"
            )
        if not question.strip():
            raise TaskError(f"{path}:{line_no}: the question is empty")
        reference = answer.rsplit("####", 1)[1].strip()
        final = extract_final_number(reference)
        if final is None or not _NUMBER.fullmatch(_normalise_number_text(reference)):
            # "#### 1/2" read as 2 (then "3/2" scored right), "#### 5 apples, 6 pears" as 6
            raise TaskError(
                f"{path}:{line_no}: the answer after '####' must be one number (e.g. "
                f"'#### 1,234' or '#### -0.5'), got {reference[:40]!r}"
            )
        rows.append(
            Prompt(
                prompt_id=f"gsm8k:{path.name}:{line_no}", text=question, answer=format_number(final)
            )
        )
    return rows


class _RepeatedKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        # JSON Lines end at "\n" only: str.splitlines() would also split at U+2028, U+0085,
        # form feeds..., which JSON strings may hold unescaped. A byte-order mark is skipped.
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except FileNotFoundError:
        relative = "" if path.is_absolute() else f", relative to the working directory {Path.cwd()}"
        raise TaskError(
            f"{path}: no such file (task data is read from local files{relative})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"{path}: cannot read: {exc}") from None
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.removesuffix("\r"), object_pairs_hook=_once_each)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{path}:{line_no}: not valid JSON: {exc.msg}") from None
        except _RepeatedKey as exc:  # json keeps the last without a word
            raise TaskError(f"{path}:{line_no}: the key {exc.key!r} is given twice") from None
        if not isinstance(obj, dict):
            raise TaskError(f"{path}:{line_no}: expected a JSON object")
        try:  # a \ud83d escape alone decodes to a lone surrogate: no character, no UTF-8
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end]
            raise TaskError(
                f"{path}:{line_no}: a string holds {bad!r}, half of a UTF-16 surrogate pair "
                "(a \\uXXXX escape without its other half), which is no character; write "
                "the character itself, or both halves of its escape"
            ) from None
        yield line_no, obj


# ----------------------------------------------------------------------------- reasoning-gym


class ReasoningGymTask:
    """Any reasoning-gym dataset, scored by its own `score_answer` on the response's last line.
    Training and evaluation draw from different seeds."""

    def __init__(self, dataset: str, seed: int = 0, size: int = 10_000, chat_template: bool = True):
        try:
            import reasoning_gym
        except ImportError:
            raise TaskError(
                f"task reasoning_gym:{dataset} needs reasoning-gym: pip install 'staleflow[tasks]'"
            ) from None
        self.name = f"reasoning_gym:{dataset}"
        self.chat_template = chat_template
        self.seed = seed
        try:
            self.train = reasoning_gym.create_dataset(dataset, seed=seed, size=size)
            self.eval = reasoning_gym.create_dataset(dataset, seed=seed + 1_000_003, size=size)
        except Exception as exc:
            raise TaskError(f"reasoning-gym has no usable dataset {dataset!r}: {exc}") from exc

    def _prompt(self, data: Any, index: int, split: str) -> Prompt:
        entry = data[index]
        return Prompt(
            prompt_id=f"{self.name}:{split}:{index}",
            text=f"{entry['question']}\nGive only the final answer on the last line.",
            answer=str(entry["answer"]),
            metadata={"entry": entry, "split": split},
        )

    def train_prompts(self) -> Iterator[Prompt]:
        rng = random.Random(self.seed)
        while True:
            yield self._prompt(self.train, rng.randrange(len(self.train)), "train")

    def eval_prompts(self, n: int) -> list[Prompt]:
        return [self._prompt(self.eval, i % len(self.eval), "eval") for i in range(n)]

    def score(self, prompt: Prompt, response: str) -> Score:
        lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
        if not lines:
            return Score(0.0, parsed=False)
        data = self.train if prompt.metadata.get("split") == "train" else self.eval
        try:
            reward = float(data.score_answer(answer=lines[-1], entry=prompt.metadata["entry"]))
        except Exception:  # a dataset's scorer choking on odd text is a failed parse
            return Score(0.0, parsed=False)
        if not math.isfinite(reward):  # its fault, not the text's: counted as a reward error
            # (it was scored 0 as a parsed answer, with nothing in any count)
            return Score(0.0, parsed=False, error=f"score_answer returned {reward}")
        return Score(reward, parsed=True, extracted=lines[-1])


# ----------------------------------------------------------------------------- custom


class CustomTask:
    """Prompts from a JSONL file ({"prompt": ..., any metadata}); the reward is
    `reward_fn(metadata: dict, response: str) -> float`, given as 'package.module:function'."""

    def __init__(
        self,
        path: str,
        reward_fn: str,
        seed: int = 0,
        chat_template: bool = True,
        eval_fraction: float = EVAL_FRACTION,
    ):
        self.name = "custom"
        self.chat_template = chat_template
        self.seed = seed
        self.reward_fn = _import_reward(reward_fn)
        prompts = []
        for line_no, obj in _read_jsonl(Path(path)):
            text = obj.get("prompt")
            if not isinstance(text, str):
                raise TaskError(f"{path}:{line_no}: needs a 'prompt' string")
            if not text.strip():
                raise TaskError(f"{path}:{line_no}: the prompt is empty")
            answer = obj.get("answer")
            answer = (
                "" if answer is None else answer if isinstance(answer, str) else json.dumps(answer)
            )
            prompts.append(Prompt(f"custom:{line_no}", text, answer, metadata=obj))
        self.train, self.eval = _split_by_hash(prompts, eval_fraction)
        if not self.train:
            raise TaskError(_no_training(path, len(prompts), True, "prompts"))

    def train_prompts(self) -> Iterator[Prompt]:
        return _shuffled_epochs(self.train, self.seed)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return _repeat_to(self.eval, n, "custom task")

    def score(self, prompt: Prompt, response: str) -> Score:
        try:  # a copy all the way down: a function changing it would change later rewards
            value = self.reward_fn(copy.deepcopy(prompt.metadata), response)
        except (Exception, SystemExit):  # a reward error, not a failed parse: the worker
            # counts and logs it. SystemExit too (a grader calling sys.exit or argparse):
            # uncaught, it ended the worker's process, and each replacement the same way
            return Score(0.0, parsed=False, error=traceback.format_exc(limit=-3))
        try:  # a number (bool, numpy and 0-d tensors too); text is no reward, even "1.0"
            if isinstance(value, str | bytes):
                raise TypeError
            reward = float(value)
        except Exception:  # (OverflowError: an int past a float; any from its __float__)
            return Score(
                0.0, parsed=False,
                error=f"the reward function returned {value!r:.80} ({type(value).__name__}), "
                "not a number",
            )  # fmt: skip
        if not math.isfinite(reward):
            return Score(0.0, parsed=False, error=f"the reward function returned {reward}")
        return Score(reward, parsed=True)


def _import_reward(spec: str) -> Callable[[dict[str, Any], str], float]:
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as exc:
        hint = ""
        if exc.name == module_name.split(".")[0] and Path(f"{exc.name}.py").exists():
            hint = f" ({exc.name}.py is in this directory: run with PYTHONPATH=.)"
        raise TaskError(f"cannot import reward function {spec!r}: {exc}{hint}") from None
    except AttributeError as exc:
        raise TaskError(f"cannot import reward function {spec!r}: {exc}") from None
    except Exception as exc:  # the module itself raised (or does not parse) on import
        raise TaskError(
            f"importing reward function {spec!r} failed: {type(exc).__name__}: {exc} "
            f"({_where(exc)})"
        ) from None
    if not callable(fn):
        raise TaskError(f"reward function {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def _where(exc: BaseException) -> str:
    """file:line where an import failed: a SyntaxError's own, else the innermost frame."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


# ----------------------------------------------------------------------------- factory


def make_task(cfg: Any) -> Task:
    """The task a `TaskConfig` (staleflow.configs.schema) describes."""
    if cfg.name == "arithmetic":
        return ArithmeticTask(
            cfg.difficulty,
            tuple(cfg.operations),
            cfg.format_reward,
            cfg.seed,
            cfg.chat_template,
            cfg.eval_fraction,
        )
    if cfg.name == "digits":
        return DigitsTask(cfg.seed, cfg.chat_template)
    if cfg.name == "gsm8k":
        return GSM8KTask(cfg.path, cfg.eval_path, cfg.seed, cfg.chat_template, cfg.eval_fraction)
    if cfg.name == "custom":
        return CustomTask(cfg.path, cfg.reward_fn, cfg.seed, cfg.chat_template, cfg.eval_fraction)
    if cfg.name.startswith("reasoning_gym:"):
        return ReasoningGymTask(
            cfg.name.split(":", 1)[1], cfg.seed, chat_template=cfg.chat_template
        )
    raise TaskError(f"unknown task {cfg.name!r}")
