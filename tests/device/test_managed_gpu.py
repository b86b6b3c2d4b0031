"""data.placement=managed: the resident corpus in CUDA managed memory trains as the
device-resident one does, and a request past the device's free memory is refused."""

from __future__ import annotations

import pytest
import torch

from gpuflow.common.errors import GpuflowError
from tests.helpers import tiny_runs

pytestmark = pytest.mark.gpu


@pytest.fixture
def managed(accel):
    if accel.type != "cuda":
        pytest.skip("managed memory is CUDA's")
    pytest.importorskip("cuda.bindings", reason="needs cuda-python (gpuflow[managed])")
    from gpuflow.device import managed

    return managed


def test_a_managed_corpus_trains_as_a_device_resident_one(accel, managed, prepared, workdir):
    runs = tiny_runs(accel, prepared, workdir, "data.placement", ("device", "managed"))
    (device, _), (managed, _) = runs["device"], runs["managed"]
    assert len(managed) == 20
    assert managed == device  # the same tokens, the same step


def test_managed_memory_holds_what_is_written_and_refuses_past_free(accel, managed):
    tokens = managed.managed_empty(1 << 20, torch.int16, accel)  # (1M,) int16
    tokens.copy_(torch.arange(1 << 20, device=accel.torch).to(torch.int16))
    managed.prefetch_to_device(tokens)
    expected = torch.arange(1 << 20).to(torch.int16)
    assert torch.equal(tokens.cpu(), expected)
    free, _ = torch.cuda.mem_get_info(accel.index)
    with pytest.raises(GpuflowError, match="past the free memory is refused"):
        managed.managed_empty(free // 2 + (1 << 30), torch.int16, accel)
