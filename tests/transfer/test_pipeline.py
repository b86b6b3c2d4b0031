"""The loader's pipeline driven by hand on the cpu, as DeviceLoader drives it: an
epoch read ahead, staged, copied and taken in order; small batches sharing one copy when it
coalesces; and everything given back on release."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.packing import Planner
from gpuflow.transfer.pipeline import Pipeline
from gpuflow.transfer.staging import Epoch

CPU = Device("cpu")


def _run_epoch(pipeline: Pipeline, batches: list) -> list:
    epoch = Epoch(iter(batches), False)
    pipeline.epochs.append(epoch)
    key = CPU.current_stream_key()
    taken = []
    while True:
        pipeline.top_up(epoch)
        pipeline.issue_ready(epoch, key)
        got = pipeline.take(epoch, key)
        if got is None:
            return taken
        taken.append(got[0])


@pytest.mark.parametrize("coalesce", [False, True])
def test_an_epoch_arrives_in_order_narrowed_and_coalesced_when_asked(coalesce):
    pipeline = Pipeline(CPU, 2, Planner(True, None), None, timing=False, coalesce=coalesce)
    batches = [np.full((4, 8), i, dtype=np.int64) for i in range(6)]
    taken = _run_epoch(pipeline, batches)
    assert [int(b[0, 0]) for b in taken] == list(range(6))
    assert all(b.dtype == torch.int64 and b.shape == (4, 8) for b in taken)
    counts = pipeline.counts
    assert counts["batches"] == 6 and counts["logical_bytes"] == 6 * 4 * 8 * 8
    assert counts["bytes_moved"] < counts["logical_bytes"]  # ids below 256 cross narrowed
    # small batches read ahead share one staging buffer and one copy when coalescing
    assert counts["copies"] == (1 if coalesce else 6)
    pipeline.release()
    assert pipeline.released


def test_each_batch_is_its_own_tensor_not_a_view_of_a_reused_buffer():
    pipeline = Pipeline(CPU, 2, Planner(False, None), None, timing=False, coalesce=True)
    taken = _run_epoch(pipeline, [np.arange(16, dtype=np.float32) * i for i in range(4)])
    for i, batch in enumerate(taken):
        assert torch.equal(batch, torch.arange(16, dtype=torch.float32) * i)
    pipeline.release()
