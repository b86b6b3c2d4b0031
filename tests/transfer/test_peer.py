"""peer_copy on the cpu: its checks and its accounting.

Meta tensors stand in for device tensors (as in tests/accounting/test_ledger.py): a copy between
them moves nothing but goes through peer_copy's checks and report. Copies on real GPUs are in
tests/transfer/test_peer_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpuflow
from gpuflow.accounting.ledger import TransferLedger
from gpuflow.common.errors import GpuflowError
from gpuflow.transfer.peer import peer_copy
from tests.helpers import line_holding

HERE = Path(__file__).name


def _line(marker: str) -> int:
    return line_holding(__file__, marker)


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    ("dst", "src", "message"),
    [
        (
            _meta(2, 3),
            _meta(3, 2),
            "peer_copy needs equal shapes, got dst (2, 3) and src (3, 2); "
            "it neither broadcasts nor reshapes",
        ),
        (
            _meta(4),
            _meta(4, dtype=torch.bfloat16),
            "peer_copy needs equal dtypes, got dst torch.float32 and src torch.bfloat16; "
            "convert on one device before or after the copy",
        ),
        (
            _meta(4),
            torch.zeros(4),
            "peer_copy copies between device tensors, but src is on the cpu; "
            "host copies go through DeviceLoader, unpack or HostMirror",
        ),
        (_meta(4), [0.0] * 4, "peer_copy takes tensors, got list for src"),
    ],
)
def test_peer_copy_refuses_with_one_line_before_any_device_work(dst, src, message):
    with TransferLedger("cpu") as ledger, pytest.raises(GpuflowError) as caught:
        peer_copy(dst, src)
    assert str(caught.value) == message
    assert "\n" not in message
    assert ledger.events == []  # refused before the copy: nothing counted


def test_peer_copy_counts_once_as_d2d_with_its_bytes_and_caller():
    dst, src = _meta(16, 8, dtype=torch.bfloat16), _meta(16, 8, dtype=torch.bfloat16)
    with TransferLedger("cpu") as ledger:
        out = peer_copy(dst, src)  # the-copy
    assert out is dst
    [event] = ledger.events
    assert (event.kind, event.op, event.nbytes, event.dtype) == (
        "d2d",
        "peer_copy",
        256,
        "bfloat16",
    )
    assert (event.pinned, event.blocking) == (None, False)
    assert event.location.endswith(f"{HERE}:{_line('# the-copy')}")
    totals = ledger.summary().totals
    assert (totals.d2d_bytes, totals.d2d_copies, totals.h2d_bytes, totals.syncs) == (256, 1, 0, 0)


def test_peer_copy_is_a_public_name():
    assert gpuflow.peer_copy is peer_copy
    assert "peer_copy" in gpuflow.__all__
