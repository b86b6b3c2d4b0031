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


def warmup_notice(config: TrainConfig) -> str | None:
    """What to tell a run whose schedule ends inside its warm-up, where the learning rate
    never follows its cosine (a short trial, ``--steps 30`` on ``tiny``, is one); None
    otherwise."""
    if config.schedule_steps > config.warmup_steps + 1:  # (one more: the peak's own step)
        return None
    if config.steps <= config.warmup_steps:
        return (
            f"note: the run's {config.steps} steps are all warm-up (train.warmup_steps is "
            f"{config.warmup_steps}): it trains entirely in warm-up, its learning rate rising "
            f"to {lr_at(config.steps - 1, config):.2e} of train.lr {config.lr:g} and never "
            "decaying; train more --steps, or lower train.warmup_steps (e.g. --set "
            f"train.warmup_steps={config.steps // 10})"
        )
    return (
        f"note: train.decay_steps ({config.decay_steps}) leaves no room for a decay after "
        f"the warm-up of {config.warmup_steps} steps: the learning rate rises over steps 0 to "
        f"{config.warmup_steps - 1}, trains step {config.warmup_steps} at its peak, then drops "
        f"at once to its final {lr_at(config.steps, config):.2e}; set train.decay_steps "
        f"above {config.warmup_steps + 1}"
    )


def finished_run(run_dir: object, done: int, steps: int, trained: TrainConfig) -> str:
    """Why a run that has trained ``done`` steps cannot go on to ``steps``, and how to train
    it further: where the rate at ``done`` follows the length of the schedule it trained
    with (``trained``), more steps alone would move it, which a resume refuses; so the
    advice names the decay setting too, with that schedule's own length."""
    said = (
        f"{run_dir} already finished {done} of {steps} steps" if done == steps
        else f"{run_dir} already trained {done} steps, more than the {steps} asked for"
    )  # fmt: skip
    more = f"train further with --steps N (N > {done})"
    if trained.decay_steps or done < trained.warmup_steps:  # (a warm-up knows no length)
        return f"{said}; {more}"
    return (
        f"{said}; {more} and --set train.decay_steps={trained.schedule_steps} to keep its "
        "learning-rate schedule (the new steps train at its final rate), or --set "
        "train.decay_steps=N to stretch it over all N"
    )
