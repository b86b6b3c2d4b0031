"""AsyncScalars and host snapshots on the cpu path (the GPU path is in test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from gpuflow.device import Device
from gpuflow.mirror import AsyncScalars, host_snapshot


def test_async_scalars_report_means_per_interval():
    scalars = AsyncScalars(("loss", "norm"), Device("cpu"), depth=2)
    for v in (1.0, 2.0, 3.0):
        scalars.add(loss=torch.tensor(v), norm=torch.tensor(10 * v))
    assert scalars.flush(3) == [(3, {"loss": 2.0, "norm": 20.0})]
    scalars.add(loss=torch.tensor(5.0), norm=torch.tensor(1.0))
    assert scalars.drain(4) == [(4, {"loss": 5.0, "norm": 1.0})]
    assert scalars.flush(5) == []  # nothing accumulated since


def test_async_scalars_require_every_name():
    scalars = AsyncScalars(("loss", "norm"), Device("cpu"))
    with pytest.raises(ValueError, match="exactly"):
        scalars.add(loss=torch.tensor(1.0))


def test_host_snapshot_is_a_detached_copy():
    weights = {"w": torch.arange(6.0).view(2, 3).t(), "b": torch.ones(3, requires_grad=True)}
    snap = host_snapshot(weights)
    weights["w"].add_(100)
    assert snap["w"].is_contiguous()
    torch.testing.assert_close(snap["w"], torch.arange(6.0).view(2, 3).t())
    assert not snap["b"].requires_grad
