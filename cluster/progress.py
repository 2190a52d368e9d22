"""The live progress display: a rich bar with step, reward, accuracy, lag, tokens/s and ETA.

On a terminal it redraws in place; elsewhere (CI, a pipe, a log file) it prints one plain line
every `log_every` steps instead, so logs stay readable.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress

__all__ = ["Progress"]


class Progress:
    def __init__(self, run_name: str, log_every: int = 1, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.run_name, self.log_every = run_name, log_every
        self.live = self.console.is_terminal
        self.accuracy: float | None = None
        self.bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.live,
        )
        self.task: Any = None

    def start(self, total: int) -> None:
        self.bar.start()
        self.task = self.bar.add_task(self.run_name, total=total, stats="starting")

    def step(self, step: int, m: dict[str, Any]) -> None:
        stats = (
            f"reward {m['reward_mean']:.3f}  acc {self._acc()}  lag {m['lag_mean']:.1f}"
            f" (max {m['lag_max']:.0f})  {m['tokens_per_s']:.0f} tok/s  "
            f"busy L {m['learner_busy']:.0%} R {m['rollout_busy']:.0%}"
        )
        self.bar.update(self.task, completed=step, stats=stats)
        if not self.live and (step % self.log_every == 0):
            print(f"[{self.run_name}] step {step}  {stats}", file=sys.stderr, flush=True)

    def eval(self, step: int, accuracy: float) -> None:
        self.accuracy = accuracy
        message = f"[{self.run_name}] held-out accuracy at step {step}: {accuracy:.3f}"
        if self.live:
            self.bar.console.print(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def _acc(self) -> str:
        return "-" if self.accuracy is None else f"{self.accuracy:.3f}"

    def stop(self) -> None:
        self.bar.stop()
