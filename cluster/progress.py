"""The live progress display: a rich bar with step, reward, accuracy, lag, tokens/s and ETA.

On a terminal it redraws in place; elsewhere (CI, a pipe, a log file) it prints one plain line
every `log_every` steps instead, so logs stay readable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
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
from rich.table import Column

__all__ = ["Progress"]


class Progress:
    def __init__(
        self,
        run_name: str,
        log_every: int = 1,
        console: Console | None = None,
        clock: Callable[[], float] | None = None,  # (tests: a fake clock)
    ) -> None:
        self.console = console or Console(stderr=True)
        self.run_name, self.log_every = run_name, log_every
        self.live = self.console.is_terminal
        self.accuracy: float | None = None
        # Step N/M, time and ETA first, at fixed widths; the stats take what is left of the
        # line and are cut at its end (at 80 columns the run name and stats pushed the step
        # count and the ETA off the line). The run name was printed when the run started.
        self.bar = RichProgress(
            MofNCompleteColumn(),
            BarColumn(bar_width=16),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn(
                "{task.fields[stats]}",
                table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1),
            ),
            console=self.console,
            disable=not self.live,
            # the ETA from the steps of the last hour: rich's 30 s default gave no estimate
            # at all once steps were more than 30 s apart (the CPU demo's are ~50 s)
            speed_estimate_period=3600.0,
            expand=True,
            get_time=clock,
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
