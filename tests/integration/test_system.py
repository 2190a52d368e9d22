"""The whole system with the tiny model: real Ray, real Redis, real DeepSpeed.

In-process runs share the session's Ray (the `ray_local` fixture); the runs that test the
command line, scaling and Ctrl-C start `staleflow train` as a process of its own, which starts
and stops its own Ray and Redis.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from staleflow.actors.tasks import make_task
from staleflow.cluster.rundir import read_metrics
from staleflow.cluster.schedule import ScheduleError, check_schedule, lag, rollout_version
from staleflow.configs import parse_config
from tests.integration.procs import clean_env, staleflow
from tests.integration.tiny import ONE_WORKER, TINY, run_driver, steps_of

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def ctrl_c(proc, sig: int = signal.SIGINT) -> str:
    """Stop a running `staleflow train` as a user would (the step in flight finishes, then
    checkpoint, summary, shutdown), or as a scheduler would (SIGTERM); its output."""
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
    return out


def interrupted_summary(run: Path, out: str) -> dict:
    """The summary of a run stopped with Ctrl-C, which must say so and reconcile."""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted", out[-3000:]
    assert_reconciled(summary)
    return summary


def assert_reconciled(summary):
    g = summary["groups"]
    assert g["reconciled"], g
    assert (
        g["pushed"]
        == g["trained"] + g["dropped_stale"] + g["dropped_invalid"] + g["left_in_buffer"]
    )
    assert summary["driver_counts"]["trained"] == g["trainings"]


def assert_secret_in_no_file(run_dir, secret: str) -> None:
    """`secret` (a Redis password) is in no text file of the run: config, checkpoint, logs,
    summary, report."""
    assert secret
    for path in Path(run_dir).rglob("*"):
        if path.is_file() and path.suffix in {".json", ".jsonl", ".log", ".html"}:
            assert secret not in path.read_text(errors="replace"), path


# ----------------------------------------------------------------------------- lockstep


# Both settings split each batch over two workers (its parts may finish in either order).
# Other settings are not repeated here: (1, 0) is the default schedule of most runs of the
# suite, (1, 1) that of the chaos run (two workers) and of the resume tests, (2, 0) the gloo
# broadcast test's, (1, 2) and (1, 3) the ipc and checkpoint methods' tests', and the driver
# checks every lock-step step's lag against the formula (Schedule.check_lag).
@pytest.mark.parametrize(
    ("interval", "offset"),
    [(4, 10), (20, 1)],
    ids=lambda v: str(v),
)
def test_lockstep_lag_of_every_step_equals_the_formula(tmp_path, ray_local, interval, offset):
    # 22 steps cover a full I=20 cycle and its wrap, and O=10's switch to a constant lag.
    # The offline setting (every batch from the initial policy) is checked by the sweep
    # test's two offline cells (tests/integration/test_study.py): lags, versions and counts
    # over 4 steps of one optimizer step each (no 22-step offline run at mini_batches x
    # epochs = 4 is made). (The schedule's whole I x O grid, on-policy to
    # offline, is checked without Ray in tests/unit/test_schedule.py; each setting here is a
    # whole run, about 15 s alone.)
    # mini_batches x epochs = 4 optimizer steps per batch: the policy version still counts
    # batches, so every version the schedule asks for is published and the lags are exact.
    # (With one optimizer step per batch, every lock-step run checks the same: the driver
    # stops a run whose step has another lag, Schedule.check_lag.)
    steps = 22
    _cfg, _run, summary, records = run_driver(
        tmp_path,
        "sync.mode=lockstep",
        f"sync.interval={interval}",
        f"sync.offset={offset}",
        f"run.steps={steps}",
        "learner.mini_batches=2",
        "learner.epochs=2",
        "rollout.num_workers=2",
    )
    assert summary["status"] == "completed"
    got = [(r["step"], r["lag_min"], r["lag_max"]) for r in steps_of(records)]
    want = [(t, lag(t, interval, offset), lag(t, interval, offset)) for t in range(1, steps + 1)]
    assert got == want
    versions = {r["policy_version"] for r in records if r["kind"] == "rollout"}
    assert versions == {rollout_version(e, interval, offset) for e in range(1, steps + 1)}
    assert_reconciled(summary)
    # with two workers, every batch was split over both
    by_batch: dict[int, set[int]] = {}
    for r in records:
        if r["kind"] == "rollout":
            by_batch.setdefault(r["batch"], set()).add(r["worker"])
    assert by_batch
    assert all(w == {0, 1} for w in by_batch.values()), by_batch


def test_lockstep_rejects_a_staleness_bound_below_the_schedules_lag():
    cfg = parse_config(TINY, ["sync.interval=4", "buffer.max_staleness=2", "run.steps=10"])
    with pytest.raises(ScheduleError, match=r"largest lag \(3"):
        check_schedule(cfg)


def test_async_rejects_an_offset_and_a_bound_below_the_publish_interval():
    with pytest.raises(ScheduleError, match=r"only applies to sync\.mode: lockstep"):
        check_schedule(parse_config(TINY, ["sync.mode=async", "sync.offset=2"]))
    with pytest.raises(ScheduleError, match="at least 3"):
        check_schedule(
            parse_config(TINY, ["sync.mode=async", "sync.interval=4", "buffer.max_staleness=1"])
        )


def test_two_learner_ranks_train_on_groups_that_never_pass_through_the_driver(
    tmp_path, ray_local, monkeypatch
):
    # M = 2 data-parallel ranks (gloo between two Ray actors): rank 0 takes each batch from
    # the buffer and hands it to rank 1. The driver (this process) must never decode a group:
    # its decoders are replaced by ones that fail the run.
    from staleflow.buffer import codec, consumer

    def refuse(*args, **kwargs):
        raise AssertionError("the driver process decoded a group")

    for module, name in ((codec, "decode"), (codec, "decode_fields"), (consumer, "decode_fields")):
        monkeypatch.setattr(module, name, refuse)
    _, run, summary, records = run_driver(
        tmp_path, "learner.num_ranks=2", "sync.offset=1", "run.steps=4", ONE_WORKER
    )
    assert summary["status"] == "completed"
    assert [r["lag_max"] for r in steps_of(records)] == [lag(t, 1, 1) for t in range(1, 5)]
    norms = [r["grad_norm"] for r in steps_of(records)]
    assert all(n >= 0 for n in norms), norms  # finite (NaN fails), from both ranks' shards
    assert any(n > 0 for n in norms), norms
    assert_reconciled(summary)
    assert (run.latest_checkpoint() / "model.safetensors").is_file()
    # rank 0 recorded what each step trained on: 2 groups per step, 4 steps
    lines = (run.trajectories / "steps.jsonl").read_text().splitlines()
    assert [len(json.loads(line)["groups"]) for line in lines] == [2] * 4


# ----------------------------------------------------------------------------- async


def test_async_with_one_worker_trains_at_lag_exactly_one(tmp_path, ray_local):
    # One worker starts its next batch in the same tick as the learner starts a step, with
    # the weights published before that step: whatever the speeds, step t >= 2 trains on
    # version t - 2 (lag 1). Rollout and learning overlap, and admission drops nothing.
    _cfg, _run, summary, records = run_driver(
        tmp_path,
        "sync.mode=async",
        "buffer.max_staleness=1",
        "rollout.num_workers=1",
        "run.steps=8",
    )
    assert summary["status"] == "completed"
    steps = steps_of(records)
    assert [(r["lag_min"], r["lag_max"]) for r in steps] == [(0, 0)] + [(1, 1)] * 7
    assert summary["groups"]["dropped_stale"] == 0
    assert summary["groups"]["pushed"] == 8 * 2
    assert_reconciled(summary)


def test_async_with_three_workers_finishing_out_of_order_drops_nothing(tmp_path, ray_local):
    # (Also the async run whose bounds, lag counts, busy fractions and idle bookkeeping are
    # checked: it used to be a run of its own, two workers of the digits task at bound 1 for
    # 16 steps, one whole run more. A bound of 1 stays the one-worker test's; the buffer's
    # take applies any bound.)
    # Three free-running workers, one of them slow: the worker that holds batch 1 claims the
    # marker when it scores batch 1's first response and then takes 0.5 s a response (2 s a
    # batch; the others take ~0.1 s). Batches 1-3 start together (the staleness rule admits
    # three: lag 0, 1, 2), so 2 and 3 finish before 1. (The slow worker used to be whichever
    # scored first, so any of the three first batches; whether a later batch overtook it
    # was then up to timing, and one CI run saw every batch finish in order.) Admission
    # counts every running batch in its worst case, so no group is generated that the
    # staleness rule would then drop.
    overrides = (
        "task.name=custom",
        f"task.path={tmp_path / 'p.jsonl'}",
        "task.reward_fn=tests.integration.rewards:one_slow_worker",
        "sync.mode=async",
        "buffer.max_staleness=2",
        "rollout.num_workers=3",
        "run.steps=12",
    )
    rows = [{"prompt": f"Say something #{i}"} for i in range(40)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # batch 1's prompts: the driver's first draw from the (seeded, shuffled) task
    cfg = parse_config(TINY, [f"run.output_dir={tmp_path}", *overrides])
    first = {p.text for p in itertools.islice(make_task(cfg.task).train_prompts(), 2)}
    assert len(first) == cfg.rollout.prompts_per_batch == 2
    for r in rows:
        r.update(marker=str(tmp_path / "slow"), sleep_s=0.5, claim=r["prompt"] in first)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _cfg, _run, summary, records = run_driver(tmp_path, *overrides)
    assert summary["status"] == "completed"
    assert (tmp_path / "slow").exists()  # the slow worker was there
    finished = [r["batch"] for r in records if r["kind"] == "rollout"]
    assert finished != sorted(finished), "no batch finished out of order: the test saw nothing"
    assert summary["groups"]["dropped_stale"] == 0
    # Free-running workers: which batch a step gets depends on their speeds, so only what
    # holds for every timing is asserted (the exact lag is the one-worker test's).
    steps = steps_of(records)
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(0 <= r["lag_min"] <= r["lag_max"] <= 2 for r in steps)
    # the driver's per-group lag counts agree with the learner's min / max and group count
    for r in steps:
        lags = {int(k): n for k, n in r["lag_counts"].items()}
        assert sum(lags.values()) == r["groups"] == 2
        assert (min(lags), max(lags)) == (r["lag_min"], r["lag_max"])
    last = steps[-1]
    assert 0 < last["learner_busy"] <= 1
    assert 0 < last["rollout_busy"] <= 1
    # idle worker-seconds are booked in the interval they fall in: at most 3 (workers) per
    # second of it (a worker's idle time since its start went to the first dispatch's step:
    # 50 worker-seconds in a 0.25 s interval)
    for r in steps:
        assert 0 <= r["time_gap_s"] <= 3 * r["time_interval_s"] + 0.05, r
    # every worker produced data (the slow one, batch 1 at least)
    assert {r["worker"] for r in records if r["kind"] == "rollout"} == {0, 1, 2}
    assert_reconciled(summary)


def test_async_without_a_bound_drops_nothing_and_still_reconciles(tmp_path, ray_local):
    # no max_staleness: only buffer capacity limits how far rollout runs ahead
    _, _, summary, records = run_driver(
        tmp_path, "sync.mode=async", "buffer.capacity=8", "run.steps=8"
    )
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    # no bound: nothing is stale; and no batch is started that no step would train, so
    # exactly 8 steps x 2 groups are pushed and none are left over
    assert summary["groups"]["dropped_stale"] == 0
    assert summary["groups"]["pushed"] == 8 * 2
    assert summary["groups"]["left_in_buffer"] == 0
    rollout = [r for r in records if r["kind"] == "rollout"]
    assert sum(r["pushed"] for r in rollout) == 8 * 2


def test_async_replay_run_counts_each_group_once_for_admission(tmp_path, ray_local):
    # With sampling: replay the learner is offered groups it trained before; with
    # max_staleness 1 they soon go stale and are dropped as it takes. The schedule counted
    # each such drop (and each replay trained) as one more group consumed, so its count of
    # groups not trained yet drifted below zero (-16 after 12 steps of 2 groups) and async
    # admission let batches start past the buffer's room and the staleness bound. Acks are
    # made at each step (checkpoint_every 0), so groups become replayable at once.
    # Steps of 8 groups from batches of 1 prompt of 64 generated tokens: the workers are the
    # slow side under any load, so takes come up short and are offered replays.
    _, _, summary, _ = run_driver(
        tmp_path, "sync.mode=async", "buffer.sampling=replay", "buffer.max_reuse=3",
        "buffer.max_staleness=1", "buffer.capacity=8", "run.steps=6",
        "run.checkpoint_every=0", "learner.groups_per_step=8", "rollout.prompts_per_batch=1",
        "rollout.max_new_tokens=64",
    )  # fmt: skip
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    g = summary["groups"]
    assert g["replays_dropped"] > 0  # the case this is about happened
    # never negative now; below the buffer's count only by groups the driver had not heard
    # were pushed when the run ended (0 here when every batch had finished)
    assert 0 <= summary["driver_counts"]["left_in_buffer"] <= g["left_in_buffer"]


# ----------------------------------------------------------------------------- processes


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def status_of(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@pytest.mark.slow
def test_tiny_config_learns_and_leaves_a_complete_run_directory(tmp_path):
    # The shipped configs/tiny.yaml through the real entry point, as CI's smoke run.
    proc = staleflow(
        "train", str(REPO / "configs/tiny.yaml"), f"run.output_dir={tmp_path}",
        "run.name=tiny", "run.tensorboard=true", cwd=tmp_path,
    )  # fmt: skip
    out, _ = proc.communicate(timeout=500)
    assert proc.returncode == 0, out[-3000:]
    run = tmp_path / "tiny"
    steps = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "step"]
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"]
    rewards = [r["reward_mean"] for r in steps]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.15, rewards  # the digits reward really rises
    assert evals[0]["step"] == 0
    assert evals[-1]["step"] == len(steps)
    assert evals[-1]["reward_mean"] > evals[0]["reward_mean"] + 0.15
    assert "held-out accuracy:" in out
    assert "reconciled" in out

    # the run directory: config, metrics, TensorBoard, checkpoint, logs, summary, report
    config = json.loads((run / "config.json").read_text())
    assert config["run"]["name"] == "tiny"
    assert config["sync"]["offset"] == 1
    assert any((run / "tensorboard").glob("events.out.tfevents.*"))
    latest = run / "checkpoints" / (run / "checkpoints/LATEST").read_text().strip()
    assert (latest / "model.safetensors").is_file()
    trainer = json.loads((latest / "trainer.json").read_text())
    assert trainer["steps"] == len(steps)
    assert (run / "logs/driver.log").stat().st_size > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert_reconciled(summary)
    # every step's timeline: its parts are measured and add up to at most its interval
    for r in steps:
        parts = [r[f"time_{k}_s"] for k in ("take", "step", "ack", "publish")]
        assert all(p >= 0 for p in parts)
        assert r["time_step_s"] > 0
        assert sum(parts) <= r["time_interval_s"] + 1e-6
    # every field of every record kind written is documented (docs/architecture.md lists
    # them: only the time_* fields were, and busy fractions were read as per-step values)
    doc = (REPO / "docs/architecture.md").read_text()
    reference = doc[doc.index("### metrics.jsonl") :].split("\n## ")[0]
    for record in read_metrics(run / "metrics.jsonl"):
        assert f"#### `{record['kind']}`" in reference, record["kind"]
        for field in record:
            assert f"`{field}`" in reference, (record["kind"], field)
    # a part's unreadable answers are in its record (only evaluations had them: a task whose
    # scorer failed on every response trained on zeros with nothing in the rollout metrics)
    rollouts = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "rollout"]
    assert rollouts
    k = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())["rollout"]["group_size"]
    assert all(0 <= r["parse_failures"] <= r["groups"] * k for r in rollouts)
    html = (run / "report.html").read_text()
    for name in ("reward", "accuracy", "lag", "clip_kl", "throughput", "busy", "timeline"):
        png = run / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plots/{name}.png" in html

    # `staleflow eval` on the run directory evaluates its latest checkpoint
    ev = staleflow("eval", str(run), "--prompts", "8", "--json", cwd=tmp_path)
    out, _ = ev.communicate(timeout=300)
    assert ev.returncode == 0, out[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["version"] == len(steps)
    assert result["prompts"] == 8

    # `staleflow report` rebuilds the report from the files alone
    os.remove(run / "report.html")
    rep = staleflow("report", str(run), cwd=tmp_path)
    assert rep.wait(timeout=120) == 0
    assert (run / "report.html").is_file()


@pytest.mark.slow
def test_scale_workers_up_and_down_during_a_run(tmp_path):
    (tmp_path / "c.yaml").write_text(TINY)
    proc = staleflow(
        "train", "c.yaml", "run.name=scaled", "sync.mode=async", "buffer.max_staleness=2",
        "run.steps=100000", "--workers", "1", cwd=tmp_path,  # stopped by Ctrl-C below
    )  # fmt: skip
    run = tmp_path / "runs" / "scaled"
    try:
        wait_for(lambda: status_of(run).get("step", 0) >= 3, 300, "step 3")
        up = staleflow("scale", str(run), "--workers", "3", cwd=tmp_path)
        out, _ = up.communicate(timeout=200)
        assert up.returncode == 0, out

        def records(kind):
            return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == kind]

        def batches_by(worker):
            return [r for r in records("rollout") if r["worker"] == worker]

        wait_for(lambda: batches_by(1) and batches_by(2), 300, "batches from the new workers")
        scaled_up = records("scale")[0]
        assert scaled_up["workers"] == 3
        assert scaled_up["step"] >= 3
        # new workers loaded the weights current when they were added before their first batch
        # (with sync.interval 1 the published version is the step); the tag is truthful, as
        # a worker refuses a batch for a version it has not loaded
        for worker in (1, 2):
            assert batches_by(worker)[0]["policy_version"] >= scaled_up["step"]

        # more workers than the cluster can hold: refused with the reason (Ray would keep
        # them pending, and batches handed to them would wait out rollout.batch_timeout_s)
        n = (os.cpu_count() or 1) + 100  # a local Ray has the CPUs plus a few to scale into
        too_many = staleflow("scale", str(run), "--workers", str(n), cwd=tmp_path)
        out, _ = too_many.communicate(timeout=200)
        assert too_many.returncode != 0, out
        assert f"cannot scale to {n} workers" in out, out
        assert "cannot hold this run" in out, out
        assert "ask for fewer workers, or add nodes first" in out, out
        assert status_of(run)["workers"] == 3
        assert len(records("scale")) == 1

        down = staleflow("scale", str(run), "--workers", "1", cwd=tmp_path)
        out, _ = down.communicate(timeout=200)
        assert down.returncode == 0, out
        time.sleep(5)
        scaled_down = records("scale")[1]
        assert scaled_down["workers"] == 1
        assert status_of(run)["workers"] == 1
        # retired workers finish at most the batch they had in flight, then push nothing
        for worker in (1, 2):
            assert len([r for r in batches_by(worker) if r["time"] > scaled_down["time"]]) <= 1
        before = len(batches_by(0))
        wait_for(lambda: len(batches_by(0)) > before + 2, 120, "the remaining worker to go on")
    finally:
        out = ctrl_c(proc)
    interrupted_summary(run, out)


@pytest.mark.slow
def test_ctrl_c_checkpoints_reports_and_leaves_no_redis_or_ray_behind(tmp_path):
    # SIGTERM (what kill, Slurm, Kubernetes and `ray job stop` send) makes the same clean
    # stop through the same handler, which start_ray puts back after ray.init: a run stopped
    # by it is test_train_starts_its_own_ray_..._stops_as_a_job's second run (a joined
    # cluster), and the image's stop test (docker/build.sh: `podman stop` through tini, a
    # Ray of the run's own)
    sig = signal.SIGINT
    (tmp_path / "c.yaml").write_text(TINY)
    proc = staleflow(
        "train", "c.yaml", "run.name=stopped", "sync.mode=async", "run.steps=100000",
        "run.report=true", ONE_WORKER, cwd=tmp_path,
    )  # fmt: skip
    run = tmp_path / "runs" / "stopped"
    wait_for(lambda: status_of(run).get("step", 0) >= 3, 300, "step 3")
    children = descendants(proc.pid)
    redis_pid = json.loads((run / "redis/server.json").read_text())["pid"]
    assert redis_pid in children
    assert len(children) > 3
    out = ctrl_c(proc, sig)
    assert proc.returncode == 128 + sig, out[-3000:]  # 130
    wait_for(lambda: not any(alive(p) for p in children), 120, "Redis and Ray to exit")

    summary = interrupted_summary(run, out)
    assert summary["stopped_by"] == sig.name
    assert 3 <= summary["steps"] < 100000
    latest = run / "checkpoints" / (run / "checkpoints/LATEST").read_text().strip()
    assert json.loads((latest / "trainer.json").read_text())["steps"] == summary["steps"]
    assert (run / "report.html").is_file()
    assert status_of(run)["state"] == "interrupted"


@pytest.fixture
def ray_started(tmp_path):
    """A cluster `ray start --head` made on this machine (at 127.0.0.2, so that its node is
    told apart from a run's own Ray), as a user leaves one running; its address and process.
    `--block` keeps it in the foreground: SIGTERM stops all of it, not the session's Ray as
    `ray stop` would. `ray start` records itself in /tmp/ray/ray_current_cluster, where a
    plain ray.init() finds it; the file is put back as it was."""
    import subprocess
    import sys

    from staleflow.buffer.ports import free_port

    record = Path("/tmp/ray/ray_current_cluster")
    before = record.read_bytes() if record.exists() else None
    port = free_port()
    address = f"127.0.0.2:{port}"
    ray = Path(sys.executable).parent / "ray"
    log = (tmp_path / "ray-start.log").open("wb")
    proc = subprocess.Popen(
        [ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.2", "--port",
         str(port), "--num-cpus", "4", "--include-dashboard", "false",
         "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=clean_env(),
    )  # fmt: skip
    try:
        wait_for(
            lambda: record.exists() and record.read_text().strip() == address,
            120, "ray start to record its cluster", poll_s=0.2,
        )  # fmt: skip
        yield address, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        if before is None:
            record.unlink(missing_ok=True)
        else:
            record.write_bytes(before)


def _node_addresses(run: Path) -> set[str]:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed", summary.get("error")
    return set(summary["placement"]["node_addresses"].values())


@pytest.mark.slow
def test_train_starts_its_own_ray_beside_a_ray_start_cluster_joins_ray_address_and_stops_as_a_job(
    tmp_path, ray_started, monkeypatch
):
    address, cluster = ray_started
    (tmp_path / "c.yaml").write_text(TINY)
    # Without --address: a Ray of the run's own. ray.init's default joined the recorded
    # cluster instead, then refused the run's num_cpus with a bare ValueError traceback.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    proc = staleflow("train", "c.yaml", "run.name=own", "run.steps=2", ONE_WORKER, cwd=tmp_path)
    out, _ = proc.communicate(timeout=500)
    assert proc.returncode == 0, out[-3000:]
    assert "127.0.0.2" not in _node_addresses(tmp_path / "runs/own")

    # $RAY_ADDRESS (what `ray job submit` sets for its entrypoint) is the default --address.
    # The run is then stopped as `ray job stop` (and a RayJob's deletion) stops it: SIGTERM to
    # the driver and every process below it at once. The embedded Redis, one of them, used to
    # exit on it while the driver still had to ack the last step's groups (the driver then
    # restarted it from its append-only file, when the job's stop allowed the time).
    monkeypatch.setenv("RAY_ADDRESS", address)
    proc = staleflow(
        "train", "c.yaml", "run.name=joined", "run.steps=100000", ONE_WORKER, cwd=tmp_path
    )  # fmt: skip
    joined = tmp_path / "runs/joined"
    wait_for(lambda: status_of(joined).get("step", 0) >= 2, 300, "step 2")
    tree = [proc.pid, *descendants(proc.pid)]
    for pid in tree:
        os.kill(pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert f"joining the Ray cluster at {address} from $RAY_ADDRESS" in out
    assert "the embedded Redis server died" not in out
    summary = interrupted_summary(joined, out)
    assert summary["stopped_by"] == "SIGTERM"
    assert set(summary["placement"]["node_addresses"].values()) == {"127.0.0.2"}
    latest = joined / "checkpoints" / (joined / "checkpoints/LATEST").read_text().strip()
    assert json.loads((latest / "trainer.json").read_text())["steps"] == summary["steps"] >= 2
    # the driver only disconnected: the cluster it joined still runs (`ray start --block`
    # exits as soon as one of its processes does)
    time.sleep(1)
    assert cluster.poll() is None, (tmp_path / "ray-start.log").read_text()[-2000:]


def test_a_whole_batch_the_learner_cannot_take_stops_the_run_saying_where_it_went(
    tmp_path, ray_local, monkeypatch
):
    # Injected: the learner reports that it got fewer than G groups of batch 1, which its
    # workers pushed whole (as when the buffer refused them, or another consumer took them).
    # This was a bare RuntimeError ("see staleflow buffer stats"), printed as a traceback.
    import ray

    from staleflow.cluster import driver
    from staleflow.cluster.failures import BatchStalled
    from staleflow.cluster.learner_rank import StepReport
    from staleflow.cluster.placement import LearnerGroup

    waits = []

    def learner_gets_nothing(self, wait_s, publish):
        waits.append(wait_s)
        return [ray.put(StepReport(False, 0))]

    monkeypatch.setattr(LearnerGroup, "train", learner_gets_nothing)
    with pytest.raises(BatchStalled) as err:
        run_driver(tmp_path, "run.name=stall", "sync.offset=0", "run.steps=2", ONE_WORKER)
    assert waits[-1] == driver.COMPLETE_BATCH_WAIT_S  # the call made once batch 1 was whole
    message = str(err.value)
    assert "batch 1 was pushed whole but the learner took fewer than its 2 groups" in message
    # the buffer's own counts: the 2 groups are there, never taken; none refused or dropped
    assert "has refused 0 pushes as duplicates" in message
    assert "dropped 0 stale and 0 invalid groups, and holds 2 undelivered and 0 pending" in message
    summary = json.loads((tmp_path / "stall" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["error"].startswith("BatchStalled: lockstep: batch 1")
