"""The driver's host-to-device copy on CUDA: queued on a stream from pinned memory, it lands
the bytes as torch's copy would."""

from __future__ import annotations

import pytest
import torch

from gpuflow.device.drivercopy import driver_copy

pytestmark = pytest.mark.gpu


def test_a_driver_copy_from_pinned_memory_lands_the_bytes(accel):
    if accel.type != "cuda":
        pytest.skip(f"the driver copy is CUDA's; this accelerator is {accel.type}")
    copy = driver_copy()
    assert copy is not None
    host = torch.arange(1 << 16, dtype=torch.int32).pin_memory()
    device = torch.zeros(1 << 16, dtype=torch.int32, device=accel.torch)
    stream = torch.cuda.Stream(device=accel.torch)
    with torch.cuda.stream(stream):
        result = copy(device.data_ptr(), host.data_ptr(), host.numel() * 4, stream.cuda_stream)
    assert result == 0  # CUDA_SUCCESS: queued
    stream.synchronize()
    assert torch.equal(device.cpu(), host)
