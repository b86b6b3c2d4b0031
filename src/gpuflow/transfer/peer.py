"""Device-to-device copies, between two GPUs or within one: ``peer_copy``.

    peer_copy(shard_on_1, shard_on_0)   # cuda:0 -> cuda:1, counted once as d2d

The copy is ordered after the work queued on both devices' current streams, and work queued
next on the destination's current stream sees the result; the host never waits. Work on
other streams must be ordered by hand.

What torch guarantees and does not, and when a tensor may be freed:
docs/architecture/crossings.md (Device-to-device copies).
"""

from __future__ import annotations

import torch

from gpuflow.accounting.tally import housekeeping, report_copy
from gpuflow.common.errors import GpuflowError


def _check(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One-line errors for what ``peer_copy`` refuses, raised before any device work."""
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor):
            raise GpuflowError(f"peer_copy takes tensors, got {type(t).__name__} for {name}")
        if t.device.type == "cpu":
            raise GpuflowError(
                f"peer_copy copies between device tensors, but {name} is on the cpu; "
                "host copies go through DeviceLoader, unpack or HostMirror"
            )
    if dst.device.type != src.device.type:
        raise GpuflowError(
            f"peer_copy needs devices of one type, got dst on {dst.device} and src on {src.device}"
        )
    if dst.shape != src.shape:
        raise GpuflowError(
            f"peer_copy needs equal shapes, got dst {tuple(dst.shape)} and src "
            f"{tuple(src.shape)}; it neither broadcasts nor reshapes"
        )
    if dst.dtype != src.dtype:
        raise GpuflowError(
            f"peer_copy needs equal dtypes, got dst {dst.dtype} and src {src.dtype}; "
            "convert on one device before or after the copy"
        )


def peer_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = True) -> torch.Tensor:
    """Copy ``src`` into ``dst``, on the same GPU or two; returns ``dst``. Never syncs the host.

    Both must be device tensors of one device type (meta tensors pass too: they move
    nothing, so the checks and the accounting run without an accelerator), of equal shape
    and dtype. Stream order: see the module docstring. The copy counts once in the ledgers
    open on this thread, as ``d2d`` of ``dst``'s bytes (op ``peer_copy``), within one device
    too: the ledger itself counts only a copy between two devices, so the copy
    itself is kept out of it and reported here, as ``DeviceLoader`` does with its batches.
    """
    _check(dst, src)
    with housekeeping():  # counted by the report below, whichever devices it joins
        dst.copy_(src, non_blocking=non_blocking)
    dtype = str(dst.dtype).removeprefix("torch.")
    report_copy("d2d", dst.numel() * dst.element_size(), "peer_copy", dtype, None)
    return dst
