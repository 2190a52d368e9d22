"""The installed `staleflow` console script, run as a user would run it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from staleflow.configs import LOSS_PRESETS

REPO = Path(__file__).resolve().parents[1]
EXE = shutil.which("staleflow", path=str(Path(sys.executable).parent))


def staleflow(*args: str) -> subprocess.CompletedProcess[str]:
    assert EXE, "the staleflow console script is not installed next to this Python"
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_version():
    out = staleflow("--version")
    assert out.returncode == 0
    assert out.stdout.strip().startswith("staleflow 0.")


def test_help_lists_the_commands():
    out = staleflow("--help")
    assert out.returncode == 0
    assert "config" in out.stdout
    assert "losses" in out.stdout


def test_config_prints_the_resolved_config_as_json():
    out = staleflow("config", "configs/tiny.yaml", "learner.loss.epsilon_high=3.0")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    assert resolved["learner"]["loss"]["epsilon_high"] == 3.0
    assert resolved["model"]["preset"] == "tiny"


def test_config_masks_the_redis_password():
    out = staleflow("config", "configs/tiny.yaml", "buffer.redis_url=redis://:hunter2@db:6379/0")
    assert out.returncode == 0, out.stderr
    assert "hunter2" not in out.stdout
    assert json.loads(out.stdout)["buffer"]["redis_url"] == "redis://:***@db:6379/0"


def test_a_bad_redis_url_in_the_environment_is_refused_without_echoing_it(tmp_path):
    env = {"PATH": str(Path(sys.executable).parent), "STALEFLOW_REDIS_URL": "http://:hunter2@db"}
    out = subprocess.run(
        [EXE, "train", str(REPO / "configs/tiny.yaml"), f"run.output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert out.returncode != 0
    assert "$STALEFLOW_REDIS_URL" in out.stderr
    assert "redis://" in out.stderr  # what to give instead
    assert "hunter2" not in out.stderr + out.stdout
    assert not any(tmp_path.iterdir())  # refused before a run directory was made


def test_a_schemeless_redis_url_in_the_environment_is_refused_without_echoing_it(tmp_path):
    env = {"PATH": str(Path(sys.executable).parent),
           "STALEFLOW_REDIS_URL": "default:hunter2@db:6379"}  # fmt: skip
    out = subprocess.run(
        [EXE, "train", str(REPO / "configs/tiny.yaml"), f"run.output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert out.returncode == 2
    assert "$STALEFLOW_REDIS_URL must start with redis://" in out.stderr
    assert "hunter2" not in out.stderr + out.stdout
    assert "input_value" not in out.stderr  # a message, not pydantic's dump
    assert not any(tmp_path.iterdir())


def test_buffer_stats_with_a_bad_port_names_the_url():
    out = staleflow("buffer", "stats", "--redis-url", "redis://:pw@127.0.0.1:99999", "--run", "x")
    assert out.returncode == 2
    assert "redis://:***@127.0.0.1:99999" in out.stderr
    assert "no valid port" in out.stderr


def test_ray_client_address_without_a_reachable_redis_is_refused(tmp_path):
    out = staleflow(
        "train", "configs/tiny.yaml", "--address", "ray://head:10001", f"run.output_dir={tmp_path}"
    )
    assert out.returncode != 0
    assert "buffer.redis_url" in out.stderr
    assert not any(tmp_path.iterdir())


def test_an_address_where_nothing_listens_is_refused_before_the_run_directory(tmp_path):
    # the run directory was made first: a rerun with the address fixed was refused, as the
    # directory "already holds a run"
    from staleflow.buffer.ports import free_port

    port = free_port("127.0.0.1")
    out = staleflow("train", "configs/tiny.yaml", "--address", f"127.0.0.1:{port}",
                    f"run.output_dir={tmp_path}")  # fmt: skip
    assert out.returncode == 2
    assert f"nothing accepts connections at 127.0.0.1:{port}" in out.stderr
    assert not any(tmp_path.iterdir())
    out = staleflow("sweep", "configs/sweeps/tiny.yaml", "--out", str(tmp_path / "out"),
                    "--address", f"127.0.0.1:{port}")  # fmt: skip
    assert out.returncode == 2
    assert f"nothing accepts connections at 127.0.0.1:{port}" in out.stderr
    assert not (tmp_path / "out").exists()


def test_config_error_exits_2_with_the_location():
    out = staleflow("config", "configs/tiny.yaml", "sync.offset=-1")
    assert out.returncode == 2
    assert "override 'sync.offset=-1': sync.offset" in out.stderr


@pytest.mark.parametrize("args", [(), ("--json",)])
def test_losses_lists_every_preset(args):
    out = staleflow("losses", *args)
    assert out.returncode == 0
    for name in LOSS_PRESETS:
        assert name in out.stdout


def test_losses_unknown_preset():
    out = staleflow("losses", "nope")
    assert out.returncode == 2
    assert "valid: reinforce" in out.stderr


@pytest.mark.integration
def test_buffer_stats_against_a_url_and_through_a_run_dir(redis_url, tmp_path):
    from staleflow.buffer.records import Group, Response
    from staleflow.buffer.replay import ReplayBuffer
    from staleflow.buffer.server import RedisServer, redis_dir
    from staleflow.cluster.rundir import RunDir

    def push(url: str, run: str, versions: list[int]) -> None:
        buffer = ReplayBuffer(url, run)
        for v in versions:
            buffer.push(
                Group.new(run_id=run, prompt_id="p", task="t", prompt_token_ids=[1],
                          responses=[Response([2], [-0.5], 1.0)], policy_version=v,
                          worker_id="w")
            )  # fmt: skip

    push(redis_url, "demo", [0, 0, 1])
    out = staleflow("buffer", "stats", "--redis-url", redis_url, "--run", "demo", "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert (stats["pushed"], stats["length"], stats["undelivered"]) == (3, 3, 3)
    assert stats["pushed_by_version"] == {"0": 2, "1": 1}
    table = staleflow("buffer", "stats", "--redis-url", redis_url, "--run", "demo")
    assert "pushed_by_version" in table.stdout
    assert "v0: 2, v1: 1" in table.stdout
    # a run the server has no buffer for: named, with the runs it has (not a table of zeros)
    push(redis_url, "other-run", [0])
    wrong = staleflow("buffer", "stats", "--redis-url", redis_url, "--run", "demp")
    assert wrong.returncode == 2
    assert "no run 'demp' in the buffer at redis://:***@" in wrong.stderr
    assert "runs there: demo, other-run (--run NAME)" in wrong.stderr
    # runs are keyed by name + suffix (RunDir.key): a name stands for its one key, and two
    # runs of one name are listed, not mixed up
    push(redis_url, "solo-0123abcd", [0, 0])
    out = staleflow("buffer", "stats", "--redis-url", redis_url, "--run", "solo", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["pushed"] == 2
    push(redis_url, "twin-0123abcd", [0])
    push(redis_url, "twin-89abcdef", [0, 1, 2])
    both = staleflow("buffer", "stats", "--redis-url", redis_url, "--run", "twin")
    assert both.returncode == 2
    assert "2 runs named 'twin' have a buffer" in both.stderr
    assert "twin-0123abcd, twin-89abcdef; pick one with --run KEY" in both.stderr
    out = staleflow("buffer", "stats", "--redis-url", redis_url, "--run", "twin-89abcdef", "--json")
    assert json.loads(out.stdout)["pushed"] == 3
    # a name stands only for keys made from it: "other" is not run other-run's name
    out = staleflow("buffer", "stats", "--redis-url", redis_url, "--run", "other")
    assert out.returncode == 2
    assert "no run 'other' in the buffer" in out.stderr

    run_dir = RunDir.create(str(tmp_path), "job").path  # with its run-key file
    config = staleflow("config", "configs/tiny.yaml").stdout  # a driver writes it first
    (run_dir / "config.json").write_text(config)
    with RedisServer(redis_dir(run_dir)) as server:  # the embedded server of a running job
        push(server.url, "job", [0, 0, 0])  # a same-named run keyed by its name: not this one
        push(server.url, RunDir(run_dir).key, [5])
        out = staleflow("buffer", "stats", "--run-dir", str(run_dir), "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["pushed"] == 1
        # a run that has just started and pushed nothing yet is not "no such run"
        starting = tmp_path / "starting"
        (starting / "status.json").parent.mkdir()
        (starting / "status.json").write_text('{"state": "starting"}')
        (starting / "config.json").write_text(config)
        (starting / "redis").symlink_to(redis_dir(run_dir))
        held = RunDir(starting).lock()  # as its driver holds it
        try:
            out = staleflow("buffer", "stats", "--run-dir", str(starting))
        finally:
            os.close(held)
        assert out.returncode == 2
        assert "run starting has pushed nothing yet (state: starting)" in out.stderr
        # the same run once its driver was killed (status.json still says so): say it
        out = staleflow("buffer", "stats", "--run-dir", str(starting))
        assert out.returncode == 2
        assert "run starting's driver is gone (status.json still says starting" in out.stderr
        assert f"staleflow train --resume {starting}" in out.stderr


def test_buffer_stats_errors_are_clear(tmp_path):
    out = staleflow("buffer", "stats", "--run-dir", str(tmp_path / "gone"))
    assert out.returncode == 2  # it said no server was recorded there, as if the run were
    assert "gone is not a staleflow run directory (no config.json)" in out.stderr
    out = staleflow("buffer", "stats", "--run-dir", str(tmp_path / "gone" / "config.json"))
    assert "not a staleflow run directory" in out.stderr  # (a file: NotADirectoryError)
    assert "Traceback" not in out.stderr
    data = json.loads(staleflow("config", "configs/tiny.yaml").stdout)
    (tmp_path / "config.json").write_text(json.dumps(data))
    out = staleflow("buffer", "stats", "--run-dir", str(tmp_path))
    assert out.returncode == 2
    assert "no embedded Redis server recorded" in out.stderr
    assert "If it uses an external Redis ($STALEFLOW_REDIS_URL), give its URL" in out.stderr
    # a run on an external server: the URL is to be given (config.json has it masked)
    data["buffer"]["redis_url"] = "redis://:***@db.example:6379/0"
    (tmp_path / "config.json").write_text(json.dumps(data))
    out = staleflow("buffer", "stats", "--run-dir", str(tmp_path))
    assert out.returncode == 2
    assert "uses an external Redis (redis://:***@db.example:6379/0); give its URL" in out.stderr
    from staleflow.cluster.rundir import RunDir

    key = RunDir(tmp_path).key  # (--run-dir and --redis-url exclude each other)
    assert f"password included, and the run's key: --redis-url URL --run {key}" in out.stderr
    data["buffer"]["redis_url"] = None
    (tmp_path / "config.json").write_text(json.dumps(data))
    # a finished run: its server stopped with it; say where its final counts are
    (tmp_path / "status.json").write_text('{"state": "completed"}')
    out = staleflow("buffer", "stats", "--run-dir", str(tmp_path))
    assert out.returncode == 2
    assert "is not running (state: completed): its embedded Redis stopped" in out.stderr
    assert str(tmp_path / "summary.json") in out.stderr
    assert "--resume" not in out.stderr  # refused for a completed run: no advice to use it
    (tmp_path / "status.json").write_text('{"state": "interrupted"}')
    out = staleflow("buffer", "stats", "--run-dir", str(tmp_path))
    assert "`staleflow train --resume` starts the server again" in out.stderr
    out = staleflow("buffer", "stats", "--redis-url", "redis://:pw@127.0.0.1:1/0")
    assert out.returncode == 2
    assert "--run" in out.stderr


def test_train_help_lists_every_config_key_with_its_schema_description(capsys):
    import pytest

    from staleflow.cluster.cli import main
    from staleflow.configs.schema import SyncConfig

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for key, field in SyncConfig.model_fields.items():
        assert f"sync.{key}  {field.description}" in out
    # nested sections by their own keys, with defaults; the loss preset by its name
    assert "learner.optimizer.lr  Peak learning rate. [1e-06]" in out
    assert "rollout.vllm.enforce_eager  Skip CUDA graph capture" in out
    assert (
        "learner.loss  Loss preset chosen by `name`, with its parameters and advantage "
        "settings. [reinforce]" in out
    )
    assert "--address" in out
    assert "--workers" in out
    assert "Ctrl-C" in out
    # --resume names every key a resume may set (rollout.vllm.gpu_memory_utilization was
    # missing), each after its section: "rollout.num_workers, max_restarts, ..."
    from staleflow.cluster.resume import RESUMABLE

    resume = " ".join(out[out.rindex("--resume RUN_DIR") :].split("\n\n")[0].split())
    for key in RESUMABLE:
        section, _, rest = key.partition(".")
        assert f"{section}." in resume, key
        assert rest in resume[resume.index(f"{section}.") :], key


def test_ray_address_defaults_to_the_environment_as_ray_s_own_scripts_do(monkeypatch, capsys):
    from staleflow.cluster.commands import ray_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(None) is None  # a Ray of the run's own
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # what `ray job submit` gives its entrypoint
    assert ray_address(None) == "auto"
    assert "joining the Ray cluster at auto from $RAY_ADDRESS" in capsys.readouterr().err
    assert ray_address("10.0.0.1:6379") == "10.0.0.1:6379"  # --address wins
    assert ray_address("local") is None  # it joined a cluster named "local", unsized
    for own in ("local", " ", ""):
        monkeypatch.setenv("RAY_ADDRESS", own)
        assert ray_address(None) is None
    # the dashboard's address, as exported for `ray job submit`: named, not tried as GCS
    from staleflow.cluster.failures import ClusterUnreachable

    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.1:8265")
    with pytest.raises(ClusterUnreachable, match=r"\$RAY_ADDRESS http://10.0.0.1:8265 is the Ray "
                       r"dashboard's address.*HOST:6379.*unset RAY_ADDRESS"):  # fmt: skip
        ray_address(None)
    with pytest.raises(ClusterUnreachable, match="--address https://h:8265 is the Ray dash"):
        ray_address("https://h:8265")


def test_options_and_overrides_go_in_any_order():
    # README's cluster example puts an option between the config and its overrides
    from staleflow.cluster.cli import parse

    args = parse(["train", "c.yaml", "run.steps=2", "--address", "ray://head:10001", "a.b=1"])
    assert args.address == "ray://head:10001"
    assert args.overrides == ["run.steps=2", "a.b=1"]
    args = parse(["eval", "model-dir", "--prompts", "8", "task.difficulty=2"])
    assert (args.prompts, args.overrides) == (8, ["task.difficulty=2"])
    with pytest.raises(SystemExit):
        parse(["train", "c.yaml", "--no-such-option"])
    with pytest.raises(SystemExit):
        parse(["losses", "grpo", "x=1"])  # a command without overrides


def test_eval_of_a_model_directory_with_a_task_and_overrides(tmp_path):
    # `staleflow eval MODEL_DIR --task arithmetic` (README) on the tiny model, saved as a
    # Hugging Face directory; the overrides come after the options
    from staleflow.actors.models import tiny_dir

    out = staleflow(
        "eval", str(tiny_dir()), "--task", "digits", "--prompts", "4", "--json",
        "task.chat_template=false",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["task"], result["prompts"]) == ("digits", 4)
    assert len(result["examples"]) == 3  # (prompt, response, reward) of the digits task
    for prompt, _response, reward in result["examples"]:
        assert re.fullmatch(r"What is \d \+ \d\? Answer with just the number\.", prompt)
        assert 0.0 <= reward <= 1.0


def test_eval_refuses_bad_options_and_a_broken_model_directory_in_one_line(tmp_path):
    # each of these was a traceback, and --prompts 0 blamed the wrong task
    from staleflow.actors.models import tiny_dir

    model = str(tiny_dir())
    for args, message in [
        (["--prompts", "0"], "--prompts must be at least 1, got 0"),
        (["--temperature", "-1"], "eval_temperature"),
        (["--task", ""], "argument --task: is empty"),  # was ignored: the model's task ran
    ]:
        out = staleflow("eval", model, "--task", "digits", *args)
        assert out.returncode == 2, out.stdout
        assert message in out.stderr
        assert "Traceback" not in out.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"")
    out = staleflow("eval", str(broken), "--task", "digits")
    assert out.returncode == 2
    assert f"{broken / 'config.json'} is not a model config (not readable JSON" in out.stderr
    (broken / "config.json").write_text('{"model_type": "gpt2"}')
    (broken / "tokenizer.json").write_text("{}")
    out = staleflow("eval", str(broken), "--task", "digits")  # every file there, unloadable
    assert out.returncode == 2
    assert f"cannot load the model in {broken}" in out.stderr
    assert "Traceback" not in out.stderr


def test_config_refuses_what_train_would_refuse_before_starting():
    # `staleflow config` used to print these as fine; `train` refused them at start
    for overrides, message in [
        (["sync.mode=async", "sync.offset=1"], "offset"),
        (["sync.method=nccl"], "sync.method: nccl needs the learner and every worker on GPUs"),
    ]:
        out = staleflow("config", "configs/tiny.yaml", *overrides)
        assert out.returncode == 2, out.stdout
        assert message in out.stderr
        assert "Traceback" not in out.stderr


def test_bad_model_and_task_sources_are_refused_before_the_run_directory(tmp_path):
    # train used to make the run directory, write an empty report with seven empty plots,
    # and only then find the model directory missing; `config` printed these as fine
    missing = tmp_path / "no-such"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(6)))
    long = tmp_path / "long.jsonl"  # line 3 is far beyond the tiny model's 256 positions
    rows = [{"prompt": "1+1 " * 200 if i == 3 else f"q{i}"} for i in range(1, 41)]
    long.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from staleflow.cluster.rundir import RunDir

    run = RunDir.create(str(tmp_path / "runs"), "earlier").path  # a run's config.json is
    (run / "config.json").write_text("{}")  # no model's: it passed `config` as a model
    for overrides, message in [
        (["model.preset=null", f"model.path={missing}"], f"model directory {missing} does not"),
        (["model.preset=null", f"model.path={tmp_path}"], "it has no config.json"),
        (["model.preset=null", f"model.path={run}"],
         f"{run} is a staleflow run directory, not a Hugging Face model directory: continue "
         f"that run with `staleflow train --resume {run}`"),
        (["model.preset=null", f"model.path={run / 'config.json'}"],
         "config.json is a file; give the directory that holds the model's config.json"),
        (["task.name=gsm8k", f"task.path={missing}.jsonl"], "no such file"),
        (["task.name=custom", f"task.path={missing}.jsonl", "task.reward_fn=nope.x:f"],
         "cannot import reward function 'nope.x:f'"),
        # 6 prompts, none held out by the hash split (about 1 in 10 is), yet 32 asked for:
        # each evaluation of the run failed and was skipped, its log naming only a type
        (["task.name=custom", f"task.path={prompts}", "task.reward_fn=math:fabs"],
         "custom task has no held-out prompts for task.eval_prompts=1"),
        # no prompt fits: found by step 0's evaluation, with advice for a task file
        (["rollout.max_new_tokens=256"], "rollout.max_new_tokens=256 leaves no room for a "
         "prompt in the model's context of 256 tokens"),
        # found only when a worker sampled it, possibly hours into the run
        (["task.name=custom", f"task.path={long}", "task.reward_fn=math:fabs"],
         f"{long}: 1 of 40 prompts do not fit the model's context of 256 tokens with "
         "rollout.max_new_tokens=8: custom:3 ("),
    ]:  # fmt: skip
        out = staleflow("config", "configs/tiny.yaml", *overrides)
        assert (out.returncode, out.stdout) == (2, ""), out.stderr
        assert message in out.stderr
        out = staleflow("train", "configs/tiny.yaml", *overrides,
                        f"run.output_dir={tmp_path}", "run.name=r")  # fmt: skip
        assert out.returncode == 2
        assert message in out.stderr
        assert "Traceback" not in out.stderr
        assert not (tmp_path / "r").exists()


def test_a_chat_template_asked_for_and_missing_is_refused_before_the_run(tmp_path):
    # it was raw prompt text without a word; then an error in every worker after Ray started
    from staleflow.actors.models import tiny_dir

    model = tmp_path / "base-model"
    shutil.copytree(tiny_dir(0), model)
    (model / "chat_template.jinja").unlink()  # as a base model's tokenizer: no template
    args = ["configs/tiny.yaml", "model.preset=null", f"model.path={model}"]
    out = staleflow("config", *args, "task.chat_template=true")
    assert out.returncode == 2
    assert f"the tokenizer of model {model} has no chat template: set task.chat_template: false" \
        in out.stderr  # fmt: skip
    assert staleflow("config", *args, "task.chat_template=false").returncode == 0


def test_an_output_dir_that_cannot_be_made_is_an_error_not_a_traceback(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = staleflow("train", "configs/tiny.yaml", f"run.output_dir={blocker}", "run.name=x")
    assert out.returncode == 2
    assert f"cannot create the run directory {blocker}/x" in out.stderr
    assert "set run.output_dir=" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_sweep_directory_that_cannot_be_made_is_an_error_not_a_traceback(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = staleflow("sweep", "configs/sweeps/tiny.yaml", "--out", str(blocker))
    assert out.returncode == 2
    assert f"cannot create the sweep directory {blocker}/" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_local_vllm_run_without_vllm_installed_is_refused_before_ray_starts(tmp_path):
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    out = staleflow("train", "configs/tiny.yaml", "rollout.engine=vllm",
                    f"run.output_dir={tmp_path}", "run.name=v")  # fmt: skip
    assert out.returncode == 2
    assert "rollout.engine: vllm, but vLLM is not installed in this environment" in out.stderr
    assert not (tmp_path / "v").exists()  # refused before the run directory, or Ray


def test_scale_of_a_run_whose_driver_is_gone_says_so_at_once(tmp_path):
    # a driver killed with SIGKILL leaves status.json at "running": scale waited its whole
    # --timeout for a confirmation that could not come
    import socket

    from staleflow.cluster.rundir import RunDir
    from staleflow.configs import dump_config, load_config

    run = RunDir.create(str(tmp_path), "killed")
    run.config.write_text(dump_config(load_config(REPO / "configs/tiny.yaml")))
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free now (a reuse within this test is not expected)
    status = {"state": "running", "workers": 2, "driver": {"host": socket.gethostname(),
                                                             "pid": dead.pid}}  # fmt: skip
    run.status.write_text(json.dumps(status))
    out = staleflow("scale", str(run.path), "--workers", "3", "--timeout", "60")
    assert out.returncode == 2
    assert "run killed's driver is gone, though its status still says running" in out.stderr
    assert f"(driver pid {dead.pid} on {socket.gethostname()})" in out.stderr
    assert f"staleflow train --resume {run.path}" in out.stderr
    assert not (run.control / "scale.json").exists()  # no request left behind
    for bad in ("-1", "nan"):  # nan waited for nothing, then "did not confirm within nan s"
        out = staleflow("scale", str(run.path), "--workers", "3", "--timeout", bad)
        assert out.returncode == 2
        assert f"--timeout must be a number of seconds, 0 or more, got {bad}" in out.stderr
    out = staleflow("scale", str(run.path), "--workers", "3", "--timeout", "inf")  # no limit
    assert "run killed's driver is gone" in out.stderr


def test_scale_asks_the_run_directory_lock_whether_the_driver_lives(tmp_path):
    # The lock tells from any host; the pid only on the driver's own host, and a reused pid
    # looks alive: status.json names this test's own pid, alive, yet the driver that held
    # the lock is gone. While a driver holds the lock, scale waits; if the driver dies
    # during the wait, scale says so then, instead of waiting out its --timeout.
    import socket

    from staleflow.cluster.rundir import RunDir
    from staleflow.configs import dump_config, load_config

    run = RunDir.create(str(tmp_path), "locked")
    run.config.write_text(dump_config(load_config(REPO / "configs/tiny.yaml")))
    status = {"state": "running", "workers": 2,
              "driver": {"host": socket.gethostname(), "pid": os.getpid()}}  # fmt: skip
    run.status.write_text(json.dumps(status))
    os.close(run.lock())  # a driver held it, and was killed (the kernel dropped its lock)
    out = staleflow("scale", str(run.path), "--workers", "3", "--timeout", "60")
    assert out.returncode == 2
    assert "run locked's driver is gone" in out.stderr, out.stderr
    assert not (run.control / "scale.json").exists()

    holder = subprocess.Popen(  # a live "driver": holds the lock until its stdin closes
        [sys.executable, "-c", "import sys; from staleflow.cluster.rundir import RunDir; "
         f"fd = RunDir({str(run.path)!r}).lock(); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        scale = subprocess.Popen(
            [EXE, "scale", str(run.path),
             "--workers", "3", "--timeout", "120"],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        # waiting for the live driver's confirmation: its request is left for the driver
        deadline = time.monotonic() + 60
        while not (run.control / "scale.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (run.control / "scale.json").exists()
        assert scale.poll() is None
        holder.stdin.close()  # the driver dies without confirming
        holder.wait(timeout=30)
        _, err = scale.communicate(timeout=60)  # well before --timeout 120
        assert scale.returncode == 2
        assert "run locked's driver is gone" in err, err
        assert f"staleflow train --resume {run.path}" in err
        assert not (run.control / "scale.json").exists()  # no request left for a resume
    finally:
        holder.kill()
    # a driver that finished (its status says so) has not gone missing: it ended
    run.status.write_text(json.dumps({**status, "state": "completed"}))
    assert "run locked ended (state: completed)" in scale_gone_message(run, status)


def scale_gone_message(run, status):
    from staleflow.cluster.commands import _driver_gone

    return _driver_gone(run, status) or ""


def test_damaged_run_files_get_messages_not_tracebacks(tmp_path):
    from staleflow.cluster.rundir import RunDir
    from staleflow.configs import dump_config, load_config

    run = RunDir.create(str(tmp_path), "damaged")
    run.config.write_text(dump_config(load_config(REPO / "configs/tiny.yaml")))
    run.status.write_text("")  # torn
    out = staleflow("scale", str(run.path), "--workers", "3", "--timeout", "0")
    assert out.returncode == 2
    assert "is not running (state: None)" in out.stderr
    assert "Traceback" not in out.stderr
    run.status.write_text(json.dumps({"state": "running", "driver": {}}))  # no host, no pid
    out = staleflow("scale", str(run.path), "--workers", "3", "--timeout", "0")
    assert out.returncode == 2
    assert "did not take the request for 3 workers within 0 s; it stays in" in out.stderr
    assert "Traceback" not in out.stderr
    for damaged in ('{"status": "compl', "[]", '{"groups": 3}'):  # torn; no object; odd
        run.summary.write_text(damaged)
        out = staleflow("report", str(run.path))
        assert out.returncode == 0, out.stderr
        assert "Traceback" not in out.stderr
        assert ("cannot be read" in out.stderr) == (damaged != '{"groups": 3}')


def test_replay_refuses_steps_below_one_and_tolerances_no_step_could_meet(tmp_path):
    out = staleflow("replay", str(tmp_path), "--steps", "0")
    assert out.returncode == 2
    assert "--steps must be at least 1, got 0" in out.stderr
    # nan or below 0: every step, identical numbers included, was a MISMATCH, after the
    # whole replay had run
    for flag, bad in (("--rtol", "nan"), ("--atol", "-1")):
        out = staleflow("replay", str(tmp_path), flag, bad)
        assert out.returncode == 2
        assert f"{flag} must be a finite number >= 0, got {float(bad)}" in out.stderr


def test_report_reads_past_metrics_lines_that_are_no_records(tmp_path):
    # read_metrics passed on any JSON line: 5, or a record with no kind or step, or a
    # field of another type, each a traceback in report (and replay, and a resume's checks)
    from staleflow.cluster.rundir import RunDir

    run = RunDir.create(str(tmp_path), "edited")
    run.config.write_text(staleflow("config", "configs/tiny.yaml").stdout)
    good = {"kind": "step", "step": 1, "reward_mean": 0.5, "time_take_s": 0.1}
    lines = [
        json.dumps(good),
        "5",
        '{"step": 2}',
        '{"kind": "step"}',
        '{"kind": "step", "step": 2, "lag_counts": [1, 2], "time_take_s": null}',
        '{"kind": "step", "step": 3, "reward_mean": 0.5, "wall_s": "x", "lag_counts": {"a": 1}}',
    ]
    data = ("\n".join(lines) + "\n").encode() + b"\xff\xfe not UTF-8\n" + b'{"kind": "st'
    run.metrics.write_bytes(data)  # the last line torn by a crash
    run.summary.write_text(json.dumps({"groups": {"pushed": "<b>80</b>"}}))  # edited, say
    out = staleflow("report", str(run.path))
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    for number in (2, 3, 4, 7):  # the torn last line is expected after a crash: no warning
        assert f"metrics.jsonl:{number} is not a metrics record" in out.stderr
    assert "metrics.jsonl:8" not in out.stderr
    for number in (5, 6):  # records: their odd fields are read as none
        assert f"metrics.jsonl:{number} " not in out.stderr
    page = run.report.read_text()
    assert "<td>&lt;b&gt;80&lt;/b&gt;</td>" in page  # the groups table was not escaped


def test_eval_of_a_run_whose_latest_checkpoint_is_gone_is_refused(tmp_path):
    # it evaluated the initial weights instead, exit 0: an untrained model's accuracy
    # reported for a trained run
    from staleflow.cluster.rundir import RunDir

    run = RunDir.create(str(tmp_path), "trained")
    run.config.write_text(staleflow("config", "configs/tiny.yaml").stdout)
    (run.checkpoints / "step-000005").mkdir()
    (run.checkpoints / "LATEST").write_text("step-5\n")  # typed by hand, say
    out = staleflow("eval", str(run.path), "--prompts", "2")
    assert out.returncode == 2
    assert f"{run.checkpoints / 'LATEST'} names 'step-5', which is missing; it has " \
           "step-000005: write the name" in out.stderr  # fmt: skip
    (run.checkpoints / "LATEST").unlink()
    out = staleflow("eval", str(run.path), "--prompts", "2")
    assert out.returncode == 2
    assert "LATEST is missing; it has step-000005" in out.stderr
    out = staleflow("eval", str(tmp_path / "nothing"))
    assert out.returncode == 2
    assert "nothing is not a directory; give a run directory or a model one" in out.stderr


def test_custom_resources_without_a_cluster_to_join_are_refused_before_ray(tmp_path):
    # a Ray of the run's own has no custom resources: refused only once it had started
    out = staleflow("train", "configs/tiny.yaml", 'learner.resources={"learner": 1}',
                    f"run.output_dir={tmp_path}", "run.name=r")  # fmt: skip
    assert out.returncode == 2
    assert "learner.resources asks for Ray custom resources" in out.stderr
    assert "--address auto" in out.stderr
    assert not (tmp_path / "r").exists()


def test_train_workers_flag_below_one_is_named_as_the_flag(tmp_path):
    out = staleflow("train", "configs/tiny.yaml", "--workers", "0", f"run.output_dir={tmp_path}")
    assert out.returncode == 2
    assert "--workers must be at least 1, got 0" in out.stderr
    assert not any(tmp_path.iterdir())


def test_a_model_directory_is_not_taken_for_a_run_directory(tmp_path):
    # Its config.json passed for a run's: report wrote plots/ and report.html into it,
    # train --resume made its .lock there before speaking of unknown config keys, and
    # replay printed a ConfigError traceback.
    from staleflow.actors.models import tiny_dir

    model = tmp_path / "model"
    shutil.copytree(tiny_dir(), model)
    before = sorted(p.name for p in model.iterdir())
    for args in (["report"], ["replay"], ["train", "--resume"], ["scale", "--workers", "2"]):
        out = staleflow(*args, str(model))
        assert out.returncode == 2, (args, out.stderr)
        assert f"{model} is a Hugging Face model directory, not a staleflow run" in out.stderr
        assert "Traceback" not in out.stderr
    assert sorted(p.name for p in model.iterdir()) == before  # nothing written into it


def test_a_run_whose_stored_config_is_now_refused_is_told_what_a_resume_can_do(tmp_path):
    # a value an older staleflow took (looser bounds) made --resume say only that it was
    # invalid, as if config.json could be edited
    from staleflow.cluster.rundir import RunDir
    from staleflow.configs import dump_config, load_config

    run = RunDir.create(str(tmp_path), "old")
    data = json.loads(dump_config(load_config(REPO / "configs/tiny.yaml")))
    data["learner"]["step_timeout_s"] = 0.5  # below today's bound of 10
    text = json.dumps(data, indent=2)
    run.config.write_text(text)
    line = text[: text.index('"step_timeout_s"')].count("\n") + 1
    out = staleflow("train", "--resume", str(run.path))
    assert out.returncode == 2
    assert f"{run.config}:{line}: learner.step_timeout_s" in out.stderr
    assert f"given again (staleflow train --resume {run.path} KEY=VALUE;" in out.stderr
    assert "resume with the staleflow version that started the run" in out.stderr
    data["learner"]["step_timeout_s"] = 600  # an override's own error gets no such advice
    run.config.write_text(json.dumps(data, indent=2))
    out = staleflow("train", "--resume", str(run.path), "run.steps=0")
    assert out.returncode == 2
    assert "override 'run.steps=0': run.steps" in out.stderr
    assert "cannot be resumed as it is" not in out.stderr


def test_eval_of_a_run_with_another_task_leaves_the_run_s_task_files_behind(tmp_path):
    # --task on a custom run: its task.path and task.reward_fn, which the new task does not
    # read, were refused as ignored settings
    from staleflow.cluster.rundir import RunDir
    from staleflow.configs import dump_config, load_config

    run = RunDir.create(str(tmp_path), "custom")
    task = ["task.name=custom", f"task.path={tmp_path / 'p.jsonl'}", "task.reward_fn=m:f"]
    run.config.write_text(dump_config(load_config(REPO / "configs/tiny.yaml", task)))
    assert run.checkpoints.is_dir()  # (none in it: the initial weights are evaluated)
    out = staleflow("eval", str(run.path), "--task", "digits", "--prompts", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["task"] == "digits"


def test_eval_of_a_setting_this_machine_cannot_run_is_one_line():
    # a GPU share on a machine without one, and the vLLM engine where vLLM is not installed:
    # both were tracebacks (DeviceError, ModuleNotFoundError)
    import importlib.util

    import torch

    from staleflow.actors.models import tiny_dir

    model = str(tiny_dir())
    cases = []
    if not torch.cuda.is_available():
        cases.append(("rollout.gpus_per_worker=1", "rollout.gpus_per_worker=1 asks for a GPU"))
    if importlib.util.find_spec("vllm") is None:
        cases.append(("rollout.engine=vllm", "vLLM is not installed in this environment"))
    if not cases:
        pytest.skip("this machine has a GPU and vLLM")
    for override, message in cases:
        out = staleflow("eval", model, "--task", "digits", "--prompts", "2", override)
        assert out.returncode == 2, out.stderr
        assert message in out.stderr
        assert "Traceback" not in out.stderr


def test_replay_of_a_damaged_trajectory_record_names_it(tmp_path):
    from staleflow.cluster.rundir import RunDir
    from staleflow.configs import dump_config, load_config

    run = RunDir.create(str(tmp_path), "damaged")
    run.config.write_text(dump_config(load_config(REPO / "configs/tiny.yaml")))
    run.trajectories.mkdir()
    (run.trajectories / "steps.jsonl").write_text('{"step": 1, "groups": []}\n')
    # one whole record (8-byte little-endian length, then the bytes) that is no group
    (run.trajectories / "groups.bin").write_bytes((5).to_bytes(8, "little") + b"abcde")
    out = staleflow("replay", str(run.path))
    assert out.returncode == 2, out.stderr
    assert "groups.bin: the record ending at byte 13 is damaged" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
    ("override", "message"),
    [
        # Ray refuses a store larger than the machine's memory, in a ValueError of its own
        ("sync.object_store_mb=100000000",
         r"Ray did not start with a 100000000 MiB object store: .* Set sync\.object_store_mb"),
        # no actor starts in 10 ms: this was a TimeoutError traceback (a one-rank learner's
        # group may be placed in time, its rank never is)
        ("run.start_timeout_s=0.01",
         r"(not placed|did not start) within 0\.01 s \(run\.start_timeout_s\)"),
    ],
)  # fmt: skip
def test_a_run_that_cannot_start_its_ray_or_actors_ends_in_one_line(tmp_path, override, message):
    out = staleflow("train", "configs/tiny.yaml", override, "rollout.num_workers=1",
                    f"run.output_dir={tmp_path}", "run.name=s")  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert re.search(message, out.stderr), out.stderr[-3000:]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["config", "configs/tiny.yaml", "run.steps=5", "run.steps=7"],
         "run.steps is set twice on the command line ('run.steps=5' and 'run.steps=7')"),
        (["train", "configs/tiny.yaml", "--workers", "3", "rollout.num_workers=5"],
         "--workers 3 and the override 'rollout.num_workers=5' both set rollout.num_workers"),
        (["eval", "configs/tiny.yaml", "--prompts", "3", "task.eval_prompts=4"],
         "--prompts 3 and the override 'task.eval_prompts=4' both set task.eval_prompts"),
        # a password in either is masked
        (["config", "configs/tiny.yaml", "buffer.redis_url=redis://:s3cret@h:1/0",
          "buffer.redis_url=redis://h:2/0"],
         "buffer.redis_url is set twice on the command line "
         "('buffer.redis_url=redis://:***@h:1/0' and"),
    ],
    ids=["override-twice", "workers-flag", "eval-prompts-flag", "masked"],
)  # fmt: skip
def test_a_key_set_twice_on_the_command_line_is_refused(args, message, tmp_path):
    # the last one won without a word: `train --workers 3 rollout.num_workers=5` ran 3
    # (and trained, into the source tree's runs/: a train gets a run directory of its own)
    out = staleflow(*args, *([f"run.output_dir={tmp_path}"] if args[0] == "train" else []))
    assert out.returncode == 2, out.stderr
    assert f"error: {message}" in out.stderr
    assert "s3cret" not in out.stderr


def test_a_directory_with_another_config_json_is_not_taken_for_a_run(tmp_path):
    # Any directory holding a config.json passed as a run: `report` wrote its report.html and
    # plots over a model directory's files (.bin weights, so not recognised as a model), and
    # `train --resume` left a .lock in a directory holding only a config.json.
    model = tmp_path / "binmodel"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (model / "pytorch_model.bin").write_bytes(b"weights")
    (model / "report.html").write_text("MY NOTES")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{not json")
    for args, where in [(["report", str(model)], model), (["train", "--resume", str(bare)], bare)]:
        out = staleflow(*args)
        assert out.returncode == 2, out.stderr
        assert f"{where} is not a staleflow run directory: its config.json is not a run's" in (
            out.stderr
        )
    assert (model / "report.html").read_text() == "MY NOTES"
    assert sorted(p.name for p in model.iterdir()) == [
        "config.json", "pytorch_model.bin", "report.html"
    ]  # fmt: skip
    assert sorted(p.name for p in bare.iterdir()) == ["config.json"]
