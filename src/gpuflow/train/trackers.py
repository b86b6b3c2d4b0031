"""Experiment trackers: every record ``metrics.jsonl`` gets, also sent to TensorBoard or
Weights & Biases when ``log.tensorboard`` / ``log.wandb`` ask for it.

A tracker sees the records the loop writes, after their scalars have landed on the host: it
adds no device work and no host wait to the step. The run's config and device go with the
first record (TensorBoard: as text; W&B: as the run's config). Rank 0 alone tracks.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from gpuflow.common.errors import GpuflowError, first_line
from gpuflow.train.config import RunConfig, to_dict

TENSORBOARD_DIR = "tensorboard"  # under the run folder


class Tracker(Protocol):
    def record(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers, less its step (the axis)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool)
    }


class TensorBoardTracker:
    """Scalars in TensorBoard event files under ``runs/<name>/tensorboard/``. A resumed run
    hides what an earlier session wrote from ``first_step`` on (steps trained again, as
    metrics.jsonl drops them), so each step is shown once."""

    def __init__(self, run_dir: Path, about: Mapping[str, Any], first_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # (check_trackers found the package)

        self._writer = SummaryWriter(
            log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=first_step
        )
        text = f"```\n{json.dumps(about, indent=2)}\n```"
        self._writer.add_text("run", text, first_step or 0)

    def record(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for key, value in _scalars(record).items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run, resumed with the run folder (its id comes from the folder's
    path). ``WANDB_MODE=offline`` keeps it on disk, under the run folder."""

    def __init__(self, run_dir: Path, about: Mapping[str, Any], project: str, name: str) -> None:
        import wandb  # (check_trackers found the package)

        run_dir = Path(run_dir).absolute()
        run_id = f"{run_dir.name[:40]}-{hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]}"
        try:
            self._run = wandb.init(
                project=project, name=name or run_dir.name, id=run_id, resume="allow",
                dir=str(run_dir), config=dict(about),
            )  # fmt: skip
        except wandb.Error as exc:  # no login, no network, a project it may not write to
            raise GpuflowError(
                f"log.wandb could not start a W&B run: {first_line(exc)}; run `wandb login`, or "
                "set WANDB_MODE=offline to keep the run on disk (log.wandb=false to go without)"
            ) from None

    def record(self, record: Mapping[str, Any]) -> None:
        self._run.log(_scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


def check_trackers(config: RunConfig) -> None:
    """Refuse, with one line, a tracker whose package is missing (before the run starts)."""
    for wanted, module, extra in (
        (config.log.tensorboard, "tensorboard", "tensorboard"),
        (config.log.wandb, "wandb", "wandb"),
    ):
        if not wanted:
            continue
        try:
            __import__(module)
        except ImportError:
            raise GpuflowError(
                f"log.{extra} needs the {module} package: pip install 'gpuflow[{extra}]' "
                f"(or set log.{extra}=false)"
            ) from None


def open_trackers(
    config: RunConfig, run_dir: Path, device: Mapping[str, Any], first_step: int | None = None
) -> list[Tracker]:
    """The trackers ``config.log`` asks for, opened (``check_trackers`` first); a resumed
    run's ``first_step`` is the first it records again (None: a new run)."""
    about = {"config": to_dict(config), "device": dict(device)}
    trackers: list[Tracker] = []
    try:
        if config.log.tensorboard:
            trackers.append(TensorBoardTracker(run_dir, about, first_step))
        if config.log.wandb:
            trackers.append(
                WandbTracker(run_dir, about, config.log.wandb_project, config.log.wandb_run)
            )
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers
