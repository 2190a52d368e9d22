"""The run-config schema, the shipped YAML files, overrides and error messages."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pydantic
import pytest

from staleflow.configs import (
    LOSS_PRESETS,
    ConfigError,
    RunConfig,
    dump_config,
    load_config,
    parse_config,
)
from staleflow.learner.losses import get_loss, loss_from_config

REPO = Path(__file__).resolve().parents[2]
# run configs; configs/sweeps/ holds sweep files, loaded in tests/integration/test_study.py
SHIPPED = sorted(
    p for p in (REPO / "configs").rglob("*.yaml") if "sweeps" not in p.relative_to(REPO).parts
)

MINIMAL = "model:\n  preset: tiny\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_configs_are_shipped():
    names = {p.relative_to(REPO / "configs").as_posix() for p in SHIPPED}
    assert {"quickstart.yaml", "quickstart-gpu.yaml", "tiny.yaml", "paper/rec-gsm8k.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path):
    cfg = load_config(path)
    assert parse_config(dump_config(cfg)) == cfg
    json.loads(dump_config(cfg))  # plain JSON


def test_quickstart_is_the_demo_described_in_the_issue():
    cfg = load_config(REPO / "configs/quickstart.yaml")
    assert cfg.model.preset == "smollm2-135m"
    assert cfg.task.name == "arithmetic"
    loss = cfg.learner.loss
    assert (loss.name, loss.epsilon_low, loss.epsilon_high) == ("rec-oneside-nois", 0.6, 2.0)
    assert (cfg.rollout.num_workers, cfg.rollout.temperature) == (2, 1.0)
    # lock-step on-policy: on 2 cores async was no faster and no more accurate
    # (docs/results/quickstart-schedule.md)
    assert (cfg.sync.mode, cfg.sync.interval, cfg.sync.offset) == ("lockstep", 1, 0)
    # 34 distinct held-out problems, 3 samples each
    assert (cfg.task.eval_fraction, cfg.task.eval_prompts) == (0.3, 102)
    assert cfg.buffer.redis_url is None  # embedded server


def test_minimal_config_takes_defaults():
    cfg = parse_config(MINIMAL)
    assert cfg.learner.loss.name == "reinforce"
    assert (cfg.sync.interval, cfg.sync.offset) == (1, 0)
    assert cfg.buffer.sampling == "fifo"


def test_overrides_are_typed():
    cfg = parse_config(
        MINIMAL,
        [
            "learner.loss.name=rec-oneside-nois",
            "learner.loss.epsilon_high=2.0",
            'rollout.stop=["\\n\\n", "Question:"]',  # YAML double quotes process escapes
            "run.tensorboard=false",
            "sync.interval=20",
            "buffer.max_staleness=null",
            "task.name=reasoning_gym:basic_arithmetic",
        ],
    )
    assert cfg.learner.loss.epsilon_high == 2.0
    assert cfg.rollout.stop == ("\n\n", "Question:")
    assert cfg.run.tensorboard is False
    assert cfg.sync.interval == 20
    assert cfg.buffer.max_staleness is None
    assert cfg.task.name == "reasoning_gym:basic_arithmetic"


def test_override_switches_preset_and_its_advantage_defaults():
    assert parse_config(MINIMAL, ["learner.loss.name=grpo"]).learner.loss.advantage.std_normalize
    red = parse_config(MINIMAL, ["learner.loss.name=red-drop"]).learner.loss
    assert red.advantage.drop == "balance"
    off = parse_config(
        MINIMAL, ["learner.loss.name=grpo", "learner.loss.advantage.std_normalize=false"]
    )
    assert off.learner.loss.advantage.std_normalize is False


def test_config_is_frozen():
    cfg = parse_config(MINIMAL)
    with pytest.raises(pydantic.ValidationError):
        cfg.run.steps = 5  # type: ignore[misc]


def test_run_config_loss_matches_get_loss():
    cfg = load_config(REPO / "configs/quickstart.yaml")
    from_config = loss_from_config(cfg.learner.loss)
    direct = get_loss("rec-oneside-nois", epsilon_low=0.6, epsilon_high=2.0)
    assert from_config.config == direct.config


# ----------------------------------------------------------------------------- errors


def test_unknown_key_names_file_line_and_valid_keys(tmp_path):
    path = write(
        tmp_path, "model:\n  preset: tiny\nlearner:\n  loss:\n    name: grpo\n    epsilon_hi: 2\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:6: learner.loss.epsilon_hi: unknown key" in msg
    assert "epsilon_high" in msg
    assert "is_truncation" in msg


def test_unknown_preset_lists_the_presets(tmp_path):
    path = write(tmp_path, "model:\n  preset: tiny\nlearner:\n  loss:\n    name: rec\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:5: learner.loss.name" in msg
    assert all(name in msg for name in LOSS_PRESETS)


def test_switching_the_loss_preset_by_override_says_how(tmp_path):
    path = write(tmp_path, MINIMAL + "learner:\n  loss: {name: grpo, epsilon_low: 0.3}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["learner.loss.name=reinforce"])
    assert "learner.loss.epsilon_low: unknown key" in str(err.value)
    assert "replace the section instead, 'learner.loss={name: reinforce}'" in str(err.value)
    # which works
    assert load_config(path, ["learner.loss={name: reinforce}"]).learner.loss.name == "reinforce"
    with pytest.raises(
        ConfigError, match=r"learner.loss is a section, not a value.*loss.name=grpo"
    ):
        load_config(path, ["learner.loss=grpo"])
    # an unknown key given by override itself is only that: no hint about the file's keys
    with pytest.raises(ConfigError) as err:
        load_config(path, ["learner.loss.name=grpo", "learner.loss.regularizer_coef=1"])
    assert "learner.loss.regularizer_coef: unknown key" in str(err.value)
    assert "replace the section" not in str(err.value)


def test_bad_value_from_an_override_names_the_override():
    with pytest.raises(ConfigError, match=r"override 'rollout.temperature=-1'.*greater than 0"):
        parse_config(MINIMAL, ["rollout.temperature=-1"])


def test_a_section_check_failing_after_an_override_names_the_override(tmp_path):
    # buffer's own check (max_reuse needs sampling: replay) fails at the section, not a key:
    # the file's line for `buffer:` alone would point away from the override that broke it
    path = write(tmp_path, MINIMAL + "buffer:\n  capacity: 64\n")
    overrides = ["buffer.max_reuse=3", "rollout.temperature=0.5"]
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    line = next(x for x in str(err.value).splitlines() if "max_reuse=3 only applies" in x)
    # the section's line, then the override inside it; not the one in another section
    assert line.startswith(f"  {path}:3, override 'buffer.max_reuse=3': buffer: ")
    assert "rollout" not in line


def test_a_section_check_failing_in_the_file_names_only_the_file(tmp_path):
    path = write(tmp_path, MINIMAL + "buffer:\n  max_reuse: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["rollout.temperature=0.5"])
    assert f"  {path}:3: buffer: buffer.max_reuse=3 only applies" in str(err.value)


def test_literal_error_lists_choices():
    with pytest.raises(ConfigError, match=r"sync.mode: Input should be 'lockstep' or 'async'"):
        parse_config(MINIMAL, ["sync.mode=sometimes"])


def test_leftover_parameters_after_switching_preset_are_reported():
    with pytest.raises(ConfigError, match=r"learner.loss.epsilon_low: unknown key"):
        parse_config(
            MINIMAL,
            [
                "learner.loss.name=rec-oneside-nois",
                "learner.loss.epsilon_low=0.6",
                "learner.loss.name=opmd",
            ],
        )


@pytest.mark.parametrize(
    ("text", "overrides", "pattern"),
    [
        ("model: {}\n", [], "exactly one of model.preset"),
        ("model:\n  preset: tiny\n  path: /m\n", [], "exactly one of model.preset"),
        (MINIMAL, ["task.name=gsm9k"], "unknown task 'gsm9k'"),
        (MINIMAL, ["task.name=gsm8k"], "needs task.path"),
        (MINIMAL, ["task.name=custom", "task.reward_fn=nocolon"], "package.module:function"),
        (MINIMAL, ["buffer.redis_url=http://h:1"], "redis://, rediss://"),
        # caught when the config loads, not by redis-py after Ray has started
        (MINIMAL, ["buffer.redis_url=redis://127.0.0.1:99999"], "no valid port"),
        (MINIMAL, ["buffer.redis_url=redis://127.0.0.1:abc/0"], "no valid port"),
        (MINIMAL, ["buffer.redis_url=redis://127.0.0.1:0"], "no valid port"),
        (MINIMAL, ["buffer.redis_url=redis://h:6379/abc"], "database 'abc'"),
        (MINIMAL, ["buffer.redis_url=unix://"], "socket's path"),
        # a traceback from os.mkdir / open ("embedded null byte") after the config loaded
        (MINIMAL, ['run.output_dir="runs\\0x"'], r"run\.output_dir: holds a NUL character"),
        (MINIMAL, ['rollout.stop=["a\\0"]'], r"rollout\.stop: holds a NUL character"),
        # booleans inside lists and mappings of numbers: betas [no, no] were (0.0, 0.0)
        (MINIMAL, ["learner.optimizer.betas=[no, no]"], "betas: expected numbers, got"),
        (MINIMAL, ["rollout.resources={x: yes}"], "rollout.resources: expected numbers, got"),
        # each of these was accepted, and redis-py then connected elsewhere than written:
        # localhost, /redis.sock, database 3
        (MINIMAL, ["buffer.redis_url=redis://:pw@:6379/0"], "has no host"),
        (MINIMAL, ["buffer.redis_url=unix://tmp/redis.sock"],
         "has 'tmp' before its path, which redis-py drops"),
        (MINIMAL, ["buffer.redis_url=redis://h:6379/0?db=3"], "names its database twice"),
        (MINIMAL, ["buffer.max_reuse=3"], "only applies to sampling: replay"),
        # '' was the working directory: ". is a directory"
        (MINIMAL, ["task.name=gsm8k", "task.path="], r"task\.path: is empty: give a path"),
        (MINIMAL + "run:\n", [], r"run: run is empty \(YAML reads a key with nothing after"),
        (MINIMAL + "run: {output_dir: ~}\n", [], r"YAML reads ~, null and an empty value as"),
        (MINIMAL, ["task.operations=[*]"], r"quote a value that starts with \* or &"),
        (MINIMAL, ["sync.method=checkpoint", "sync.checkpoint_dir=''"],
         r"checkpoint_dir: is empty"),  # it became <run dir>/weights without a word
        (MINIMAL, ["learner.loss.name=opmd", "learner.loss.kl_coef=0.1"], "reference_model: true"),
        (MINIMAL, ["learner.loss.epsilon_low=0.1"], r"learner.loss.name: required.*grpo"),
        (MINIMAL, ["learner.optimizer.betas=[0.9, 1.5]"], "beta"),
        (MINIMAL, ["run.name=has space"], "run.name"),
        (MINIMAL, ["learner.zero_stage=4"], "less than or equal to 3"),
        (MINIMAL, ['rollout.stop=["###", ""]'], "rollout.stop has an empty string.*remove it"),
        ("", [], "model: required key is missing"),
        ("- a\n- b\n", [], "must be a mapping"),
        ("model: [\n", [], r"run.yaml:\d+: not valid YAML"),
        (MINIMAL, ["run"], "not of the form section.key=value"),
        (MINIMAL, ["model.preset.x=1"], "model.preset is a value"),
        # a file or function the task never reads was accepted and ignored: the run trained
        # on arithmetic while the user believed it used their data
        (MINIMAL, ["task.path=data/train.jsonl"],
         r"task.path is read only by task 'gsm8k' or 'custom', but task.name is 'arithmetic'"),
        (MINIMAL, ["task.name=custom", "task.path=p.jsonl", "task.reward_fn=m:f",
                   "task.eval_path=held.jsonl"],
         r"task.eval_path is read only by task 'gsm8k'.*=null\) \(a custom task holds out"),
        (MINIMAL, ["task.name=gsm8k", "task.path=p.jsonl", "task.reward_fn=m:f"],
         r"task.reward_fn is read only by task 'custom'"),
        # refused by redis-py only at its first connection, after Ray had started
        (MINIMAL, ["buffer.redis_url=redis://h:6379?db=one"], "has db='one'"),
        (MINIMAL, ["buffer.redis_url=redis://h:6379/0?socket_timeout=x"],
         "has socket_timeout='x'"),
        # read, but refused by redis-py or the socket at the first connection (a traceback
        # after Ray had started), or a socket that could never work (socket_read_size=0
        # read nothing: "unreachable after retrying" from a server that was up)
        (MINIMAL, ["buffer.redis_url=rediss://:s3cret@h:6390/0?ssl_cert_reqs=bogus"],
         r"has an option redis-py refuses \(Invalid SSL Certificate Requirements Flag: bogus"),
        (MINIMAL, ["buffer.redis_url=redis://h:1/0?socket_connect_timeout=-1"],
         "has socket_connect_timeout='-1': it must be a finite number of seconds above 0"),
        (MINIMAL, ["buffer.redis_url=redis://h:1/0?socket_timeout=nan"], "socket_timeout='nan'"),
        (MINIMAL, ["buffer.redis_url=redis://h:1/0?socket_read_size=0"],
         "has socket_read_size='0': it must be a number of bytes, at least 1"),
        (MINIMAL, ["buffer.redis_url=redis://h:1/0?max_connections=0"], "max_connections='0'"),
        (MINIMAL, ["buffer.redis_url=redis://h:6379/0?colour=red"],
         r"option 'colour', which a buffer URL cannot set \(it can: client_name, db, "),
        # an object-valued option would arrive as a string and replace the buffer's own
        (MINIMAL, ["buffer.redis_url=redis://h:6379/0?retry_on_error=x"],
         "option 'retry_on_error', which a buffer URL cannot set"),
        (MINIMAL, ["buffer.redis_url=redis://h:6379/0?ssl_cert_reqs=none"],
         "TLS option 'ssl_cert_reqs': use rediss://"),
        (MINIMAL, ["buffer.redis_url=unix:///run/redis.sock?db=x"], "has db='x'"),
        (MINIMAL, ["buffer.redis_url=redis://h:6379/0?decode_responses=true"],
         "option 'decode_responses'; the buffer needs redis-py's default"),
        # Ray's own minimum is 75 MiB: 64 passed here and failed in ray.init
        (MINIMAL, ["sync.object_store_mb=64"], "greater than or equal to 75"),
        # an infinite timeout overflowed inside Ray or the buffer (int(inf * 1000))
        (MINIMAL, ["run.start_timeout_s=.inf"], "run.start_timeout_s"),
        (MINIMAL, ["buffer.claim_idle_s=1e300"], "buffer.claim_idle_s"),
        # seeds are combined with batch numbers into torch's 64-bit seeds
        (MINIMAL, ["rollout.seed=4294967296"], "rollout.seed"),
        (MINIMAL, ["model.seed=18446744073709551616"], "model.seed"),
    ],
)  # fmt: skip
def test_bad_configs_get_clear_errors(tmp_path, text, overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(tmp_path, text), overrides)


def test_url_passwords_are_masked_in_errors():
    with pytest.raises(ConfigError) as err:
        parse_config(MINIMAL, ["buffer.redis_url=http://user:s3cret@host:6379"])
    assert "redis://, rediss://" in str(err.value)
    assert "s3cret" not in str(err.value)
    assert "user:***@host" in str(err.value)


def test_a_config_file_not_in_utf8_says_to_save_it_so(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(MINIMAL.encode() + "run: {name: caf\u00e9}\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"cannot read config file .*; save it as UTF-8"):
        load_config(path)


def test_missing_file():
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        load_config("nope.yaml")


# ----------------------------------------------------------------------------- schema


def _models(model: type[pydantic.BaseModel], seen: set[type]) -> None:
    if model in seen:
        return
    seen.add(model)
    for field in model.model_fields.values():
        stack = [field.annotation]
        while stack:
            ann = stack.pop()
            if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
                _models(ann, seen)
            stack.extend(typing.get_args(ann))


def test_every_field_has_a_description_and_models_forbid_extras():
    seen: set[type] = set()
    _models(RunConfig, seen)
    assert set(LOSS_PRESETS.values()) <= seen  # the union's members were all reached
    for model in seen:
        assert model.model_config.get("extra") == "forbid", model
        assert model.model_config.get("frozen") is True, model
        for name, field in model.model_fields.items():
            if name == "name" and model in LOSS_PRESETS.values():
                continue  # the discriminator
            assert field.description, f"{model.__name__}.{name} has no description"


def test_the_paper_configs_off_policy_columns_each_pass_the_start_checks():
    # The header of configs/paper/rec-gsm8k.yaml lists one override line per off-policy column
    # of the paper's figures; each must get past the checks `staleflow train` runs before
    # starting anything (the offset columns once named no sync.method and, with the file's
    # nccl, were refused at start).
    from staleflow.cluster.resources import check_sync_method
    from staleflow.cluster.schedule import check_schedule

    path = REPO / "configs/paper/rec-gsm8k.yaml"
    header = path.read_text().split("off-policy columns", 1)[1].split("# and the algorithm")[0]
    columns = {
        m[1]: m[2].split() for m in re.finditer(r"^#\s+(\S.*?):\s+(sync\..*)$", header, re.M)
    }
    assert set(columns) == {"sync_interval = 20", "sync_offset = 10", "offline"}
    for name, overrides in columns.items():
        cfg = load_config(path, overrides)
        check_schedule(cfg)
        check_sync_method(cfg)
        assert cfg.sync.mode == "lockstep", name


@pytest.mark.parametrize(
    "url",
    [
        "default:s3cret@host:6379",  # no scheme: reported back in the error
        "http://default:s3cret@host:6379",
        "redis://:s3cret@host:99999/0",
        "redis://host:99999/0?password=s3cret",  # redis-py reads a password from the query too
        "redis://:s3'cret@host:99999",  # a quote in it
        "redis://:s3/cret@host:6379/0",  # an unencoded '/': refused, still masked whole
    ],
)
def test_a_refused_url_does_not_print_its_password(url):
    with pytest.raises(ConfigError) as err:
        parse_config(MINIMAL, [f"buffer.redis_url={url}"])
    assert "s3cret" not in str(err.value)
    assert "buffer.redis_url" in str(err.value)
    assert str(err.value).count("(got ") == 1  # the value once, masked


def test_an_unencoded_slash_in_a_password_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"password cut short .* percent-encode"):
        parse_config(MINIMAL, ["buffer.redis_url=redis://:ab/cd@host:6379/0"])
    assert parse_config(MINIMAL, ["buffer.redis_url=redis://:ab%2Fcd@host:6379/0"])


def test_masking_leaves_values_that_only_look_like_credentials():
    # config.json is written through redact(): a path with ':' and '@' in it must survive
    from staleflow.configs.loader import redact

    cfg = parse_config("model: {path: /models/team:nlp@v2/ckpt}\n")
    assert "/models/team:nlp@v2/ckpt" in redact(dump_config(cfg))


def test_redis_urls_redis_py_reads_as_meant_are_accepted(monkeypatch):
    # unix://localhost/path is the socket's path to redis-py; and a URL in the environment
    # read from a file (a Kubernetes secret's) ends in a newline, which redis-py ignores
    from staleflow.cluster.services import redis_url_from_env

    assert parse_config(MINIMAL, ["buffer.redis_url=unix://localhost/run/r.sock"])
    monkeypatch.setenv("STALEFLOW_REDIS_URL", "redis://:pw@h:6379/0\n")
    assert redis_url_from_env() == "redis://:pw@h:6379/0"


def test_redis_url_options_redis_py_takes_are_accepted():
    for query in ("max_connections=50", "socket_timeout=3", "client_name=learner"):
        for url in (f"redis://h:6379/0?{query}", f"redis://h:6379?{query}&db=2"):
            assert parse_config(MINIMAL, [f"buffer.redis_url={url}"]).buffer.redis_url == url
    url = "rediss://h:6379/0?ssl_cert_reqs=none&ssl_check_hostname=false"
    assert parse_config(MINIMAL, [f"buffer.redis_url={url}"]).buffer.redis_url == url


def test_a_password_masked_in_a_stored_config_is_recognised():
    # a resume reads the URL from config.json, where the password is masked: in the user
    # part or as ?password=. The second used to be taken as the password '***'.
    from staleflow.configs.loader import password_masked, redact

    for url in ("redis://:s3cret@h:6379/0", "redis://u:s3cret@h/0",
                "redis://h:6379/0?socket_timeout=5&password=s3cret"):  # fmt: skip
        assert not password_masked(url)
        assert password_masked(redact(url)), redact(url)
    assert not password_masked("redis://h:6379/0")


def test_a_home_directory_in_a_path_is_expanded():
    # `output_dir: ~/runs` in a YAML file (no shell to expand it) made a directory named '~'
    text = MINIMAL.replace("preset: tiny", "path: ~/models/m") + (
        "task: {name: gsm8k, path: ~/data/train.jsonl}\n"
        "run: {output_dir: ~/runs}\nsync: {method: checkpoint, checkpoint_dir: ~/w}\n"
    )
    cfg = parse_config(text)
    home = str(Path.home())
    assert cfg.model.path == f"{home}/models/m"
    assert cfg.task.path == f"{home}/data/train.jsonl"
    assert cfg.run.output_dir == f"{home}/runs"
    assert cfg.sync.checkpoint_dir == f"{home}/w"
    assert parse_config(MINIMAL, ["run.output_dir=out/~x"]).run.output_dir == "out/~x"


def test_more_mini_batches_than_a_step_has_sequences_is_refused():
    # _split makes at most one optimizer step per sequence, while the learning-rate schedule
    # and a resume count mini_batches x epochs per learner step
    from staleflow.cluster.schedule import ScheduleError, check_schedule

    # tiny.yaml: a step trains one batch of 2 prompts x group_size 4 = 8 sequences
    base = ["rollout.prompts_per_batch=2", "rollout.group_size=4"]
    check_schedule(load_config(REPO / "configs/tiny.yaml", [*base, "learner.mini_batches=8"]))
    cfg = load_config(REPO / "configs/tiny.yaml", [*base, "learner.mini_batches=9"])
    with pytest.raises(ScheduleError, match=r"mini_batches=9 is more than the 8 sequences"):
        check_schedule(cfg)


def test_a_query_password_is_masked():
    from staleflow.configs.loader import redact

    url = "redis://h:6379/0?password=s3cret&socket_timeout=5"
    assert redact(url) == "redis://h:6379/0?password=***&socket_timeout=5"
    cfg = parse_config(MINIMAL, [f"buffer.redis_url={url}"])
    assert "s3cret" not in redact(dump_config(cfg))


def test_every_password_option_and_a_url_in_a_mapping_override_is_masked():
    from staleflow.configs.loader import password_masked, redact, redact_override

    # ?ssl_password= (the TLS key's passphrase) was printed by `staleflow config`, stored in
    # config.json and shown in `buffer stats` errors
    url = "rediss://:s3cret@h:6379/0?ssl_password=KEYPASS&ssl_certfile=/x"
    assert redact(url) == "rediss://:***@h:6379/0?ssl_password=***&ssl_certfile=/x"
    cfg = parse_config(MINIMAL, [f"buffer.redis_url={url}"])
    assert "KEYPASS" not in redact(dump_config(cfg))
    assert password_masked("rediss://h:6379/0?ssl_password=***")  # a resume asks for it
    # a URL without its scheme inside a mapping override: the error quoted the override raw
    with pytest.raises(ConfigError) as err:
        parse_config(MINIMAL, ['buffer={redis_url: "u:s3cret@h:6379/0"}'])
    assert "s3cret" not in str(err.value)
    assert "u:***@h:6379/0" in str(err.value)
    with pytest.raises(ConfigError) as err:  # ... and in a YAML error, which quotes it too
        parse_config(MINIMAL, ['buffer={redis_url: "u:s3cret@h:6379/0"'])
    assert "s3cret" not in str(err.value)
    assert redact_override("sweep.x={redis_url: 'u:s3cret@h:1/0'}") == (
        "sweep.x={redis_url: 'u:***@h:1/0'}"
    )


@pytest.mark.parametrize(
    "url", ["redis://:my s3cret@127.0.0.1:1/0", "redis://my user:s3cret@h:6379/0"]
)
def test_whitespace_in_a_redis_url_is_refused_without_printing_the_password(url):
    # redis-py takes a space into the password or user name and connects with it: the regex
    # that masks passwords in free text stops at whitespace, so the config (and config.json)
    # printed it whole
    with pytest.raises(ConfigError, match=r"holds whitespace: percent-encode it") as err:
        parse_config(MINIMAL, [f"buffer.redis_url={url}"])
    assert "s3cret" not in str(err.value)
    from staleflow.buffer.connection import connect

    with pytest.raises(ValueError, match="holds whitespace") as err2:  # `buffer stats --redis-url`
        connect(url)
    assert "s3cret" not in str(err2.value)


def test_a_password_with_an_at_sign_is_masked_whole():
    # redis-py ends the password at the netloc's last '@' (it parses with urlparse), so a
    # mask that stopped at the first '@' printed 'ss:w0rd'
    from staleflow.configs.loader import redact

    url = "redis://:p@ss:w0rd@127.0.0.1:1/0"
    assert redact(f"buffer at {url} is unreachable") == (
        "buffer at redis://:***@127.0.0.1:1/0 is unreachable"
    )
    # two URLs on one line, each masked up to its own host
    assert redact("redis://:a@h:1/0 and rediss://u:b@c@h2/0") == (
        "redis://:***@h:1/0 and rediss://u:***@h2/0"
    )
    cfg = parse_config(MINIMAL, [f"buffer.redis_url={url}"])
    assert "w0rd" not in redact(dump_config(cfg))  # as the run's config.json is written


def test_a_yaml_error_on_a_line_with_a_password_does_not_print_it(tmp_path):
    # PyYAML's message quotes the offending line
    text = MINIMAL + 'buffer:\n  redis_url: "redis://:s3cr3t@127.0.0.1:1/0\n'
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_config(write(tmp_path, text))
    assert "s3cr3t" not in str(err.value)
    # PyYAML names the file, not "<unicode string>"
    assert f'in "{tmp_path / "run.yaml"}", line' in str(err.value)


@pytest.mark.parametrize(
    ("override", "where"),
    [("run.steps=true", "steps"), ("buffer.max_staleness=false", "max_staleness"),
     ("learner.loss.epsilon_low=true", "epsilon_low")],
)  # fmt: skip
def test_a_number_given_as_true_or_false_is_refused(override, where):
    # pydantic's lax mode read run.steps=true as 1
    with pytest.raises(ConfigError, match=rf"{where}: expected a number, got (true|false)") as err:
        parse_config(MINIMAL, ["learner.loss.name=rec-oneside-nois", override])
    # blamed on the override that set it, under its full key
    key = override.split("=")[0]
    assert f"override {override!r}: {key}: expected a number" in str(err.value)
    # a boolean key still takes one
    assert parse_config(MINIMAL, ["learner.reference_model=true"]).learner.reference_model


def test_a_section_given_twice_is_refused_not_merged_silently(tmp_path):
    # YAML keeps the last of two equal keys: the first run: section's steps were lost
    text = MINIMAL + "run: {steps: 3}\nrun: {name: x}\n"
    with pytest.raises(ConfigError, match=r"run\.yaml:4: run is given twice \(also line 3\)"):
        load_config(write(tmp_path, text))
    nested = MINIMAL + "run:\n  steps: 3\n  steps: 4\n"
    with pytest.raises(ConfigError, match=r"run\.steps is given twice"):
        load_config(write(tmp_path, nested))


def test_a_mapping_that_holds_itself_through_an_alias_is_refused(tmp_path):
    # walking x: &a {b: *a} for the keys' lines never ended: a RecursionError traceback
    text = MINIMAL + "rollout: &r {group_size: 4, again: *r}\n"
    with pytest.raises(ConfigError, match=r"run\.yaml:3: rollout\.again holds the mapping it is"):
        load_config(write(tmp_path, text))
    shared = MINIMAL + "rollout: &r {group_size: 4}\n"  # an anchor alone is fine
    assert load_config(write(tmp_path, shared)).rollout.group_size == 4


def test_a_json_config_indented_with_tabs_loads_and_errors_keep_their_lines(tmp_path):
    # YAML refuses a tab as indentation, so json.dump(cfg, f, indent="\t") could not be read
    data = {"model": {"preset": "tiny"}, "rollout": {"group_size": 4}, "run": {"steps": 7}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data, indent="\t"))
    cfg = load_config(path)
    assert (cfg.rollout.group_size, cfg.run.steps) == (4, 7)
    data["rollout"]["group_size"] = 0  # an error still names the line it is on
    path.write_text(json.dumps(data, indent="\t"))
    with pytest.raises(ConfigError, match=r"run\.json:6: rollout\.group_size"):
        load_config(path)
    with pytest.raises(ConfigError, match="not valid YAML"):  # a tab YAML refuses, not JSON
        load_config(write(tmp_path, "model:\n\tpreset: tiny\n"))


def test_base_60_and_octal_numbers_are_not_read_as_yaml_1_1_would(tmp_path):
    # PyYAML's YAML 1.1 read start_timeout_s: 1:30 as 90 and seed: 010 as 8, silently
    text = MINIMAL + "run:\n  seed: 010\n  start_timeout_s: 1:30\n"
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert "run.yaml:5: run.start_timeout_s" in str(err.value)
    assert "(got '1:30'); write one plain number: 1:30 is not read as 90" in str(err.value)
    assert "seed" not in str(err.value)  # 010 is ten, as in YAML 1.2 (JSON has no 010)
    cfg = load_config(write(tmp_path, MINIMAL), ["run.seed=010"])
    assert cfg.run.seed == 10
    with pytest.raises(ConfigError, match=r"override 'run.start_timeout_s=2:00'.*got '2:00'"):
        load_config(write(tmp_path, MINIMAL), ["run.start_timeout_s=2:00"])
    with pytest.raises(ConfigError) as err:  # a text field: the advice is not about numbers
        load_config(write(tmp_path, MINIMAL), ["run.name=10:30"])
    assert "pattern" in str(err.value)
    assert "plain number" not in str(err.value)
    # what is a number in YAML 1.1 and 1.2 alike still is: 1e-6 text to a float field, 0x10
    cfg = load_config(write(tmp_path, MINIMAL), ["learner.optimizer.lr=1e-6", "run.seed=0x10"])
    assert (cfg.learner.optimizer.lr, cfg.run.seed) == (1e-6, 16)


def test_text_yaml_reads_as_a_number_date_or_boolean_is_told_to_be_quoted(tmp_path):
    # run.name=42 (or 2026-01-05, or no) was refused as "not a valid string", with no fix
    for value in ("42", "2026-01-05", "no"):
        with pytest.raises(
            ConfigError, match=rf"""quote it to keep it text: "run.name='{value}'\""""
        ):
            load_config(write(tmp_path, MINIMAL), [f"run.name={value}"])
    with pytest.raises(ConfigError, match=r"run\.yaml:4: run\.name: .*quote it .*: name: '\.\.\.'"):
        load_config(write(tmp_path, MINIMAL + "run:\n  name: 2026-01-05\n"))
    assert load_config(write(tmp_path, MINIMAL), ["run.name='42'"]).run.name == "42"
    with pytest.raises(ConfigError, match=r"rollout\.stop\.1: .*quote the item to keep it text: "
                       r"stop: \['\.\.\.'\]"):  # fmt: skip
        load_config(write(tmp_path, MINIMAL), ["rollout.stop=[a, yes]"])


def test_a_setting_the_chosen_option_never_reads_is_refused(tmp_path):
    # a constant schedule ignored warmup_steps and min_lr_ratio, and sync.method ray ignored
    # checkpoint_dir, silently (as unread task inputs are refused)
    base = write(tmp_path, MINIMAL)
    for override, message in (
        ("learner.optimizer.warmup_steps=100", "warmup_steps: only schedule warmup_cosine"),
        ("learner.optimizer.min_lr_ratio=0.1", "min_lr_ratio: only schedule warmup_cosine"),
        ("sync.checkpoint_dir=/tmp/w", "checkpoint_dir: only sync.method checkpoint reads it"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(base, [override])
    cfg = load_config(base, ["learner.optimizer.schedule=warmup_cosine",
                             "learner.optimizer.warmup_steps=100"])  # fmt: skip
    assert cfg.learner.optimizer.warmup_steps == 100


def test_resource_amounts_below_rays_unit_are_refused_before_ray_starts(tmp_path):
    # Ray's .options() raised a ValueError for them, a traceback once Ray had started
    base = write(tmp_path, MINIMAL)
    for override in ("rollout.cpus_per_worker=0.00001", "learner.gpus_per_rank=0.00005",
                     'rollout.resources={"rollout": 0.00001}'):  # fmt: skip
        with pytest.raises(ConfigError, match=r"Ray counts resources in steps of 0\.0001"):
            load_config(base, [override])
    assert load_config(base, ["rollout.cpus_per_worker=0.0001"]).rollout.cpus_per_worker == 1e-4


def test_a_config_as_data_masks_each_password_and_keeps_every_key():
    # redact() over the compact JSON masked from the URL's "host:" to the last '@' anywhere
    # after it: with an output_dir holding one, trainer.json lost the learner and sync
    # sections, and a resume compared nothing there
    from staleflow.configs.loader import redacted_dict

    cfg = parse_config(
        "model: {preset: tiny}",
        [
            "buffer.redis_url=redis://10.0.0.5:6379/0",
            "run.output_dir=/data/exp@v2",
            "learner.optimizer.lr=0.5",
        ],
    )
    data = redacted_dict(cfg)
    assert set(data) == set(json.loads(cfg.model_dump_json()))
    assert data["buffer"]["redis_url"] == "redis://10.0.0.5:6379/0"
    assert data["run"]["output_dir"] == "/data/exp@v2"
    assert data["learner"]["optimizer"]["lr"] == 0.5
    urls = ["buffer.redis_url=redis://u:s3cr@t@h:1/0", "run.output_dir=/a@b"]
    cfg = parse_config("model: {preset: tiny}", urls)
    data = redacted_dict(cfg)
    assert data["buffer"]["redis_url"] == "redis://u:***@h:1/0"
    assert "s3cr" not in json.dumps(data)
    assert data["run"]["output_dir"] == "/a@b"


def test_a_vllm_engine_may_not_take_more_gpu_memory_than_its_share_of_the_gpu():
    # learner 0.5 + two workers at 0.25 passed every check, then the engines asked for 0.5 of
    # the GPU's memory each (the default) and the second failed to start
    shared = ["rollout.engine=vllm", "rollout.gpus_per_worker=0.25", "learner.gpus_per_rank=0.5"]
    with pytest.raises(ConfigError, match=r"vllm.gpu_memory_utilization 0.5 is more of the "
                       r"GPU's memory than the worker's share .*at most 0.25"):  # fmt: skip
        parse_config(MINIMAL, shared)
    cfg = parse_config(MINIMAL, [*shared, "rollout.vllm.gpu_memory_utilization=0.25"])
    assert cfg.rollout.vllm.gpu_memory_utilization == 0.25
    whole = parse_config(MINIMAL, ["rollout.engine=vllm", "rollout.gpus_per_worker=1",
                                "rollout.vllm.gpu_memory_utilization=0.9"])  # fmt: skip
    assert whole.rollout.vllm.gpu_memory_utilization == 0.9  # a GPU of its own
    assert parse_config(MINIMAL, ["rollout.gpus_per_worker=0.25"]).rollout.engine == "hf"


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["task.name=digits", "task.difficulty=3", "task.format_reward=0.5"],
         ["task.difficulty is ignored: only task 'arithmetic' reads it, not 'digits'",
          "task.format_reward is ignored: only task 'arithmetic' reads it, not 'digits'"]),
        (["task.name=digits", "task.eval_fraction=0.5"],
         ["task.eval_fraction is ignored by task 'digits': it draws its own held-out set"]),
        (["rollout.vllm.max_model_len=64", "rollout.vllm.gpu_memory_utilization=0.9"],
         ["rollout.vllm.gpu_memory_utilization, rollout.vllm.max_model_len ignored: only "
          "rollout.engine vllm reads them, not 'hf'"]),
        (["model.preset=null", "model.path=/m", "model.seed=3"],
         ["model.seed is ignored: it builds only the 'tiny' preset's weights"]),
        (["learner.reference_model=true"], ["learner.reference_model: true with"]),
        (["learner.optimizer.schedule=warmup_cosine", "learner.optimizer.warmup_steps=1000",
          "run.steps=10"], ["learner.optimizer.warmup_steps=1000 is not less than the run's 10 "
                            "optimizer steps (run.steps=10)"]),
        # warmup_steps counts optimizer steps: 40 of 30 x 4 ends at a third of the run; it
        # was said never to end. 130 of them does not.
        (["learner.optimizer.schedule=warmup_cosine", "learner.optimizer.warmup_steps=40",
          "run.steps=30", "learner.mini_batches=4"], []),
        (["learner.optimizer.schedule=warmup_cosine", "learner.optimizer.warmup_steps=130",
          "run.steps=30", "learner.mini_batches=4"],
         ["learner.optimizer.warmup_steps=130 is not less than the run's 120 optimizer steps "
          "(run.steps=30 x 4, mini_batches x epochs)"]),
        (["rollout.group_size=1"], ["rollout.group_size=1: every advantage is 0"]),
        (["sync.broadcast_timeout_s=60"], ["sync.broadcast_timeout_s is ignored: only "
                                           "sync.method nccl or gloo broadcasts, not 'ray'"]),
        (["buffer.redis_url=redis://h:6379/0", "buffer.persistence=false"],
         ["buffer.persistence is ignored: it sets up the embedded Redis"]),
        (["rollout.engine=vllm", "sync.method=gloo", "sync.mode=async", "sync.offset=0",
          "rollout.vllm.weight_transport=rpc"],
         ["rollout.vllm.weight_transport is ignored: a broadcast (gloo) loads the weights"]),
        # read: nothing said
        (["learner.optimizer.schedule=warmup_cosine", "learner.optimizer.warmup_steps=5",
          "run.steps=10", "task.difficulty=3", "task.eval_fraction=0.5"], []),
    ],
    ids=["arithmetic-only", "eval-fraction", "vllm-with-hf", "model-seed", "reference", "warmup",
         "warmup-mini-batches", "warmup-mini-batches-long", "group-of-one", "broadcast-timeout",
         "persistence-external", "weight-transport-broadcast", "all-read"],
)  # fmt: skip
def test_settings_a_run_never_reads_are_named(overrides, said):
    # each was accepted without a word: a user believed the run used them
    from staleflow.configs.schema import unread_settings

    got = unread_settings(parse_config(MINIMAL, overrides))
    assert len(got) == len(said), got
    for line, start in zip(got, said, strict=True):
        assert line.startswith(start), (line, start)


def test_the_shipped_configs_set_nothing_they_do_not_read():
    from staleflow.configs.schema import unread_settings

    for path in [*(REPO / "configs").glob("*.yaml"), *(REPO / "configs/paper").glob("*.yaml")]:
        assert unread_settings(load_config(path)) == [], path


@pytest.mark.parametrize(
    "url",
    ["redis://h:6379/0?password=s3cret", "rediss://h:6379/0?ssl_password=s3cret&ssl_certfile=/x",
     "redis://:s3cret@h:6379/0"],
)  # fmt: skip
def test_a_config_with_a_masked_password_stays_valid_json(tmp_path, url):
    # The query password's mask ran to the next whitespace, swallowing the JSON string's
    # closing quote: config.json became invalid, and every command on the run refused it
    # as "not a staleflow run directory".
    from staleflow.cluster.rundir import RunDir
    from staleflow.configs.loader import dump_redacted, redact

    cfg = parse_config(MINIMAL, [f"buffer.redis_url={url}"])
    for text in (dump_redacted(cfg), redact(dump_config(cfg))):
        assert "s3cret" not in text
        assert "***" in json.loads(text)["buffer"]["redis_url"]
    run = RunDir.create(str(tmp_path), "r")
    run.config.write_text(dump_redacted(cfg))  # as the driver writes it
    assert run.check_exists() is run


@pytest.mark.parametrize(
    ("override", "refused"),
    [
        ("rollout.temperature=2.5", True),  # vLLM refuses it on every request
        ("rollout.temperature=0.005", True),  # vLLM would sample at 0.01 instead
        ("rollout.temperature=2", False),
        ("rollout.temperature=0.01", False),
        ("task.eval_temperature=0", False),  # greedy
        ("task.eval_temperature=0.001", True),
        ("task.eval_temperature=3", True),
    ],
)
def test_vllm_temperatures_are_those_vllm_samples_at(override, refused):
    key = override.split("=")[0]
    if refused:
        with pytest.raises(ConfigError, match=rf"{key}=\S+: rollout.engine vllm samples at "
                           r"temperatures from 0.01 to 2"):  # fmt: skip
            parse_config("model: {preset: tiny}\n", ["rollout.engine=vllm", override])
    else:
        parse_config("model: {preset: tiny}\n", ["rollout.engine=vllm", override])
    parse_config("model: {preset: tiny}\n", [override])  # the hf engine takes any of them


def test_the_default_run_name_from_a_config_files_name_is_a_valid_run_name():
    # `staleflow train "my exp+lr.yaml"` named its run "my exp+lr-<date>-<time>" without the
    # schema's check: the run trained, but its config.json never loaded again, so it could
    # not be resumed, evaluated or replayed

    from staleflow.cluster.commands import _default_run_name

    for stem in ("quickstart", "my exp+lr", "_private", ".hidden", "réglages", "x" * 200):
        name = _default_run_name(stem)
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}-\d{8}-\d{6}", name), name
        assert parse_config("model: {preset: tiny}\n", [f"run.name={name}"]).run.name == name
    assert _default_run_name("my exp+lr").startswith("my-exp-lr-")


def test_a_key_a_later_section_would_drop_is_refused_on_the_command_line():
    # `run.steps=50 'run={eval_every: 5}'` ran 100 steps (the file's): the mapping replaced
    # the whole section, run.steps included, and the set-twice check compared exact keys
    from staleflow.configs.loader import check_distinct_overrides

    with pytest.raises(ConfigError, match=r"'run=\{eval_every: 5\}' sets run whole, after "
                       r"'run.steps=50' set run.steps inside it"):  # fmt: skip
        check_distinct_overrides(["run.steps=50", "run={eval_every: 5}"])
    # a key inside a section set before it applies on top of it (what a sweep's cell does)
    check_distinct_overrides(['buffer={"capacity": 64}', "buffer.redis_url=null"])


def test_an_error_inside_a_section_set_by_an_override_names_the_override():
    # learner.optimizer={lr: 5} was blamed on the file's line of its valid lr: 5.0e-5
    text = "model: {preset: tiny}\nlearner:\n  optimizer:\n    lr: 5.0e-5\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, ["learner.optimizer={lr: 5}"], source="f.yaml")
    assert "override 'learner.optimizer={lr: 5}': learner.optimizer.lr" in str(err.value)
    assert "f.yaml:4" not in str(err.value)


def test_a_loss_given_without_its_name_says_the_default_does_not_apply():
    # learner.loss.entropy_coef=0.01 on a file without learner.loss: "name: required key is
    # missing", blamed on the file's learner: line, while the docs give reinforce as default
    text = "model: {preset: tiny}\nlearner: {optimizer: {lr: 1.0e-5}}\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, ["learner.loss.entropy_coef=0.01"], source="f.yaml")
    message = str(err.value)
    assert "override 'learner.loss.entropy_coef=0.01': learner.loss.name: required" in message
    assert "the default, reinforce, applies only where learner.loss is not given" in message


def test_a_config_whose_aliases_multiply_its_keys_without_end_is_refused():
    # 11 lines, each level's mapping naming the one below 8 times: 8**8 keys, which
    # `staleflow config` walked at full CPU and growing memory until it was killed
    lines = ["model: {preset: tiny}", "a0: &a0 {k: 1, l: 1, m: 1, n: 1, o: 1, p: 1, q: 1, r: 1}"]
    for level in range(1, 8):
        refs = ", ".join(f"k{i}: *a{level - 1}" for i in range(8))
        lines.append(f"a{level}: &a{level} {{{refs}}}")
    with pytest.raises(ConfigError, match=r"more than 100000 keys once its YAML aliases"):
        parse_config("\n".join(lines) + "\n", source="laughs.yaml")
    # an alias or two, as a config may use them, is read as before (and refused by the schema
    # as unknown keys here, as any other key)
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config("model: {preset: tiny}\nx: &x {k: 1}\ny: *x\n")


def test_a_dotted_key_in_a_config_file_says_to_nest_it():
    # `run.steps: 5` in a file said "unknown key; valid keys here: buffer, ..." though
    # run.steps is a key (and sweep files take dotted keys)
    with pytest.raises(ConfigError, match=r"f.yaml:2: run.steps: unknown key: a dotted key is "
                       r"for the command line .* nest it: run: \{steps: ...\}"):  # fmt: skip
        parse_config("model: {preset: tiny}\nrun.steps: 5\n", source="f.yaml")


def test_an_integer_past_pythons_digit_limit_is_a_config_error():
    # PyYAML's int() raised ValueError (not a YAMLError): a traceback
    huge = "9" * 5000
    with pytest.raises(ConfigError, match=r"f.yaml: a value cannot be read: Exceeds the limit"):
        parse_config(f"model: {{preset: tiny}}\nrun: {{steps: {huge}}}\n", source="f.yaml")
    with pytest.raises(ConfigError, match=r"override 'run.steps=9+': value cannot be read"):
        parse_config("model: {preset: tiny}\n", [f"run.steps={huge}"])
    # a key given twice still says so (ConfigError is a ValueError too)
    with pytest.raises(ConfigError, match=r"f.yaml:3: run is given twice"):
        parse_config("model: {preset: tiny}\nrun: {steps: 1}\nrun: {steps: 2}\n", source="f.yaml")


def test_an_override_that_is_bad_yaml_does_not_quote_its_password():
    # the header masked it, but PyYAML's error quoted the raw value: [:s3cret@h:1/0
    with pytest.raises(ConfigError) as err:
        parse_config("model: {preset: tiny}\n", ["buffer.redis_url=[:s3cret@h:1/0"])
    assert "value is not valid YAML: while parsing a flow node" in str(err.value)
    assert "s3cret" not in str(err.value)


def test_a_flag_and_a_section_override_holding_its_key_are_refused_together():
    # `train cfg 'rollout={num_workers: 2}' --workers 3` ran 3 workers without a word
    from staleflow.configs.loader import check_distinct_overrides

    with pytest.raises(ConfigError, match=r"--workers 3 and the override 'rollout=\{num_workers"):
        check_distinct_overrides(
            ["rollout={num_workers: 2}"], {"rollout.num_workers": "--workers 3"}
        )


def test_a_dotted_key_inside_an_override_mapping_is_told_to_nest_it_there():
    with pytest.raises(ConfigError, match=r"inside a mapping value a key is not dotted"):
        parse_config("model: {preset: tiny}\n", ["learner={optimizer.lr: 0.01}"])
