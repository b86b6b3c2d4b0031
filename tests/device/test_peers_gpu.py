"""The peer table and device-to-device bandwidth on real GPUs (peer_copy on them:
tests/transfer/test_peer_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from gpuflow.device.accelerator import Device
from gpuflow.device.peers import (
    enable_peer_access,
    measure_d2d,
    peer_access_matrix,
    peer_bandwidth_table,
)

pytestmark = pytest.mark.gpu


def test_measure_d2d_within_a_gpu(gpu0):
    rate = measure_d2d(gpu0, gpu0, nbytes=16 << 20, repeats=3)
    assert rate > 1.0  # GB/s, read + write; an H100 gives thousands


def test_the_peer_table_over_every_gpu(gpu0):
    gpus = [Device("cuda", i) for i in range(torch.cuda.device_count())]
    table = peer_bandwidth_table(gpus, nbytes=8 << 20, repeats=2)
    n = len(gpus)
    assert table["devices"] == [str(d) for d in gpus]
    assert table["access"] == peer_access_matrix(gpus)
    assert all(table["access"][i][i] for i in range(n))
    assert [len(row) for row in table["gb_per_s"]] == [n] * n
    assert all(rate > 0 for row in table["gb_per_s"] for rate in row)
    assert enable_peer_access(0, 0) is True
