"""The accelerator every gpu test runs on (the gpu marker's skip is in tests/conftest.py)."""

from __future__ import annotations

import pytest

from gpuflow.device.accelerator import Device


@pytest.fixture
def accel() -> Device:
    return Device.resolve("auto")
