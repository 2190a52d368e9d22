"""The learning-rate schedule as a pure function (no torch: the driver uses it too)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["lr_factor"]


def lr_factor(cfg: Any) -> Callable[[int], float]:
    """The factor on `learner.optimizer.lr` at each optimizer step (LambdaLR's lambda).

    The schedule counts optimizer steps: `mini_batches` per epoch, `epochs` per learner
    step, over `run.steps` learner steps; so warmup_cosine's horizon moves with run.steps."""
    opt = cfg.learner.optimizer
    total = int(cfg.run.steps) * cfg.learner.mini_batches * cfg.learner.epochs
    warmup, floor = int(opt.warmup_steps), float(opt.min_lr_ratio)

    def factor(step: int) -> float:
        if opt.schedule == "constant":
            return 1.0
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
