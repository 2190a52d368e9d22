"""Tasks and rewards: tricky model output, held-out splits, local data files."""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
import textwrap
from collections import Counter

import pytest

from staleflow.actors.tasks import (
    ArithmeticTask,
    CustomTask,
    GSM8KTask,
    Prompt,
    PromptStream,
    TaskError,
    extract_final_number,
    make_task,
)
from staleflow.configs import ConfigError, parse_config


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12.0", 12.0),
        ("-3", -3.0),
        ("the answer is 7.", 7.0),
        ("3 + 4 = 7", 7.0),
        ("1,234 apples", 1234.0),
        ("answer: \uff17", 7.0),  # full-width digit seven
        ("\u22125", -5.0),  # unicode minus sign
        ("no number here", None),
        ("", None),
        ("7 then 8", 8.0),  # the final number counts
        # a comma only separates thousands: a pair, a list, a decimal comma are other numbers
        ("the point (3,4)", 4.0),
        ("x = 1,2,3", 3.0),
        ("12,5", 5.0),
        ("1,234,567.5 in all", 1234567.5),
        ("1,23", 23.0),
        ("\U0001f600 42 \u00e9", 42.0),
        # a hyphen or a subtraction is no minus sign; a leading decimal point is one
        ("3-5", 5.0),
        ("answer: 42 ... step-2 done", 2.0),
        ("x = -2", -2.0),
        ("(-4)", -4.0),
        ("The answer is .5", 0.5),
        ("-.5", -0.5),
        ("...3", 3.0),
        ("1.5.3", 3.0),
        ("e.g.5", 5.0),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


def arith_prompt(answer: int) -> Prompt:
    return Prompt("arith:x", "What is ...?", str(answer))


@pytest.mark.parametrize(
    ("response", "reward", "parsed"),
    [
        ("12.0", 1.0, True),
        ("The answer is 12.", 1.0, True),
        ("12.5", 0.0, True),
        ("13", 0.0, True),
        ("I don't know", 0.0, False),
        ("\uff11\uff12", 1.0, True),  # full-width 12
        ("x" * 10_000, 0.0, False),
    ],
)
def test_arithmetic_reward(response, reward, parsed):
    score = ArithmeticTask().score(arith_prompt(12), response)
    assert (score.reward, score.parsed) == (reward, parsed)


def test_arithmetic_negative_answer_and_format_term():
    task = ArithmeticTask(format_reward=0.1)
    assert task.score(arith_prompt(-3), "-3").reward == pytest.approx(1.1)  # bare number
    assert task.score(arith_prompt(-3), "It is -3").reward == pytest.approx(1.0)
    assert task.score(arith_prompt(-3), "It is 3").reward == 0.0


def test_arithmetic_prompts_are_seeded_and_held_out_is_disjoint():
    task = ArithmeticTask(difficulty=1, operations=("+",), seed=3)
    train = list(itertools.islice(task.train_prompts(), 500))
    again = list(itertools.islice(ArithmeticTask(1, ("+",), seed=3).train_prompts(), 500))
    assert train == again
    held_out = task.eval_prompts(64)
    assert len(held_out) == 64
    assert {p.prompt_id for p in train}.isdisjoint({p.prompt_id for p in held_out})
    # every answer is right for its question
    for p in train[:50] + held_out[:10]:
        a, _, b = p.text.removeprefix("What is ").split("?")[0].split(" ")
        assert int(p.answer) == int(a) + int(b)


def test_eval_fraction_holds_out_more_distinct_problems_never_trained_on():
    # Single-digit addition has 100 problems; the default split holds out about a tenth.
    def held_out_ids(fraction):
        return {
            p.prompt_id for p in ArithmeticTask(1, ("+",), eval_fraction=fraction).eval_prompts(200)
        }

    small, large = held_out_ids(0.1), held_out_ids(0.3)
    assert 5 <= len(small) <= 15
    assert 25 <= len(large) <= 40
    assert small < large  # a larger fraction holds out a superset
    task = ArithmeticTask(1, ("+",), eval_fraction=0.3)
    trained = {p.prompt_id for p in itertools.islice(task.train_prompts(), 3000)}
    assert trained.isdisjoint(large)
    assert len(trained) + len(large) == 100  # every problem is on exactly one side
    # n = 3 x the held-out count: every held-out problem exactly 3 times
    counts = Counter(p.prompt_id for p in task.eval_prompts(3 * len(large)))
    assert set(counts.values()) == {3}


@pytest.mark.parametrize("fraction", [0.0, 0.6])
def test_eval_fraction_out_of_range_is_refused(fraction):
    with pytest.raises(ConfigError, match="eval_fraction"):
        parse_config("task: {name: arithmetic}", [f"task.eval_fraction={fraction}"])


def test_arithmetic_difficulty_and_operations():
    task = ArithmeticTask(difficulty=3, operations=("*", "-"))
    prompts = list(itertools.islice(task.train_prompts(), 200))
    assert all(("*" in p.text) or (" - " in p.text) for p in prompts)
    operands = [int(x) for p in prompts for x in p.text.split("?")[0].split()[2::2]]
    assert max(operands) >= 100  # three-digit operands occur
    assert max(operands) < 1000


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_a_format_bonus_is_reward_never_accuracy():
    # format_reward pays for a bare number, right or wrong (shaping); held-out accuracy
    # counts right answers only: with a bonus of 1.0, a wrong bare "8" scores 1.0 yet is wrong
    task = ArithmeticTask(format_reward=1.0)
    wrong, right = task.score(arith_prompt(7), "8"), task.score(arith_prompt(7), "It is 7")
    assert (wrong.reward, wrong.is_correct) == (1.0, False)  # 0 for the answer + 1.0 bonus
    assert (right.reward, right.is_correct) == (1.0, True)  # 1 for the answer, no bonus
    assert task.score(arith_prompt(7), "7").reward == 2.0  # both


def test_gsm8k_answers_keep_every_digit(tmp_path):
    # the reference was formatted with %g: 1234567 became 1.23457e+06, a right answer
    # scored 0 and the wrong 1,234,570 scored 1
    rows = [{"question": f"Q{i}", "answer": a} for i, a in
            enumerate(["#### 1234567", "#### 0.1234567", "#### 12,345,678"])]  # fmt: skip
    task = GSM8KTask(str(write_jsonl(tmp_path / "t.jsonl", rows)), eval_path=None)
    prompts = {p.text: p for p in task.train + task.eval}
    assert [prompts[f"Q{i}"].answer for i in range(3)] == ["1234567", "0.1234567", "12345678"]
    big = prompts["Q0"]
    assert task.score(big, "The answer is 1234567").reward == 1.0
    assert task.score(big, "The answer is 1,234,570").reward == 0.0
    assert task.score(big, "1234567").extracted == "1234567"


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    # U+2028 and U+0085 may stand unescaped in a JSON string; a byte-order mark and
    # CRLF line ends are read too; line numbers are the editor's
    path = tmp_path / "p.jsonl"
    body = ['{"prompt": "line1\u2028line2 \u0085 end"}', "", '{"prompt": "second"}']
    path.write_bytes(("\ufeff" + "\r\n".join(body)).encode())
    task = CustomTask(str(path), "staleflow.actors.tasks:extract_final_number", eval_fraction=0)
    assert {p.prompt_id: p.text for p in task.train} == {
        "custom:1": "line1\u2028line2 \u0085 end", "custom:3": "second",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "  "}], r"p\.jsonl:1: the prompt is empty"),
        ([{"prompt": "ok"}, {"prompt": ""}], r"p\.jsonl:2: the prompt is empty"),
    ],
)
def test_empty_prompts_are_refused_at_load(tmp_path, rows, message):
    with pytest.raises(TaskError, match=message):
        CustomTask(str(write_jsonl(tmp_path / "p.jsonl", rows)), "math:fabs")
    rows = [{"question": r.get("prompt"), "answer": "#### 1"} for r in rows]
    with pytest.raises(TaskError, match=message.replace("prompt", "question")):
        GSM8KTask(str(write_jsonl(tmp_path / "p.jsonl", rows)))


def test_what_a_custom_reward_function_returns_and_changes(tmp_path, monkeypatch):
    (tmp_path / "odd_rewards.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def text(meta, response):
                return "1.0"

            def counting(meta, response):
                meta["seen"]["n"] += 1  # changes its argument, nested
                return float(meta["seen"]["n"])

            def numpy_bool(meta, response):
                return np.float32(0.5) if response else True

            def huge(meta, response):
                return 10**400  # an int no float holds: OverflowError, not a worker fault

            def exits(meta, response):  # a grader that parses argv, or calls sys.exit
                import argparse
                argparse.ArgumentParser().add_argument("--k", type=int)
                raise SystemExit(2)

            class Odd:
                def __float__(self):
                    raise RuntimeError("no float here")

            def odd(meta, response):
                return Odd()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "seen": {"n": 0},
                                              "answer": None}])  # fmt: skip
    made = {fn: CustomTask(str(path), f"odd_rewards:{fn}", eval_fraction=0)
            for fn in ("text", "counting", "numpy_bool", "huge", "exits", "odd")}  # fmt: skip
    prompt = made["text"].train[0]
    assert prompt.answer == ""  # null: no answer, not the text 'None'
    score = made["text"].score(prompt, "x")
    assert (score.reward, score.parsed) == (0.0, False)
    assert "returned '1.0' (str), not a number" in score.error
    # the metadata is copied all the way down: the same response scores the same
    assert [made["counting"].score(prompt, "x").reward for _ in range(2)] == [1.0, 1.0]
    assert made["numpy_bool"].score(prompt, "x").reward == 0.5
    huge = made["huge"].score(prompt, "x")
    assert (huge.reward, huge.parsed) == (0.0, False)
    assert "returned 1000000000" in huge.error
    assert "(int), not a number" in huge.error
    assert made["numpy_bool"].score(prompt, "").reward == 1.0
    # scored 0 and counted, like any failure: SystemExit ended the worker's process, and a
    # __float__ raising anything but TypeError/ValueError failed its batch (a fault, redone
    # on a new worker rollout.max_restarts times before the run stopped)
    exits = made["exits"].score(prompt, "x")
    assert (exits.reward, exits.parsed) == (0.0, False)
    assert "SystemExit: 2" in exits.error
    odd = made["odd"].score(prompt, "x")
    assert (odd.reward, odd.parsed) == (0.0, False)
    assert "(Odd), not a number" in odd.error
    sys.modules.pop("odd_rewards", None)


def test_asking_for_no_held_out_prompts_gets_none(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    custom = CustomTask(str(path), "math:fabs", eval_fraction=0)  # no held-out prompts
    assert custom.eval_prompts(0) == []
    with pytest.raises(TaskError, match=r"no held-out prompts .*task\.eval_fraction"):
        custom.eval_prompts(1)
    assert ArithmeticTask().eval_prompts(0) == []


def test_gsm8k_reads_local_jsonl_and_scores_final_numbers(tmp_path):
    rows = [{"question": f"Q{i}: how many?", "answer": f"work...\n#### {i},000"} for i in range(40)]
    task = GSM8KTask(str(write_jsonl(tmp_path / "train.jsonl", rows)))
    assert task.train  # split by a hash of the question
    assert task.eval
    assert {p.text for p in task.train}.isdisjoint({p.text for p in task.eval})
    prompt = task.train[0]
    i = int(prompt.text[1 : prompt.text.index(":")])
    assert prompt.answer == str(i * 1000)
    assert task.score(prompt, f"So she has ${i},000.00 left.").reward == 1.0
    assert task.score(prompt, str(i * 1000 + 1)).reward == 0.0
    assert not task.score(prompt, "lots").parsed


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (['{"question": "q", "answer": "#### 1"}', "{not json"], r"train.jsonl:2: not valid JSON"),
        ([{"question": "q", "answer": "no marker"}], r"train.jsonl:1: needs .*'#### <number>'"),
        (
            [{"question": "q", "answer": "#### many"}],
            r"train.jsonl:1: the answer after '####' must be one number .* got 'many'",
        ),
        # read as the last number, these made a wrong answer right ("3/2" scored 1 for 1/2)
        ([{"question": "q", "answer": "#### 1/2"}], r"must be one number .* got '1/2'"),
        ([{"question": "q", "answer": "#### 5 apples, 6 pears"}], r"got '5 apples, 6 pears'"),
        (['{"question": "q \\ud83d", "answer": "#### 1"}'], r"train.jsonl:1: .*'\\ud83d', half"),
        # json keeps the last of two equal keys: the line was read as answer 2, silently
        (
            ['{"question": "q", "answer": "#### 1", "answer": "#### 2"}'],
            r"train.jsonl:1: the key 'answer' is given twice",
        ),
    ],
)
def test_gsm8k_broken_lines_name_file_and_line(tmp_path, rows, message):
    with pytest.raises(TaskError, match=message):
        GSM8KTask(str(write_jsonl(tmp_path / "train.jsonl", rows)))


def test_gsm8k_missing_file(tmp_path, monkeypatch):
    with pytest.raises(TaskError, match=r"nope.jsonl: no such file \(task data is read from "
                       r"local files\)"):  # fmt: skip
        GSM8KTask(str(tmp_path / "nope.jsonl"))
    monkeypatch.chdir(tmp_path)  # a relative path: where it was looked for
    with pytest.raises(TaskError, match=f"relative to the working directory {tmp_path}"):
        GSM8KTask("nope.jsonl")


def test_custom_task_reward_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(
        textwrap.dedent(
            """
            def length_match(meta, text):
                if "boom" in text:
                    raise RuntimeError("the user's function failed")
                return float(len(text.strip()) == meta["n"])
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": f"Say {n} letters, #{i}", "n": n} for i, n in enumerate(range(1, 40))]
    task = CustomTask(str(write_jsonl(tmp_path / "p.jsonl", rows)), "myrewards:length_match")
    prompt = task.train[0]
    assert task.score(prompt, "x" * prompt.metadata["n"]).reward == 1.0
    failed = task.score(prompt, "boom")  # never raises: a reward error, with its traceback
    assert (failed.reward, failed.parsed) == (0.0, False)
    assert "RuntimeError: the user's function failed" in failed.error
    assert "myrewards.py" in failed.error
    assert task.score(prompt, "x").error is None
    sys.modules.pop("myrewards", None)


def test_custom_task_bad_import_path(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    with pytest.raises(TaskError, match=r"cannot import reward function 'no\.such:fn'"):
        CustomTask(str(path), "no.such:fn")


def test_make_task_from_config():
    cfg = parse_config(
        "model: {preset: tiny}\ntask: {name: arithmetic, difficulty: 2, operations: ['-']}\n"
    )
    task = make_task(cfg.task)
    assert isinstance(task, ArithmeticTask)
    assert " - " in next(task.train_prompts()).text


def test_reasoning_gym_task_scores_with_the_datasets_own_scorer():
    cfg = parse_config("model: {preset: tiny}\ntask: {name: 'reasoning_gym:basic_arithmetic'}\n")
    task = make_task(cfg.task)
    prompt = next(task.train_prompts())
    assert prompt.text.endswith("Give only the final answer on the last line.")
    assert task.score(prompt, f"Working...\n{prompt.answer}").reward == 1.0
    assert task.score(prompt, "").parsed is False
    held_out = task.eval_prompts(3)
    assert all(p.prompt_id.startswith("reasoning_gym:basic_arithmetic:eval:") for p in held_out)
    assert task.score(held_out[0], held_out[0].answer).reward == 1.0


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_reasoning_gym_scorer_giving_no_finite_number_is_a_reward_error(monkeypatch, value):
    # It was scored 0 as a parsed answer: in no count, so a scorer broken for every response
    # trained on zeros without a word. A scorer that raises stays a failed parse.
    cfg = parse_config("model: {preset: tiny}\ntask: {name: 'reasoning_gym:basic_arithmetic'}\n")
    task = make_task(cfg.task)
    prompt = next(task.train_prompts())
    monkeypatch.setattr(task.train, "score_answer", lambda answer, entry: value)
    score = task.score(prompt, f"Working...\n{prompt.answer}")
    assert (score.reward, score.parsed) == (0.0, False)
    assert score.error == f"score_answer returned {value}"

    def raises(answer, entry):
        raise ValueError("odd text")

    monkeypatch.setattr(task.train, "score_answer", raises)
    score = task.score(prompt, "Working...\nnot a number")
    assert (score.reward, score.parsed, score.error) == (0.0, False, None)


def test_reasoning_gym_unknown_dataset():
    with pytest.raises(TaskError, match="no usable dataset 'no_such_thing'"):
        make_task(
            parse_config(
                "model: {preset: tiny}\ntask: {name: 'reasoning_gym:no_such_thing'}\n"
            ).task
        )


def test_digits_reward_is_the_share_of_digit_characters():
    from staleflow.actors.tasks import DigitsTask

    task = DigitsTask()
    prompt = next(task.train_prompts())
    assert task.score(prompt, "42").reward == 1.0  # 2 of 2 characters are digits
    assert task.score(prompt, "4 2 ab").reward == 0.5  # spaces ignored: 2 of 4
    assert task.score(prompt, "a1b").reward == 1 / 3  # 1 of 3
    empty = task.score(prompt, "   ")
    assert (empty.reward, empty.parsed) == (0.0, False)
    assert task.eval_prompts(4)[0].prompt_id not in {
        p.prompt_id for p in itertools.islice(task.train_prompts(), 200)
    }


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("raise RuntimeError('no API key in the environment')\n",
         r"RuntimeError: no API key in the environment \(.*badrew_raise\.py:1\)"),
        ("def fn(meta, text)\n    return 1.0\n", r"SyntaxError: .*\(.*badrew_syntax\.py:1\)"),
    ],
    ids=["raises", "syntax"],
)  # fmt: skip
def test_a_reward_module_that_fails_on_import_is_named_with_its_line(
    tmp_path, monkeypatch, source, error
):
    # any import failure, not just ImportError: it used to escape as a traceback
    name = "badrew_" + ("raise" if "raise" in source else "syntax")
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    with pytest.raises(TaskError, match=rf"importing reward function '{name}:fn' failed: {error}"):
        CustomTask(str(path), f"{name}:fn")
    sys.modules.pop(name, None)


def test_a_reward_module_in_the_working_directory_but_not_on_the_path_says_so(
    tmp_path, monkeypatch
):
    (tmp_path / "myrew_here.py").write_text("def fn(meta, text):\n    return 1.0\n")
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        TaskError, match=r"myrew_here\.py is in this directory: run with PYTHONPATH=\."
    ):
        CustomTask(str(path), "myrew_here:fn")


def test_the_prompt_stream_digest_sees_every_field_and_only_the_fields():
    class Thing:  # no __eq__: its repr holds its address, different in every process
        pass

    def stream(meta_b):
        prompts = [
            Prompt("a", "1+1", "2", {"k": {3, 1}, "o": Thing()}),
            Prompt("b", "2", "4", meta_b),
        ]
        s = PromptStream(iter(prompts))
        return s, s.take(5)  # the stream ends at 2

    s1, took = stream({"x": 1, "y": [1, 2]})
    assert s1.taken == 2
    assert [p.prompt_id for p in took] == ["a", "b"]
    s2, _ = stream({"y": [1, 2], "x": 1})  # another object, the keys in another order
    assert s2.digest == s1.digest
    for changed in ({"x": 2, "y": [1, 2]}, {"x": 1, "y": [2, 1]}, {"x": 1}):
        assert stream(changed)[0].digest != s1.digest, changed
    empty = PromptStream(iter([]))
    assert empty.take(3) == []
    assert empty.taken == 0
    assert empty.digest != s1.digest


def test_a_gsm8k_eval_file_that_repeats_training_questions_is_named(tmp_path, caplog):
    # the held-out accuracy of such a run is (partly) training accuracy, and nothing said so
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"question": f"Q{i}", "answer": f"#### {i}"} for i in range(5)]
    )
    held = write_jsonl(
        tmp_path / "test.jsonl", [{"question": q, "answer": "#### 1"} for q in ("New one", " Q3 ")]
    )
    GSM8KTask(str(train), eval_path=str(held))
    assert re.search(r"test.jsonl: 1 of its 2 questions are also in .*train.jsonl \(the first "
                     r"at gsm8k:test.jsonl:2\)", caplog.text)  # fmt: skip
    caplog.clear()
    write_jsonl(held, [{"question": "New one", "answer": "#### 1"}])
    assert [p.text for p in GSM8KTask(str(train), eval_path=str(held)).eval] == ["New one"]
    assert "also in" not in caplog.text


def test_a_long_extracted_answer_is_cut_to_fit_the_record():
    # a reasoning-gym answer is the response's whole last line: one over the buffer's
    # 4096-character limit failed the batch's push on every redo
    from staleflow.actors.tasks import EXTRACTED_CHARS, Score
    from staleflow.buffer.codec import encode
    from staleflow.buffer.records import Group, Response

    meta = Score(1.0, parsed=True, extracted="9" * 5000).metadata()
    assert meta["parsed"] is True
    assert meta["extracted"] == "9" * (EXTRACTED_CHARS - 1) + "\u2026"
    assert Score(0.0, parsed=True, extracted="42").metadata()["extracted"] == "42"
    group = Group.new(run_id="r", prompt_id="p", task="t", prompt_token_ids=[1],
                      responses=[Response([4], [-0.1], 1.0, metadata=meta)], policy_version=0,
                      worker_id="w")  # fmt: skip
    assert encode(group)


def test_a_file_whose_every_prompt_is_held_out_says_so(tmp_path):
    # it said "no training prompts" of a file that has one
    from staleflow.actors.tasks import _in_eval_split

    text = next(t for t in (f"question {i}" for i in range(200)) if _in_eval_split(t, 0.5))
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": text}])
    with pytest.raises(TaskError, match=r"c.jsonl: all 1 prompts fell into the held-out split "
                       r".*lower task.eval_fraction"):  # fmt: skip
        CustomTask(str(path), "tests.integration.rewards:length", eval_fraction=0.5)
    write_jsonl(path, [])
    with pytest.raises(TaskError, match=r"c.jsonl: no training prompts \(the file has none\)"):
        CustomTask(str(path), "tests.integration.rewards:length", eval_fraction=0.5)
