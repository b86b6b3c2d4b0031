"""peer_copy on real GPUs: within one GPU, and between two where the machine has them (the
gpu0 and gpu1 fixtures skip otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuflow.accounting.ledger import TransferLedger
from gpuflow.device.accelerator import Device
from gpuflow.device.peers import enable_peer_access
from gpuflow.transfer.peer import peer_copy
from tests.helpers import line_holding

pytestmark = pytest.mark.gpu

HERE = Path(__file__).name


def _line(marker: str) -> int:
    return line_holding(__file__, marker)


def _busy(device: Device, ms: float = 30.0) -> None:
    """Keep ``device``'s current stream busy for about ``ms``, so later work queues behind."""
    with torch.cuda.device(device.index):
        torch.cuda._sleep(int(ms * 2e6))  # cycles: at least ms at clocks up to 2 GHz


def _counted_once(ledger: TransferLedger, nbytes: int, marker: str) -> None:
    [event] = ledger.events  # one copy, no host wait
    assert (event.kind, event.op, event.nbytes, event.blocking) == (
        "d2d",
        "peer_copy",
        nbytes,
        False,
    )
    assert event.location.endswith(f"{HERE}:{_line(marker)}")
    totals = ledger.summary().totals
    assert (totals.d2d_bytes, totals.d2d_copies) == (nbytes, 1)
    assert (totals.h2d_bytes, totals.d2h_bytes, totals.syncs) == (0, 0, 0)


def test_peer_copy_within_one_gpu_copies_and_counts_once(gpu0):
    src = torch.randn(1000, 3, device=gpu0.torch)
    dst = torch.empty_like(src)
    with TransferLedger(gpu0) as ledger:
        peer_copy(dst, src)  # copy-on-0
    _counted_once(ledger, 12_000, "# copy-on-0")
    assert torch.equal(dst, src)


def test_peer_copy_between_two_gpus_copies_in_stream_order_and_counts_once(gpu0, gpu1):
    assert enable_peer_access(0, 1) == torch.cuda.can_device_access_peer(0, 1)
    src = torch.zeros(1 << 20, device=gpu0.torch)
    dst = torch.zeros(1 << 20, device=gpu1.torch)
    expected = torch.arange(1 << 20, dtype=torch.float32)
    staged = expected.to(gpu0.torch)  # uploaded (and waited for) before the streams are busied
    # Work still queued on both current streams when the copy is issued: the copy must run
    # after src is written on GPU 0 and after the late write to dst on GPU 1, which would
    # otherwise land last and leave -1s.
    _busy(gpu0, ms=30)
    src.copy_(staged)  # the source, written behind the busy stream
    _busy(gpu1, ms=60)
    dst.fill_(-1.0)
    with TransferLedger(gpu0) as ledger:
        peer_copy(dst, src)  # copy-0-to-1
    _counted_once(ledger, 4 << 20, "# copy-0-to-1")
    # Read on GPU 1's current stream, which torch made wait for the copy.
    assert torch.equal(dst.cpu(), expected)

    back = torch.empty_like(src)
    with TransferLedger(gpu0) as ledger:
        peer_copy(back, dst)  # copy-1-to-0
    _counted_once(ledger, 4 << 20, "# copy-1-to-0")
    assert torch.equal(back.cpu(), expected)
