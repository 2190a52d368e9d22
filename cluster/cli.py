"""The `staleflow` command line.

    staleflow --version
    staleflow config CONFIG [section.key=value ...]   validate a run config, print it resolved
    staleflow losses [NAME]                            list loss presets and their defaults
    staleflow buffer stats (--redis-url URL --run RUN | --run-dir DIR [--run RUN]) [--json]
    staleflow train CONFIG [section.key=value ...] [--workers N] [--address ADDR]
    staleflow train --resume RUN_DIR [run.steps=N ...]
    staleflow eval (RUN_DIR | MODEL_DIR) [--task NAME] [--prompts N] [--temperature T] [--json]
    staleflow report RUN_DIR
    staleflow scale RUN_DIR --workers N [--timeout S]
    staleflow sweep SWEEP.yaml [--parallel N] [--address ADDR] [--dry-run] [--report-only]
    staleflow replay RUN_DIR [--steps N] [--rtol R] [--atol A]

Heavy dependencies (Ray, DeepSpeed, transformers) are imported inside the subcommands that need
them, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


def _version() -> str:
    try:
        return version("staleflow")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _cmd_config(args: argparse.Namespace) -> int:
    from staleflow.actors.models import ModelError, PromptTooLongError
    from staleflow.actors.tasks import TaskError
    from staleflow.cluster.commands import check_before_start, local_run_refusals
    from staleflow.configs import ConfigError, load_config
    from staleflow.configs.loader import check_distinct_overrides, dump_redacted

    try:
        check_distinct_overrides(args.overrides)
        cfg = load_config(args.config, args.overrides)
        check_before_start(cfg)
    except (ConfigError, TaskError, ModelError, PromptTooLongError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in local_run_refusals(cfg):  # (the config may be meant for a cluster)
        print(f"warning: `staleflow train` without --address would refuse it: {note}",
              file=sys.stderr)  # fmt: skip
    print(dump_redacted(cfg))  # passwords masked, as in the run's config.json
    return 0


def _cmd_losses(args: argparse.Namespace) -> int:
    from staleflow.configs import LOSS_PRESETS

    names = [args.name] if args.name else list(LOSS_PRESETS)
    unknown = [n for n in names if n not in LOSS_PRESETS]
    if unknown:
        print(
            f"error: unknown loss preset {unknown[0]!r}; valid: {', '.join(LOSS_PRESETS)}",
            file=sys.stderr,
        )
        return 2
    for name in names:
        preset = LOSS_PRESETS[name]
        defaults = preset().model_dump(exclude={"name"})
        if args.json:
            print(json.dumps({"name": name, **defaults}))
            continue
        print(f"{name}: {(preset.__doc__ or '').strip().splitlines()[0]}")
        for key, value in defaults.items():
            print(f"    {key} = {value}")
    return 0


def _cmd_buffer_stats(args: argparse.Namespace) -> int:
    import dataclasses

    from staleflow.buffer.replay import BufferConnectionError, ReplayBuffer
    from staleflow.buffer.server import (
        NoServerRecorded,
        RedisServerError,
        read_server_url,
        redis_dir,
    )
    from staleflow.cluster.rundir import RunDir, keys_named, read_json_object

    state = None
    try:
        if args.run_dir:
            config = read_json_object(RunDir(args.run_dir).check_exists().config) or {}
            state = _run_state(args.run_dir)
            external = (config.get("buffer") or {}).get("redis_url")
            if external and not args.redis_url:  # no embedded server to find the URL of
                raise ValueError(
                    f"run {Path(args.run_dir).name} uses an external Redis ({external}); give "
                    "its URL, password included, and the run's key: --redis-url URL --run "
                    f"{RunDir(args.run_dir).key}"
                )
        if args.run_dir and not args.redis_url and state not in (None, "starting", "running"):
            raise ValueError(
                f"run {Path(args.run_dir).name} is not running (state: {state}): its embedded "
                'Redis stopped with it. Its final counts are under "groups" in '
                f"{Path(args.run_dir) / 'summary.json'}"
                + (
                    ""
                    if state == "completed"  # a resume of it is refused (nothing to do)
                    else "; `staleflow train --resume` starts the server again with the buffer "
                    "as it was, and goes on training"
                )
            )
        if (
            args.run_dir
            and not args.redis_url
            and state in ("starting", "running")
            and RunDir(args.run_dir).in_use() is False
        ):
            raise ValueError(
                f"run {Path(args.run_dir).name}'s driver is gone (status.json still says "
                f"{state}: it was killed), and its embedded Redis with it; `staleflow train "
                f"--resume {args.run_dir}` starts the server again with the buffer as it was"
            )
        try:
            url = args.redis_url or read_server_url(redis_dir(args.run_dir))
        except NoServerRecorded as exc:
            raise ValueError(  # a run given $STALEFLOW_REDIS_URL records no URL in config.json
                f"{exc} If it uses an external Redis ($STALEFLOW_REDIS_URL), give its URL: "
                f"--redis-url URL --run {RunDir(args.run_dir).key}"
            ) from None
        if args.run is None and args.run_dir is None:
            raise ValueError("--redis-url needs --run RUN, the run whose buffer to inspect")
        run = args.run or RunDir(args.run_dir).key
        with ReplayBuffer(url, run) as buffer:
            runs = buffer.runs()
            where = buffer.url_for_display
        if args.run and run not in runs:  # a run's name stands for its key if only one has it
            named = keys_named(run, runs)
            if len(named) > 1:
                raise ValueError(
                    f"{len(named)} runs named {run!r} have a buffer at {where}: "
                    f"{', '.join(named)}; pick one with --run KEY (a run's key is the run_id "
                    "in its summary.json), or give --run-dir"
                )
            run = named[0] if named else run
        if run not in runs and state in ("starting", "running"):
            raise ValueError(f"run {run} has pushed nothing yet (state: {state}); try again")
        if run not in runs:  # not a buffer of zeros: there is none
            raise ValueError(
                f"no run {run!r} in the buffer at {where}; runs there: "
                f"{', '.join(runs) or 'none'} (--run NAME)"
            )
        with ReplayBuffer(url, run) as buffer:
            stats = buffer.stats()
    except (BufferConnectionError, RedisServerError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data = dataclasses.asdict(stats)
    if args.json:
        print(json.dumps(data))
        return 0
    width = max(map(len, data))
    for key, value in data.items():
        if isinstance(value, dict):
            value = ", ".join(f"v{k}: {n}" for k, n in value.items()) or "-"
        print(f"{key:<{width}}  {value}")
    return 0


def _run_state(run_dir: str) -> str | None:
    """The state in a run directory's status.json (None if there is none to read)."""
    from staleflow.cluster.rundir import RunDir, read_json_object

    state = (read_json_object(RunDir(run_dir).status) or {}).get("state")
    return str(state) if state is not None else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="staleflow",
        description="Asynchronous actor-learner RL for language models with the off-policy "
        "REC / OPMD loss family.",
    )
    parser.add_argument("--version", action="version", version=f"staleflow {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    config = sub.add_parser("config", help="validate a run config and print it resolved (JSON)")
    config.add_argument("config", help="YAML or JSON run config, e.g. configs/quickstart.yaml")
    config.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. learner.loss.epsilon_high=2.0"
    )
    config.set_defaults(func=_cmd_config)

    losses = sub.add_parser("losses", help="list the loss presets and their default parameters")
    losses.add_argument("name", nargs="?", help="show only this preset")
    losses.add_argument("--json", action="store_true", help="one JSON object per line")
    losses.set_defaults(func=_cmd_losses)

    buffer = sub.add_parser("buffer", help="inspect a run's replay buffer")
    buffer_sub = buffer.add_subparsers(dest="buffer_command", metavar="ACTION", required=True)
    stats = buffer_sub.add_parser("stats", help="counts of pushed, pending, acked, dropped groups")
    where = stats.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--redis-url", type=_nonempty, help="redis:// or rediss:// URL of the server"
    )
    where.add_argument(
        "--run-dir",
        type=_nonempty,
        help="a run directory; its embedded Redis server is found through it",
    )
    stats.add_argument(
        "--run",
        type=_nonempty,
        help="the run: its key (summary.json's run_id), or its name if only one run of that "
        "name has a buffer there (default: the run directory's run)",
    )
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(func=_cmd_buffer_stats)
    _add_run_commands(sub)
    return parser


def _nonempty(value: str) -> str:
    """An option's value that must say something: `--redis-url "$UNSET"` gave '' and a
    traceback; '' for --out, --address or --run-dir fell back to the default silently."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty (an unset shell variable?); give a value")
    return value


def _lazy(name: str) -> Any:
    """A subcommand implemented in cluster/commands.py, imported only when it runs."""

    def run(args: argparse.Namespace) -> int:
        from staleflow.cluster import commands

        return int(getattr(commands, name)(args))

    return run


def _add_run_commands(sub: Any) -> None:
    from staleflow.cluster.commands import config_keys_help

    train = sub.add_parser(
        "train",
        help="train: rollout workers + replay buffer + learner on a local or existing Ray cluster",
        description="Start (or join) Ray, an embedded Redis unless buffer.redis_url is set, the "
        "rollout workers and the DeepSpeed learner, and train on the config's schedule. Writes "
        "the run directory <run.output_dir>/<run.name>. Ctrl-C or SIGTERM stops cleanly "
        "(checkpoint, summary, report unless run.report is false); a second one stops at once.",
        epilog=config_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument(
        "config",
        nargs="?",
        help="YAML run config, e.g. configs/quickstart.yaml (not with --resume)",
    )
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=10")
    train.add_argument("--workers", type=int, help="rollout workers (rollout.num_workers)")
    train.add_argument(
        "--address",
        type=_nonempty,
        help="join an existing Ray cluster: 'auto' or ray://host:10001 (default: "
        "$RAY_ADDRESS if set, else start a Ray of the run's own, even where `ray start` runs "
        "on this machine)",
    )
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        type=_nonempty,
        help="continue a stopped, crashed or killed run from its last checkpoint (its buffer, "
        "schedule and curves too); overrides may lengthen it (run.steps=...) or change how "
        "it runs, not what it trains: run.steps, eval_every, checkpoint_every, "
        "keep_checkpoints, tensorboard, report, start_timeout_s; rollout.num_workers, "
        "max_restarts, batch_timeout_s, vllm.gpu_memory_utilization; buffer.redis_url, "
        "push_timeout_s",
    )
    train.set_defaults(func=_lazy("cmd_train"))

    evaluate = sub.add_parser(
        "eval",
        help="held-out accuracy of a run's latest checkpoint or of a model directory",
    )
    evaluate.add_argument("target", help="a run directory or a Hugging Face model directory")
    evaluate.add_argument("overrides", nargs="*", help="dotted config overrides")
    evaluate.add_argument(
        "--task", type=_nonempty, help="task name (default: the run's task, or arithmetic)"
    )
    evaluate.add_argument("--prompts", type=int, help="held-out prompts (task.eval_prompts)")
    evaluate.add_argument(
        "--temperature", type=float, help="sampling temperature (task.eval_temperature)"
    )
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.set_defaults(func=_lazy("cmd_eval"))

    report = sub.add_parser("report", help="(re)build a run's report.html and plots")
    report.add_argument("run_dir", help="a run directory, e.g. runs/quickstart-20261122-101500")
    report.set_defaults(func=_lazy("cmd_report"))

    scale = sub.add_parser("scale", help="change the number of rollout workers of a running job")
    scale.add_argument("run_dir", help="the running job's run directory")
    scale.add_argument("--workers", type=int, required=True, help="new number of workers")
    scale.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the driver to confirm"
    )
    scale.set_defaults(func=_lazy("cmd_scale"))

    sweep = sub.add_parser(
        "sweep",
        help="run a grid of configs (sync settings x algorithms x seeds) and one combined report",
        description="Run every cell of SWEEP.yaml's grid as a run directory under "
        "<output_dir>/<name>/runs/, then write the combined report (report.html, plots/, "
        "summary.md/.csv/.json) next to it. Resumable: run it again and completed cells are "
        "skipped, incomplete ones continue from their last checkpoint (those that cannot are "
        "set aside under incomplete/ and rerun). Ctrl-C stops the running cells cleanly; a "
        "second stops them at once, a third (--parallel) kills them. The file format "
        "is documented in configs/sweeps/tiny.yaml.",
    )
    sweep.add_argument("sweep_file", help="sweep file, e.g. configs/sweeps/tiny.yaml")
    sweep.add_argument(
        "--out", type=_nonempty, help="parent of the sweep directory (default: its output_dir)"
    )
    sweep.add_argument(
        "--parallel", type=int, default=1, help="cells at once, each a `staleflow train` process"
    )
    sweep.add_argument(
        "--address",
        type=_nonempty,
        help="run the cells on this Ray cluster ('auto', ray://...; default: $RAY_ADDRESS if "
        "set, else a Ray of the sweep's own)",
    )
    sweep.add_argument("--dry-run", action="store_true", help="list the cells and exit")
    sweep.add_argument(
        "--report-only", action="store_true", help="rebuild the report from the cells so far"
    )
    sweep.set_defaults(func=_lazy("cmd_sweep"))

    replay = sub.add_parser(
        "replay",
        help="retrain a run from its initial weights on exactly the groups each step consumed",
        description="Rebuild the learner from RUN_DIR/config.json, feed it the recorded "
        "sequence of groups (RUN_DIR/trajectories/) step by step, and compare its metrics "
        "with the run's metrics.jsonl. Exit status 0 when every step reproduces, 1 if not.",
    )
    replay.add_argument("run_dir", help="a finished or stopped run directory")
    replay.add_argument("--steps", type=int, help="replay only the first N steps")
    replay.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance [1e-5]")
    replay.add_argument("--atol", type=float, default=1e-7, help="absolute tolerance [1e-7]")
    replay.set_defaults(func=_lazy("cmd_replay"))


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Options and dotted overrides in any order: `train CONFIG --address A run.steps=5`
    works as well as `train CONFIG run.steps=5 --address A` (argparse alone stops taking
    positionals once an option came between them)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    options = [a for a in extra if a.startswith("-")]
    if options or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(options or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]  # checked like any override
    config = getattr(args, "config", None)
    if getattr(args, "resume", None) and config is not None and "=" in config:
        args.overrides, args.config = [config, *args.overrides], None  # `--resume D k=v`
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
