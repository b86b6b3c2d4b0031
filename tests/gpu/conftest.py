"""The accelerator every gpu test runs on (the gpu marker's skip is in tests/conftest.py)."""

from __future__ import annotations

import pytest

from gpuflow.device.accelerator import Device


@pytest.fixture
def accel() -> Device:
    return Device.resolve("auto")


def tiny_runs(accel: Device, prepared, folder, setting: str, values) -> dict[str, tuple]:
    """20 steps of the tiny preset on ``prepared`` for each value of ``setting``, by value:
    (the train loss of every step, the run's ``TrainResult``)."""
    from gpuflow.train.config import resolve_config
    from gpuflow.train.runfolder import read_metrics
    from gpuflow.train.trainer import Trainer

    from ..conftest import FAST

    sets = [*FAST, f"data.dir={prepared}", "train.steps=20", "train.log_interval=1"]
    runs = {}
    for value in values:
        config = resolve_config("tiny", None, [*sets, f"{setting}={value}"])
        result = Trainer(config, folder / "runs" / value, accel).run()
        losses = [r["loss"] for r in read_metrics(result.run_dir) if "loss" in r]
        runs[value] = (losses, result)
    return runs
