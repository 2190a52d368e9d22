"""The `staleflow` command line.

    staleflow --version
    staleflow config CONFIG [section.key=value ...]   validate a run config, print it resolved
    staleflow losses [NAME]                            list loss presets and their defaults
    staleflow buffer stats (--redis-url URL | --run-dir DIR) --run RUN [--json]

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


def _version() -> str:
    try:
        return version("staleflow")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _cmd_config(args: argparse.Namespace) -> int:
    from staleflow.configs import ConfigError, dump_config, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(dump_config(cfg))
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
    from staleflow.buffer.server import RedisServerError, read_server_url, redis_dir

    try:
        url = args.redis_url or read_server_url(redis_dir(args.run_dir))
        if args.run is None and args.run_dir is None:
            raise ValueError("--redis-url needs --run RUN, the run whose buffer to inspect")
        run = args.run or Path(args.run_dir).name
        with ReplayBuffer(url, run) as buffer:
            stats = buffer.stats()
    except (BufferConnectionError, RedisServerError, ValueError) as exc:
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
    where.add_argument("--redis-url", help="redis:// or rediss:// URL of the server")
    where.add_argument(
        "--run-dir", help="a run directory; its embedded Redis server is found through it"
    )
    stats.add_argument("--run", help="run name (default: the run directory's name)")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(func=_cmd_buffer_stats)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
