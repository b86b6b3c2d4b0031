"""Device-to-device copies, between two GPUs or within one: ``peer_copy``.

    peer_copy(shard_on_1, shard_on_0)   # cuda:0 -> cuda:1, counted once as d2d

What torch guarantees for a copy between two CUDA devices (``copy_``; ATen's
``copy_device_to_device``): it runs on the *source* device's current stream, after that
stream waits for an event recorded on the *destination* device's current stream; then the
destination's current stream waits for an event recorded after the copy. So the copy starts
after the work already queued on both current streams (what writes ``src``, what still uses
``dst``'s memory), and work queued next on the destination's current stream sees the
result. The host never waits: a device-to-device copy is asynchronous whatever
``non_blocking`` says. Peer access is enabled by torch on the first copy between two GPUs
(``gpuflow.device.peers``); without it the driver stages the copy through host memory.

What torch does not order: streams other than the two current ones. Work on a side stream
that reads ``dst`` must wait for the destination's current stream first. The caching
allocator reuses a freed block in the order of the stream it was allocated on: for tensors
allocated on their device's current stream (the usual case), either may be freed right
after the call, since both current streams are ordered after the copy; a tensor from
another stream needs ``record_stream``, as with any cross-stream use.
"""

from __future__ import annotations

import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.transfer.tally import housekeeping, report_copy


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
    too: the ledger's dispatch mode counts only a copy between two devices, so the copy
    itself is kept out of it and reported here, as ``DeviceLoader`` does with its batches.
    """
    _check(dst, src)
    with housekeeping():  # counted by the report below, whichever devices it joins
        dst.copy_(src, non_blocking=non_blocking)
    dtype = str(dst.dtype).removeprefix("torch.")
    report_copy("d2d", dst.numel() * dst.element_size(), "peer_copy", dtype, None)
    return dst
