"""The loop's cadence (when it logs, evaluates and checkpoints) and ``run_steps``, the loop the
benches and ``profile`` measure: every step, and the readback where an interval ends."""

from __future__ import annotations

from types import SimpleNamespace

from gpuflow.train.config import resolve_config
from gpuflow.train.trainer import Cadence, run_steps


def _train_config(**settings: int):
    return resolve_config("tiny", None, [f"train.{k}={v}" for k, v in settings.items()]).train


def test_the_cadence_logs_evaluates_and_checkpoints_on_its_intervals_and_at_the_end():
    cadence = Cadence(
        _train_config(steps=25, log_interval=5, eval_interval=10, checkpoint_interval=8)
    )
    done = range(1, 26)
    assert [d for d in done if cadence.logs(d)] == [5, 10, 15, 20, 25]
    assert [d for d in done if cadence.evaluates(d)] == [10, 20, 25]  # and the last step
    assert [d for d in done if cadence.checkpoints(d, stopping=False)] == [8, 16, 24, 25]
    assert cadence.checkpoints(3, stopping=True)  # a stop asked for saves where it is
    # Train records close on logging steps and at the end, never at a checkpoint between.
    assert [d for d in done if cadence.records(d)] == [5, 10, 15, 20, 25]
    uneven = Cadence(_train_config(steps=23, log_interval=5, checkpoint_interval=8))
    assert [d for d in range(1, 24) if uneven.records(d)] == [5, 10, 15, 20, 23]


class _Step:
    """What ``run_steps`` asks of a train step, recording each call."""

    def __init__(self, log_interval: int) -> None:
        self.config = SimpleNamespace(log_interval=log_interval)
        self.calls: list[tuple[str, int]] = []

    def __call__(self, step: int) -> None:
        self.calls.append(("step", step))

    def readback(self, done: int) -> None:
        self.calls.append(("readback", done))


def test_run_steps_runs_each_step_and_reads_back_where_an_interval_ends():
    step = _Step(log_interval=3)
    after: list[int] = []
    run_steps(step, 2, 8, after.append)
    assert step.calls == [
        ("step", 2), ("readback", 3), ("step", 3), ("step", 4), ("step", 5), ("readback", 6),
        ("step", 6), ("step", 7),
    ]  # fmt: skip
    assert after == [2, 3, 4, 5, 6, 7]
    nothing = _Step(log_interval=1)
    run_steps(nothing, 4, 4)
    assert nothing.calls == []
