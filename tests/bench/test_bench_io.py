"""``gpuflow bench io`` off CUDA: bad settings and a device it cannot read into are refused
before anything is written (the bench itself: test_bench_io_gpu.py)."""

from __future__ import annotations

import pytest

from gpuflow.bench.io import IoBenchConfig, run_io_bench
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device


def test_bad_sizes_are_refused():
    with pytest.raises(GpuflowError, match="--mib and --repeats must be >= 1, got 0, 3"):
        IoBenchConfig(mib=0)
    with pytest.raises(GpuflowError, match="got 8, 0"):
        IoBenchConfig(mib=8, repeats=0)


def test_the_cpu_is_refused_before_any_shard_is_written(tmp_path):
    with pytest.raises(GpuflowError, match="bench io reads into CUDA memory; the device is cpu"):
        run_io_bench(Device("cpu"), IoBenchConfig(mib=1, scratch=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []
