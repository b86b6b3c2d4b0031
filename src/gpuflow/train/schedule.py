"""The learning-rate schedule: linear warmup over ``warmup_steps``, then cosine decay to
``lr * min_lr_ratio`` at ``schedule_steps``, and that rate after it.

One formula, two forms: ``lr_at`` on a Python step (logs, eager steps) and ``lr_tensor`` on
a 0-d device step tensor (the captured step, where a Python float would be baked into the
graph at capture). Both call ``_rate`` with their own cos, clamp and select.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch

from gpuflow.train.config import TrainConfig

Number = TypeVar("Number", float, torch.Tensor)


def _rate(
    step: Number,
    config: TrainConfig,
    cos: Callable[[Number], Number],
    clamp01: Callable[[Number], Number],
    select: Callable[[bool | torch.Tensor, Number, Number], Number],
) -> Number:
    warm = config.lr * (step + 1) / max(1, config.warmup_steps)
    span = max(1, config.schedule_steps - config.warmup_steps)
    progress = clamp01((step - config.warmup_steps) / span)
    floor = config.lr * config.min_lr_ratio
    decayed = floor + 0.5 * (config.lr - floor) * (1 + cos(math.pi * progress))
    return select(step < config.warmup_steps, warm, decayed)


def lr_at(step: int, config: TrainConfig) -> float:
    """The learning rate of step ``step``."""
    return _rate(
        float(step),
        config,
        math.cos,
        lambda p: min(1.0, max(0.0, p)),
        lambda warming, warm, decayed: warm if warming else decayed,
    )


def lr_tensor(step: torch.Tensor, config: TrainConfig) -> torch.Tensor:
    """``lr_at`` of a 0-d integer step tensor, computed on its device (no sync)."""
    return _rate(step.float(), config, torch.cos, lambda p: p.clamp(0.0, 1.0), torch.where)
