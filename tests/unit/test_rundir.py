"""Run directories: metrics survive a torn last line, control requests round-trip, and the CLI
refuses directories that are not runs with a message that says what to pass."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow.cluster.cli import main
from staleflow.cluster.rundir import MetricsWriter, RunDir, RunDirBusy, read_metrics


def test_metrics_are_flushed_per_line_and_a_torn_last_line_is_skipped(tmp_path):
    run = RunDir.create(str(tmp_path), "r")
    writer = MetricsWriter(run, tensorboard=False)
    writer.write("step", 1, loss=0.5)
    writer.write("eval", 1, accuracy=0.25)
    # written before close: a crash right now keeps both lines
    assert [r["kind"] for r in read_metrics(run.metrics)] == ["step", "eval"]
    writer.close()
    with run.metrics.open("a") as f:
        f.write('{"kind": "step", "step": 2, "lo')  # killed mid-write
    records = list(read_metrics(run.metrics))
    assert [(r["kind"], r["step"]) for r in records] == [("step", 1), ("eval", 1)]
    assert records[0]["loss"] == 0.5
    assert records[1]["accuracy"] == 0.25


def test_worker_requests_are_taken_once_and_bad_ones_refused(tmp_path):
    run = RunDir.create(str(tmp_path), "r")
    assert run.take_worker_request() is None
    run.request_workers(3)
    assert run.take_worker_request() == 3
    assert run.take_worker_request() is None  # consumed
    # a bad one is removed (it was read again at every poll) and refused, saying what is
    # wrong; a list, a number or bytes that are not UTF-8 raised in the driver's loop
    for bad, why in [
        (json.dumps({"workers": 0}), "from 1 to 1024, got 0"),
        (json.dumps({"workers": 3.0}), "from 1 to 1024, got 3.0"),
        (json.dumps({"workers": True}), "from 1 to 1024, got True"),
        (json.dumps({"workers": 100_000_000}), "from 1 to 1024, got 100000000"),
        ("{not json", "not a JSON object"),
        ("[3]", "not a JSON object"),
        ("3", "not a JSON object"),
        (b'{"workers": 2}\xff', "not a JSON object"),
    ]:
        path = run.control / "scale.json"
        path.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
        assert run.take_worker_request() is None
        assert not path.exists()
        refused = json.loads((run.control / "scale-refused.json").read_text())
        assert why in refused["reason"], (bad, refused)
    # one no driver took (its run stopped first) is dropped by a resume, its count said
    run.request_workers(5)
    assert run.drop_worker_request() == 5
    assert not (run.control / "scale.json").exists()
    assert run.drop_worker_request() is None


def test_run_keys_tell_same_named_runs_apart_and_survive_a_move(tmp_path):
    first = RunDir.create(str(tmp_path / "a"), "demo")
    second = RunDir.create(str(tmp_path / "b"), "demo")
    # the name, a dash, 8 hex digits: two runs named demo get two keys
    assert re.fullmatch(r"demo-[0-9a-f]{8}", first.key)
    assert re.fullmatch(r"demo-[0-9a-f]{8}", second.key)
    assert second.key != first.key
    key = first.key
    moved = first.path.rename(tmp_path / "renamed")  # a resume finds its buffer after a move
    assert RunDir(moved).key == key
    long = RunDir.create(str(tmp_path), "x" * 128)  # the longest name keeps within 128
    assert len(long.key) == 128
    # a second train given the same name creates the directory again before its lock
    # refuses it: the first run's key must not change under it
    assert RunDir.create(str(tmp_path / "b"), "demo").key == second.key
    # a name made from a config file's name may hold what a key cannot
    odd = RunDir.create(str(tmp_path), "my exp:1-20261125")
    assert re.fullmatch(r"my-exp-1-20261125-[0-9a-f]{8}", odd.key)
    assert re.fullmatch(r"r_x-[0-9a-f]{8}", RunDir.create(str(tmp_path), "_x").key)
    old = tmp_path / "made-before-keys"
    old.mkdir()
    assert RunDir(old).key == "made-before-keys"  # its buffer was keyed by its name
    (old / "run-key").write_text("staleflow:other:*\n")  # damaged: refused, not used
    with pytest.raises(ValueError, match=r"not a run key .* logs/driver\.log and summary\.json"):
        _ = RunDir(old).key


def test_latest_checkpoint_follows_the_pointer(tmp_path):
    run = RunDir.create(str(tmp_path), "r")
    assert run.latest_checkpoint() is None
    (run.checkpoints / "step-000004").mkdir()
    run.mark_latest_checkpoint(run.checkpoints / "step-000004")
    assert run.latest_checkpoint() == run.checkpoints / "step-000004"


def test_report_and_scale_refuse_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "not a staleflow run directory" in capsys.readouterr().err
    assert main(["scale", str(tmp_path), "--workers", "2"]) == 2
    assert "not a staleflow run directory" in capsys.readouterr().err


def test_scale_refuses_a_run_that_is_not_running(tmp_path, capsys):
    from staleflow.configs import parse_config
    from staleflow.configs.loader import dump_config

    run = RunDir.create(str(tmp_path), "r")
    run.config.write_text(dump_config(parse_config("model: {preset: tiny}\n")))
    run.status.write_text(json.dumps({"state": "completed", "workers": 2}))
    assert main(["scale", str(run.path), "--workers", "4"]) == 2
    assert "is not running (state: completed)" in capsys.readouterr().err
    assert not (run.control / "scale.json").exists()


def test_train_refuses_an_existing_run_and_a_bad_schedule_before_starting_anything(
    tmp_path, capsys
):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {preset: tiny}\nsync: {mode: async, offset: 3}\n")
    assert main(["train", str(cfg), f"run.output_dir={tmp_path}"]) == 2
    assert "sync.offset=3 only applies to sync.mode: lockstep" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    cfg.write_text("model: {preset: tiny}\n")
    assert main(["train", str(cfg), f"run.output_dir={tmp_path}", "run.name=taken"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_train_with_a_missing_model_directory_fails_clearly_before_starting_anything(
    tmp_path, capsys
):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tmp_path / 'nowhere'}}}\nrun: {{name: r, steps: 2}}\n")
    assert main(["train", str(cfg), f"run.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "model directory" in err
    assert "does not exist; set model.path" in err
    assert not (tmp_path / "r").exists()  # refused before the run directory, or any server


def test_scale_refuses_to_grow_an_ipc_run_past_the_workers_it_reserved(tmp_path, capsys):
    from staleflow.configs import parse_config
    from staleflow.configs.loader import dump_config

    run = RunDir.create(str(tmp_path), "r")
    yaml = "model: {preset: tiny}\nsync: {method: ipc}\nrollout: {num_workers: 2}\n"
    run.config.write_text(dump_config(parse_config(yaml)))
    run.status.write_text(json.dumps({"state": "running", "workers": 2}))
    assert main(["scale", str(run.path), "--workers", "3"]) == 2
    err = capsys.readouterr().err
    assert "cannot scale to 3 workers: sync.method: ipc reserves room for" in err
    assert "rollout.num_workers (2)" in err
    assert not (run.control / "scale.json").exists()
    # down is fine: the request is written (and, with no driver here, not confirmed)
    assert main(["scale", str(run.path), "--workers", "1", "--timeout", "0"]) == 2
    assert "did not take the request for 1 workers within 0 s; it stays in" in (
        capsys.readouterr().err
    )
    assert run.take_worker_request() == 1


def test_scale_says_a_broadcast_run_changes_workers_at_its_next_publish(tmp_path, capsys):
    # With nccl/gloo the driver takes the request and defers it to the next publish; the
    # timeout said "the request stays in control/ and is applied at the driver's next
    # event", neither of which was true.
    import threading

    from staleflow.configs import parse_config
    from staleflow.configs.loader import dump_config

    run = RunDir.create(str(tmp_path), "r")
    run.config.write_text(
        dump_config(parse_config("model: {preset: tiny}\nsync: {method: gloo}\n"))
    )
    run.status.write_text(json.dumps({"state": "running", "workers": 2}))
    taker = threading.Timer(0.2, run.take_worker_request)  # the driver, deferring it
    taker.start()
    assert main(["scale", str(run.path), "--workers", "3", "--timeout", "1.5"]) == 2
    taker.join()
    err = capsys.readouterr().err
    assert "the driver took the request for 3 workers but did not reach that count" in err
    assert "with sync.method gloo workers change at the next weight publish" in err


def test_scale_refuses_zero_workers_and_an_unreadable_config_without_a_traceback(tmp_path, capsys):
    run = RunDir.create(str(tmp_path), "r")
    run.status.write_text(json.dumps({"state": "running", "workers": 2}))
    from staleflow.configs import parse_config
    from staleflow.configs.loader import dump_config

    config = json.loads(dump_config(parse_config("model: {preset: tiny}\n")))
    del config["sync"]["method"]  # e.g. a config from before sync.method existed
    run.config.write_text(json.dumps(config))
    assert main(["scale", str(run.path), "--workers", "0"]) == 2
    assert "--workers must be from 1 to 1024, got 0" in capsys.readouterr().err
    # a huge count made the driver build a request per worker in its loop (minutes, GBs)
    assert main(["scale", str(run.path), "--workers", "100000000"]) == 2
    assert "--workers must be from 1 to 1024, got 100000000" in capsys.readouterr().err
    assert not (run.control / "scale.json").exists()
    assert main(["scale", str(run.path), "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot read the run's config" in err
    assert "KeyError('method')" in err
    assert "Traceback" not in err
    assert not (run.control / "scale.json").exists()


def test_a_run_directory_in_use_refuses_a_second_driver(tmp_path, capsys):
    # `train --resume` of a run still going started a second driver and a second Redis on
    # the same files: it cut metrics.jsonl under the live driver, rewrote its summary and
    # status, and removed its redis/server.json
    from staleflow.configs import parse_config
    from staleflow.configs.loader import dump_config

    run = RunDir.create(str(tmp_path), "r")
    run.config.write_text(dump_config(parse_config("model: {preset: tiny}\n")))
    status = json.dumps({"state": "running", "driver": {"host": "node-1", "pid": 4242}})
    run.status.write_text(status)
    fd = run.lock()
    try:
        assert main(["train", "--resume", str(run.path)]) == 2
    finally:
        os.close(fd)
    err = capsys.readouterr().err
    assert "in use by a staleflow train still running (driver pid 4242 on node-1)" in err
    assert run.status.read_text() == status  # refused before anything changed
    # the kernel drops the lock of a driver killed with SIGKILL: a resume may go on
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom staleflow.cluster.rundir import RunDir\n"
         "RunDir(sys.argv[1]).lock()\nprint('held', flush=True)\ntime.sleep(120)", str(run.path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy):
            run.lock()
    finally:
        holder.kill()
        holder.wait()
    os.close(run.lock())


def test_the_report_draws_evaluations_in_step_order(tmp_path, monkeypatch):
    # eval records are written as evaluations finish: a retried one (on another worker) can
    # land after a later step's, and the accuracy curve went 0 -> 10 -> 5 and back
    import json

    import matplotlib.axes

    from staleflow.cluster.report import write_report
    from staleflow.cluster.rundir import RunDir

    run = RunDir.create(str(tmp_path), "evals")
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in [
        {"kind": "eval", "step": 0, "accuracy": 0.1, "wall_s": 1.0},
        {"kind": "eval", "step": 10, "accuracy": 0.8, "wall_s": 20.0},
        {"kind": "eval", "step": 5, "accuracy": 0.5, "wall_s": 30.0},
    ]))  # fmt: skip
    drawn = []
    real = matplotlib.axes.Axes.plot

    def plot(self, *args, **kwargs):
        drawn.append([list(a) for a in args[:2]])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    write_report(run)
    assert [[0, 5, 10], [0.1, 0.5, 0.8]] in drawn  # accuracy against the step
    assert [[1 / 60, 20 / 60, 30 / 60], [0.1, 0.8, 0.5]] in drawn  # and against wall time


def test_write_text_durable_fsyncs_the_file_then_its_directory(tmp_path, monkeypatch):
    # The driver writes config.json, what a resume starts from, this way at every start (a
    # resume's too): by a rename never fsynced, a machine going down just after could leave
    # it empty, and the run refused as "not a staleflow run directory". status.json,
    # rewritten every few seconds, stays without fsync.
    from staleflow.cluster.rundir import write_text
    from staleflow.learner import durable

    synced: list[str] = []
    monkeypatch.setattr(durable, "fsync_file", lambda p: synced.append(f"file {Path(p).name}"))
    monkeypatch.setattr(durable, "fsync_dir", lambda p: synced.append(f"dir {Path(p).name}"))
    write_text(tmp_path / "status.json", "{}\n")
    assert synced == []
    write_text(tmp_path / "config.json", '{"run": {}}\n', durable=True)
    assert [s.split(".config.json.")[0] for s in synced] == ["file ", f"dir {tmp_path.name}"]
    assert (tmp_path / "config.json").read_text() == '{"run": {}}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "status.json"]


@pytest.mark.parametrize(
    "argv",
    [
        ["buffer", "stats", "--redis-url", "", "--run", "x"],  # a traceback (TypeError)
        ["buffer", "stats", "--run-dir", " "],  # looked for redis/server.json in ''
        ["sweep", "configs/sweeps/tiny.yaml", "--dry-run", "--out", ""],  # the file's, silently
        ["train", "configs/tiny.yaml", "--address", ""],  # $RAY_ADDRESS or a new Ray, silently
        ["train", "--resume", ""],
    ],
)
def test_an_empty_option_value_is_refused_naming_the_option(argv, capsys):
    # `--redis-url "$UNSET"`: an unset shell variable gives ''
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    flag = next(a for a in argv if a.startswith("--") and a != "--dry-run")
    assert f"argument {flag}: is empty" in capsys.readouterr().err


def test_config_notes_what_a_local_train_would_refuse(capsys):
    # `staleflow config` said nothing (exit 0) of a config `staleflow train` then refused
    # before starting: vLLM not installed here, custom resources without --address. They are
    # notes, not errors: the config may be meant for a cluster.
    import importlib.util

    argv = ["config", "configs/tiny.yaml", "rollout.resources={rollout: 1}"]
    if importlib.util.find_spec("vllm") is None:
        argv.append("rollout.engine=vllm")
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "without --address would refuse it: rollout.resources asks for Ray custom" in err
    if "rollout.engine=vllm" in argv:
        assert "rollout.engine: vllm, but vLLM is not installed" in err


def test_a_request_written_while_one_is_taken_stays_for_the_next_poll(tmp_path, monkeypatch):
    # scale.json was read, then removed by name: a request written between the two (an
    # atomic replace by another `staleflow scale`) was deleted unseen
    run = RunDir.create(str(tmp_path), "r")
    run.request_workers(4)
    real = Path.read_bytes

    def read_then_a_new_request(self):
        data = real(self)
        run.request_workers(8)  # lands as the driver reads the first
        return data

    monkeypatch.setattr(Path, "read_bytes", read_then_a_new_request)
    assert run.take_worker_request() == 4
    monkeypatch.undo()
    assert run.take_worker_request() == 8
