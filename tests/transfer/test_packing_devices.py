"""unpack to a device this machine lacks: gpuflow's one-line refusal, however the device is
named, where torch would end in its own AssertionError."""

from __future__ import annotations

import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.transfer.packing import pack, unpack

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")


@no_cuda
@pytest.mark.parametrize(
    "device", [torch.device("cuda"), torch.device("cuda", 1), "cuda", "cuda:0"], ids=str
)
def test_unpack_to_a_missing_device_is_one_line(device):
    packed = pack({"ids": torch.arange(6), "mask": torch.ones(6, dtype=torch.bool)})
    with pytest.raises(GpuflowError, match=r"device 'cuda(:\d)?' is not available") as caught:
        unpack(packed, device)
    assert "\n" not in str(caught.value)
    # What torch itself says, which the refusal replaces.
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        packed.buffer.to(torch.device("cuda"))


def test_unpack_to_a_torch_device_that_exists_still_rebuilds_the_batch():
    batch = {"ids": torch.arange(6), "lists": [[1, 2], [3]]}
    for device in (torch.device("cpu"), torch.device("meta")):
        out = unpack(pack(batch), device)
        assert out["ids"].device.type == device.type and out["ids"].shape == (6,)
    out = unpack(pack(batch), torch.device("cpu"))
    assert torch.equal(out["ids"], batch["ids"])
    assert [t.tolist() for t in out["lists"]] == [[1, 2], [3]]  # a Ragged, as sequences
