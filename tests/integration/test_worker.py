"""The rollout worker: in-process, and end to end as a Ray actor pushing into real Redis."""

from __future__ import annotations

import json

import numpy as np
import pytest

from staleflow.actors.models import tiny_model
from staleflow.actors.worker import RolloutWorker, VersionMismatchError
from staleflow.buffer.replay import ReplayBuffer
from staleflow.configs import parse_config

pytestmark = pytest.mark.integration

CONFIG = """
model: {preset: tiny}
task: {name: arithmetic, operations: ["+"], chat_template: false, eval_prompts: 8}
rollout: {num_workers: 1, prompts_per_batch: 3, group_size: 4, max_new_tokens: 6}
"""


def tiny_weights(seed: int) -> dict[str, np.ndarray]:
    model, _ = tiny_model(seed)
    return {name: t.detach().numpy() for name, t in model.state_dict().items()}


def test_batch_builds_one_group_per_prompt_with_k_scored_responses(redis_url):
    cfg = parse_config(CONFIG)
    worker = RolloutWorker(cfg, run_id="run", redis_url=redis_url)
    report = worker.run_batch(policy_version=0)
    assert (report.groups, report.responses, report.pushed) == (3, 12, 3)
    assert report.tokens > 0
    assert report.tokens_per_s > 0
    taken = ReplayBuffer(redis_url, "run").take(10, learner_version=0)
    assert len(taken.groups) == 3
    assert report.parse_failures == sum(not m["parsed"] for g in taken.groups for m in g.metadata)
    for g in taken.groups:
        assert g.k == 4
        assert g.policy_version == 0
        assert g.worker_id == "run-w0"
        assert g.task == "arithmetic"
        assert np.isfinite(g.behavior_logp).all()
        assert (g.behavior_logp <= 0).all()
        assert set(g.finish_reasons) <= {"stop", "length"}
        # each reward is 1 exactly when the number read from the response is a + b
        a, b = map(int, g.prompt_id.removeprefix("arith:").split("+"))
        for reward, meta in zip(g.rewards.tolist(), g.metadata, strict=True):
            read = meta["extracted"]
            assert reward == (1.0 if read is not None and float(read) == a + b else 0.0)
            assert meta["parsed"] == (read is not None)


def test_version_is_enforced_and_changes_only_between_batches():
    cfg = parse_config(CONFIG)
    worker = RolloutWorker(cfg, run_id="run")
    with pytest.raises(
        VersionMismatchError, match="has policy version 0 loaded but was asked for 1"
    ):
        worker.run_batch(policy_version=1)
    assert worker.load_weights(tiny_weights(seed=3), version=1) == 1
    assert worker.run_batch(policy_version=1).policy_version == 1


def test_a_load_that_fails_partway_leaves_no_version_to_sample_or_evaluate_with(ray_local):
    # The update's last array has a wrong shape: every array before it was already copied,
    # so the engine holds a mix of v0 and v1. It used to keep saying v0: a batch at v0 ran
    # on the mix, tagged v0, and an evaluation retried without a load graded the mix.
    from staleflow.actors.worker import WeightLoadError
    from staleflow.learner.publish import RayPublisher

    cfg = parse_config(CONFIG)
    worker = RolloutWorker(cfg, run_id="run")
    bad = tiny_weights(seed=3)
    last = list(bad)[-1]
    bad[last] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=f"parameter '{last}': got shape"):
        worker.load_weights(bad, version=1)
    assert worker.version == -1
    with pytest.raises(VersionMismatchError, match="has policy version -1 loaded"):
        worker.run_batch(policy_version=0)
    with pytest.raises(VersionMismatchError, match="a weight load failed partway"):
        worker.evaluate(n_prompts=2)
    # a handle's load (as the driver sends) fails alike; a good load makes it whole again
    with pytest.raises(WeightLoadError):
        worker.load_published(RayPublisher().publish(bad, version=1))
    assert worker.version == -1
    assert worker.load_published(RayPublisher().publish(tiny_weights(seed=3), 1)) == 1
    assert worker.evaluate(n_prompts=2).policy_version == 1
    # a bad first array changes nothing: the version stays
    first = next(iter(bad))
    with pytest.raises(ValueError, match=f"parameter '{first}'"):
        worker.load_weights({first: np.zeros((3, 3), np.float32)}, version=2)
    assert worker.version == 1


def test_a_load_whose_second_array_cannot_be_made_leaves_no_version():
    # An update whose arrays come bucket by bucket (ray, ipc, broadcast) fails while making
    # the second bucket's first array, after the first bucket's one array was copied in (a
    # first tensor larger than sync.bucket_mb is alone in its bucket). The version was set
    # to -1 only once that second array was handed over, so the engine kept saying v0 over
    # v1's embedding: a v0 batch ran on the mix, tagged v0.
    cfg = parse_config(CONFIG)
    worker = RolloutWorker(cfg, run_id="run")
    new = tiny_weights(seed=3)
    first = next(iter(new))

    def buckets():
        yield first, new[first]
        raise OSError("fetching bucket 2 failed")

    with pytest.raises(OSError, match="bucket 2"):
        worker.load_weights(buckets(), version=1)
    assert np.array_equal(worker.engine._params[first].detach().numpy(), new[first])
    assert worker.version == -1
    with pytest.raises(VersionMismatchError, match="has policy version -1 loaded"):
        worker.run_batch(policy_version=0)


def test_evaluate_reports_held_out_accuracy():
    cfg = parse_config(CONFIG)
    worker = RolloutWorker(cfg, run_id="run")
    report = worker.evaluate(n_prompts=8, temperature=0.0)
    assert report.prompts == 8
    # more prompts than held-out problems: the problems repeat, and the report says how
    # many are distinct (`eval --prompts 128` on the quickstart scored 34 problems as "128")
    held_out = {p.prompt_id for p in worker.task.eval_prompts(10_000)}
    assert worker.evaluate(n_prompts=8).problems == min(8, len(held_out))
    many = worker.evaluate(n_prompts=len(held_out) + 5)
    assert (many.prompts, many.problems) == (len(held_out) + 5, len(held_out))
    assert report.temperature == 0.0
    assert len(report.examples) == 3
    again = worker.evaluate(n_prompts=8, temperature=0.0)  # greedy: the same answers
    assert (again.accuracy, again.reward_mean, again.examples) == (
        report.accuracy, report.reward_mean, report.examples,
    )  # fmt: skip
    train_ids = {p.prompt_id for p in worker.next_prompts(200)}
    assert train_ids.isdisjoint({p.prompt_id for p in worker.task.eval_prompts(8)})


def test_evaluate_accuracy_is_the_fraction_of_held_out_samples_scored_correct(tmp_path):
    # a custom task whose reward is each prompt's own `expect`: the accuracy is known in
    # advance from the held-out prompts, whatever the tiny model answers
    lines = [{"prompt": f"question {i}", "expect": [1, 0, 0.5][i % 3]} for i in range(40)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = parse_config(CONFIG, [
        "task.name=custom", f"task.path={tmp_path / 't.jsonl'}", "task.eval_fraction=0.5",
        "task.reward_fn=tests.integration.rewards:expected",
    ])  # fmt: skip
    worker = RolloutWorker(cfg, run_id="run")
    held_out = worker.task.eval_prompts(8)
    expects = [p.metadata["expect"] for p in held_out]
    assert 0 < expects.count(1) < 8  # the hash split holds out some of each kind
    report = worker.evaluate(n_prompts=8, temperature=0.0)
    assert report.accuracy == expects.count(1) / 8  # reward >= 1 is correct; 0.5 is not
    assert report.reward_mean == pytest.approx(sum(expects) / 8)


def test_two_workers_draw_different_prompts():
    cfg = parse_config(CONFIG)
    a = RolloutWorker(cfg, run_id="run", worker_index=0)
    b = RolloutWorker(cfg, run_id="run", worker_index=1, engine=a.engine, tokenizer=a.tokenizer)
    assert [p.prompt_id for p in a.next_prompts(20)] != [p.prompt_id for p in b.next_prompts(20)]


def test_worker_as_a_ray_actor_pushes_into_redis(ray_actors, redis_url):
    import ray

    cfg = parse_config(CONFIG)
    actor = ray_actors(
        ray.remote(RolloutWorker)
        .options(num_cpus=1)
        .remote(cfg, run_id="ray-run", worker_index=2, redis_url=redis_url)
    )
    first = ray.get(actor.run_batch.remote(0), timeout=120)
    assert first.pushed == 3
    assert first.worker_id == "ray-run-w2"
    # new weights arrive as numpy arrays (as through the object store), between batches
    assert ray.get(actor.load_weights.remote(tiny_weights(seed=7), 1), timeout=60) == 1
    second = ray.get(actor.run_batch.remote(1), timeout=120)
    assert second.policy_version == 1
    with pytest.raises(ray.exceptions.RayTaskError, match="VersionMismatchError"):
        ray.get(actor.run_batch.remote(0), timeout=60)
    taken = ReplayBuffer(redis_url, "ray-run").take(10, learner_version=1)
    assert sorted(g.policy_version for g in taken.groups) == [0, 0, 0, 1, 1, 1]
    assert {g.worker_id for g in taken.groups} == {"ray-run-w2"}


def _custom_worker(tmp_path, monkeypatch, body: str, *overrides: str) -> RolloutWorker:
    import json
    import sys
    import textwrap

    (tmp_path / "chaosrewards.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("chaosrewards", None)
    rows = [{"prompt": f"Say something #{i}"} for i in range(40)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config(
        "model: {preset: tiny}\n"
        f"task: {{name: custom, path: '{tmp_path / 'p.jsonl'}', reward_fn: 'chaosrewards:fn', "
        "chat_template: false, eval_prompts: 0}\n"
        "rollout: {prompts_per_batch: 4, group_size: 5, max_new_tokens: 4}\n",
        list(overrides),
    )
    return RolloutWorker(cfg, run_id="run")


def test_reward_errors_are_counted_logged_once_and_stop_the_batch_past_the_limit(
    tmp_path, monkeypatch, caplog
):
    from staleflow.actors.worker import RewardError

    # raises on every 10th call: 2 of a batch's 20 responses
    body = """
        calls = 0
        def fn(meta, text):
            global calls
            calls += 1
            if calls % 10 == 0:
                raise KeyError("answer")
            return 1.0
        """
    worker = _custom_worker(tmp_path, monkeypatch, body, "task.max_reward_errors=0.1")
    with caplog.at_level("ERROR"):
        report = worker.run_batch(policy_version=0)
        worker.run_batch(policy_version=0)
    assert report.reward_errors == 2  # 2 of 20 = 0.1: at the limit, the batch goes on
    assert report.parse_failures == 0  # a reward error is not a failed parse
    assert report.reward_mean == pytest.approx(18 / 20)  # the two score 0
    logged = [r for r in caplog.records if "the reward function failed" in r.getMessage()]
    assert len(logged) == 1  # the first traceback, once
    assert "KeyError: 'answer'" in logged[0].getMessage()

    strict = _custom_worker(tmp_path, monkeypatch, body, "task.max_reward_errors=0.05")
    with pytest.raises(RewardError, match=r"(?s)failed for 2 of 20 responses.*KeyError: 'answer'"):
        strict.run_batch(policy_version=0)


def test_a_part_of_a_drivers_batch_is_judged_against_the_whole_batch(tmp_path, monkeypatch):
    from staleflow.actors.worker import RewardError

    # A batch of 4 prompts x 5 responses, limit 0.25: 5 failures of its 20 are allowed. A
    # part of one prompt failing for all 5 of its responses stopped the run (5 > 0.25 * 5)
    # when two or more workers shared the batch; now it goes on, and the driver adds the
    # parts up (Rollouts.finished). A part that alone has more than the batch may stop it.
    body = """
        def fn(meta, text):
            raise KeyError("answer")
        """
    worker = _custom_worker(tmp_path, monkeypatch, body, "task.max_reward_errors=0.25")
    report = worker.run_batch(0, worker.next_prompts(1), ids=(1, 0))
    assert (report.reward_errors, report.responses) == (5, 5)
    assert report.first_reward_error is not None
    assert "KeyError: 'answer'" in report.first_reward_error
    with pytest.raises(RewardError, match=r"failed for 10 of 10 responses \(a part of a "
                       r"batch of 20, whose limit that already passes\)"):  # fmt: skip
        worker.run_batch(0, worker.next_prompts(2), ids=(1, 1))


def test_a_batch_quotes_its_own_first_reward_error(tmp_path, monkeypatch):
    from staleflow.actors.worker import RewardError

    # the first batch fails once (allowed), the second for every response: its error names
    # its own failure, not the first batch's (the first error was kept for the worker's life)
    body = """
        calls = 0
        def fn(meta, text):
            global calls
            calls += 1
            if calls == 1:
                raise KeyError("first batch")
            if calls > 20:
                raise ValueError("second batch")
            return 1.0
        """
    worker = _custom_worker(tmp_path, monkeypatch, body, "task.max_reward_errors=0.1")
    assert worker.run_batch(policy_version=0).reward_errors == 1
    with pytest.raises(RewardError, match=r"(?s)failed for 20 of 20.*ValueError: second batch"):
        worker.run_batch(policy_version=0)


def test_held_out_evaluation_counts_reward_errors_and_stops_past_the_limit(tmp_path, monkeypatch):
    from staleflow.actors.worker import RewardError

    # the reward function fails for the prompts ending in 0 or 5: evaluation used to fold
    # them into parse_failures, silently
    body = """
        def fn(meta, text):
            if meta["prompt"][-1] in "05":
                raise KeyError("answer")
            return 1.0
        """
    worker = _custom_worker(tmp_path, monkeypatch, body, "task.max_reward_errors=0.5",
                            "task.eval_fraction=0.5")  # fmt: skip
    report = worker.evaluate(n_prompts=20)
    held_out = worker.task.eval_prompts(20)
    failing = sum(p.text[-1] in "05" for p in held_out)
    assert 0 < failing <= 10  # (the held-out half of 40 prompts, by hash)
    assert report.reward_errors == failing
    assert report.parse_failures == 0
    assert report.accuracy == pytest.approx(1 - failing / 20)
    strict = _custom_worker(tmp_path, monkeypatch, body, "task.max_reward_errors=0",
                            "task.eval_fraction=0.5")  # fmt: skip
    with pytest.raises(RewardError, match=rf"failed for {failing} of 20 responses"):
        strict.evaluate(n_prompts=20)


def test_a_chat_template_asked_for_but_missing_is_an_error_not_raw_text():
    from staleflow.actors.models import ModelError, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None  # a base model's tokenizer
    cfg = parse_config(CONFIG, ["task.chat_template=true"])
    worker = RolloutWorker(cfg, run_id="run")  # the tiny preset has one
    with pytest.raises(ModelError, match=r"task\.chat_template is true, but the tokenizer .* "
                       r"has no chat template: set task\.chat_template: false"):  # fmt: skip
        RolloutWorker(cfg, run_id="run", engine=worker.engine, tokenizer=tokenizer)


def test_a_prompt_longer_than_the_context_is_refused_naming_it_and_the_fix():
    from staleflow.actors.tasks import Prompt
    from staleflow.actors.worker import PromptTooLongError

    worker = RolloutWorker(parse_config(CONFIG), run_id="run")
    assert worker.engine.context_length == 256  # the tiny model's n_positions
    long = Prompt("long:1", "1+1 " * 200, "2")
    with pytest.raises(
        PromptTooLongError,
        match=r"prompt long:1 is \d+ tokens; with rollout.max_new_tokens=6 that exceeds the "
        r"model's context of 256 tokens\. Shorten or remove",
    ):
        worker.run_batch(policy_version=0, prompts=[long])


def test_an_evaluation_failing_as_it_would_again_is_not_retried_and_says_why(ray_local, caplog):
    # a held-out set the task cannot give: the worker raises TaskError inside Ray. The log
    # said only "failed (RayTaskError(TaskError)); retrying", then ran it again to fail again
    import ray

    from staleflow.actors.tasks import TaskError
    from staleflow.cluster.evaluations import Evaluations
    from staleflow.cluster.placement import WorkerSlot

    @ray.remote
    def evaluate(fail_with: str) -> object:
        if fail_with == "old weights":  # a report of another version than the step's
            from types import SimpleNamespace

            return SimpleNamespace(policy_version=2, accuracy=0.5)
        if fail_with == "task":
            raise TaskError("custom task has no held-out prompts for task.eval_prompts=64")
        raise ConnectionError("the worker's node went away")

    class Pool:  # the one part faked: which "worker" runs the evaluation
        def __init__(self) -> None:
            self.active, self.calls, self.unknown = [WorkerSlot(0, "w0")], [], []

        def evaluate(self, worker, weights, prompts):
            self.calls.append(weights)
            return evaluate.remote(weights)

        def version_unknown(self, worker):  # a failed call: its next one loads weights
            self.unknown.append(worker.handle)

        def ended(self, worker, ref):
            pass

    for cause, retried in [("task", False), ("node", True), ("old weights", True)]:
        pool = Pool()
        evaluations = Evaluations(pool, prompts=64)
        evaluations.start(3, cause)
        ref = evaluations.refs[0]
        ray.wait([ref])
        with caplog.at_level("WARNING"):
            caplog.clear()
            step, report = evaluations.finished(ref, {3: cause})
        assert (step, report) == (3, None)
        assert pool.calls == [cause] * (2 if retried else 1)
        assert pool.unknown == ["w0"]
        message = caplog.records[-1].getMessage()
        if cause == "old weights":  # never recorded as step 3's accuracy
            assert "the evaluation of step 3 ran on weights v2; retrying" in message
        elif retried:
            assert "ConnectionError: the worker's node went away; retrying" in message
        else:
            assert "TaskError: custom task has no held-out prompts" in message
            assert message.endswith("; skipped")


def test_shutdown_waits_for_a_hung_evaluation_no_longer_than_a_batch(ray_local, caplog):
    # The driver's drain waited for every evaluation in flight with no limit: one hung in
    # its reward function or engine held the run's shutdown forever.
    from types import SimpleNamespace

    import ray

    from staleflow.cluster.driver import Driver
    from staleflow.cluster.evaluations import Evaluations
    from staleflow.cluster.placement import WorkerSlot

    @ray.remote
    def hung_evaluation() -> None:
        import time

        time.sleep(120)

    class Pool:  # the one part faked: which "worker" runs the evaluation
        active = (WorkerSlot(0, "w0"),)

        def evaluate(self, worker, weights, prompts):
            return hung_evaluation.remote()

    driver = Driver.__new__(Driver)  # only the drain
    driver.cfg = parse_config(CONFIG, ["rollout.batch_timeout_s=1"])
    driver.learning = None
    driver.evaluations = Evaluations(Pool(), prompts=8)
    driver.evaluations.start(3, None)
    driver.rollouts = SimpleNamespace(shards={}, abandon=lambda: None)
    ref = driver.evaluations.refs[0]
    with caplog.at_level("WARNING"):
        driver._drain()
    ray.cancel(ref, force=True)
    assert driver.evaluations.running == []
    assert "1 evaluation(s) still running after rollout.batch_timeout_s=1 s" in caplog.text
