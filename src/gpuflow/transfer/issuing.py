"""Copies and handing out for ``DeviceLoader``: each staged ``Crossing`` copied into fresh
device memory (a large one on a copy stream of its own, through the driver where it takes
the copy), and its batches rebuilt on the device and ordered after the copy on the
consumer's stream when taken. ``Issuer`` does it; the stager (``transfer/staging.py``)
fills the crossings.

Which stream runs which copy, and why: docs/architecture/transfer-pipeline.md.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import torch

from gpuflow.accounting.tally import housekeeping, report_copy
from gpuflow.common.sizes import round_up
from gpuflow.device.accelerator import Device
from gpuflow.device.drivercopy import driver_copy
from gpuflow.transfer.packing import ALIGN, SIDE_STREAM_BYTES, PackPlan, rebuild, rebuild_run
from gpuflow.transfer.pinned import PinnedPool
from gpuflow.transfer.staging import BatchTiming, Crossing, Epoch

# Crossings with copies made as they were read, issued ahead of the consumer's stream before
# the host waits for it (each holds device memory the consumer has not yet let go of).
EARLY_AHEAD = 4


class Issuer:
    """Queues the crossings' copies and hands out their batches. ``pool`` takes each staging
    buffer back once its copy has run; ``counts`` are the loader's stats."""

    def __init__(self, device: Device, pool: PinnedPool, timing: bool) -> None:
        self.device, self.pool, self.timing = device, pool, timing
        self.copy_stream = device.new_stream()
        self.early_stream: Any = None  # copies made as batches are read (made at the first)
        # the consumer's stream as each crossing holding such copies was issued
        self.early_marks: deque[Any] = deque()
        self.fence = device.new_event()  # the consumer's progress, for the copy stream to wait on
        # Copies through the driver (gpuflow.device.drivercopy) unless GPUFLOW_TORCH_COPIES=1.
        use_driver = device.type == "cuda" and not os.environ.get("GPUFLOW_TORCH_COPIES")
        self.driver = driver_copy() if use_driver else None
        # (done event, source tensors) of driver copies from the caller's pinned memory
        self.sources_in_flight: deque[tuple[Any, list[torch.Tensor]]] = deque()
        # stream objects by key: building one per batch would cost host time each batch
        self.streams: dict[Any, Any] = {}
        self.counts = {"batches": 0, "copies": 0, "bytes_moved": 0, "logical_bytes": 0}

    def stream(self, key: Any) -> Any:
        """The stream object of ``key`` (the current stream's)."""
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = self.device.current_stream()
        return stream

    def cross_early(self, source: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        """Copy the pinned ``source`` into fresh device memory now, on a stream that waits
        for nothing else, so the host soon knows it may let the source write that memory
        again: (the device tensor, an event after the copy, a timing event before it when
        timed). torch's copy marks a block of its pinned cache in use until the copy has run.

        The memory is allocated on that stream and handed to the consumer's, so a block comes
        back only once the consumer is done with it: at most ``EARLY_AHEAD`` crossings of
        such copies are issued ahead of the consumer's stream, which bounds the device memory
        they hold when the host runs ahead of the device."""
        if self.early_stream is None:
            self.early_stream = self.device.new_stream()
        with housekeeping():
            while len(self.early_marks) > EARLY_AHEAD:
                self.early_marks.popleft().synchronize()
        start = None
        with housekeeping(), self.device.use_stream(self.early_stream):  # counted when taken
            if self.timing:
                start = self.device.new_event(timing=True)
                start.record(self.early_stream)
            out = torch.empty(source.shape, dtype=source.dtype, device=self.device.torch)
            out.copy_(source, non_blocking=True)
            done = self.device.new_event(timing=self.timing)
            done.record(self.early_stream)
        self.counts["copies"] += 1
        return out, done, start

    def issue(self, crossing: Crossing, key: Any) -> None:
        """One copy of the staged bytes, and one per direct source tensor, into fresh device
        memory; docs/architecture/transfer-pipeline.md says which stream runs it."""
        # (a crossing copied whole as it was read has nothing left to copy here)
        to_copy = crossing.host is not None or any(
            source.is_cpu for sources in crossing.direct_sources for source in sources
        )
        # large copies on a stream of their own, apart from the consumer's work
        side = crossing.wire >= SIDE_STREAM_BYTES and self.device.has_streams and to_copy
        stream = self.stream(key)
        in_flight = self.sources_in_flight
        # Let go of sources whose copies have run (an event query each, cheap): held
        # until a few waited, pinned blocks of 16 MiB came back to torch's cache later and
        # the loader ran at 28 GB/s against 36 (docs/decisions/018).
        while in_flight and in_flight[0][0].query():
            in_flight.popleft()  # copied: the caller may free or reuse them
        target = self.device.torch
        with housekeeping():  # counted when the consumer takes each batch
            if any(plan.has_staged for plan, _ in crossing.parts):  # (even of 0 bytes)
                size = round_up(crossing.nbytes, ALIGN)  # a whole number of any dtype
                crossing.on_device = torch.empty(size, dtype=torch.uint8, device=target)
            crossing.direct_out = [
                [_landing(source, target) for source in sources]
                for sources in crossing.direct_sources
            ]
            for tensor in crossing.early:
                # allocated on the early stream: not reused before the consumer's work on it
                tensor.record_stream(stream)
            if crossing.early:
                mark = self.device.new_event()
                mark.record(stream)
                self.early_marks.append(mark)
            if side:
                # The copy stream first waits for the consumer's work queued so far: the
                # memory was allocated on the consumer's stream and may be a block that work
                # still reads. The wait is also the back-pressure: staging buffers come free
                # no faster than the consumer's stream moves on, which bounds how far the
                # host runs ahead (and the device memory held) when the device is behind.
                self.fence.record(stream)
                with self.device.use_stream(self.copy_stream):
                    self.copy_stream.wait_event(self.fence)
                    self._copy(crossing, self.copy_stream)
                crossing.alloc_stream = stream
            else:
                self._copy(crossing, stream)
                crossing.ready_on = key
            if crossing.host is not None:
                self.pool.release(crossing.host, after=crossing.done)
                crossing.host = None

    def _copy(self, crossing: Crossing, stream: Any) -> None:
        """Queue the crossing's copies on ``stream``, the current one, and the events that
        need them: ``done`` when a staging buffer or a source tensor waits for the copy, or
        the copy runs on the side stream; start and end with timing."""
        start = crossing.early_start  # (the first of its copies made as read, if any)
        if self.timing and start is None:
            start = self.device.new_event(timing=True)
            start.record(stream)
        # Driver copies need the stream's handle, and run in the current device's context only.
        handle = None
        if self.driver is not None and torch.cuda.current_device() == self.device.index:
            handle = stream.cuda_stream
        if crossing.early_done is not None:
            stream.wait_event(crossing.early_done)  # the crossing is ready after those too
        kept: list[torch.Tensor] = []  # direct sources of driver copies, alive until they ran
        if crossing.host is not None and crossing.on_device is not None:  # (bytes staged)
            self._copy_bytes(crossing.on_device, crossing.host.bytes, crossing.nbytes, handle)
        for outs, sources in zip(crossing.direct_out, crossing.direct_sources, strict=True):
            for out, source in zip(outs, sources, strict=True):
                if out is not source and self._copy_bytes(out, source, source.nbytes, handle):
                    kept.append(source)
        crossing.direct_sources = []
        if self.timing or crossing.host is not None or stream is self.copy_stream or kept:
            crossing.done = self.device.new_event(timing=self.timing)
            crossing.done.record(stream)
        if kept:
            self.sources_in_flight.append((crossing.done, kept))
        if self.timing:
            crossing.copy_times = (start, crossing.done)

    def hand_out_at_once(self, plan: PackPlan) -> Any:
        """The batch ``plan`` describes, whose tensors torch pinned for it (DataLoader's pin
        thread) and which all cross where they lie: each copied and allocated by one
        ``.to()`` on the current stream, the batch rebuilt there (docs/decisions/044).
        torch keeps its own pinned blocks until the copies from them have run, so the
        loader keeps nothing."""
        target = self.device.torch
        with housekeeping():  # counted below, as the batch is handed out
            outs = [source.to(target, non_blocking=True) for source in plan.sources]
        batch = rebuild(None, plan.layout.spec, iter(outs))
        self.counts["copies"] += len(outs)
        self._count(plan)
        return batch

    def _count(self, plan: PackPlan) -> None:
        """Count a batch handed out (its copies are counted as they are queued)."""
        counts = self.counts
        counts["batches"] += 1
        # What its copies move: the staging copy takes the buffer's share whole, alignment
        # padding included, so the crossings' bytes add up to what crossed.
        wire = plan.layout.copied_nbytes
        counts["bytes_moved"] += wire
        counts["logical_bytes"] += plan.logical_nbytes
        report_copy("h2d", wire, "DeviceLoader batch", "uint8", True)

    def _copy_bytes(self, out: Any, source: torch.Tensor, nbytes: int, stream: int | None) -> bool:
        """Queue one copy of ``source``'s first ``nbytes`` (pinned, contiguous) into the
        device tensor ``out`` (contiguous): by one driver call on the ``stream`` handle when
        given, else (or if the driver refuses) by torch. True when the driver took it (the
        caller then keeps ``source`` alive until the copy has run)."""
        self.counts["copies"] += 1
        if stream is not None and self.driver is not None:
            if self.driver(out.data_ptr(), source.data_ptr(), nbytes, stream) == 0:
                return True
            self.driver = None  # refused (no context current here, say): torch from now on
        if out.shape == source.shape:
            out.copy_(source, non_blocking=True)
        else:  # the staging buffer, whose used part is its first nbytes
            out[:nbytes].copy_(source[:nbytes], non_blocking=True)
        return False

    def take(self, ep: Epoch, key: Any) -> tuple[Any, BatchTiming | None] | None:
        """The next batch, ordered after its copy on the stream ``key`` names (the current
        one), or None at the end of the epoch."""
        if not ep.issued:
            if ep.failure is not None:
                failure, ep.failure = ep.failure, None
                raise failure
            return None
        crossing = ep.issued[0]
        plan = crossing.parts[crossing.handed_out][0]
        timing = None
        if self.timing:
            first = crossing.handed_out == 0  # the crossing's copy time counts once
            timing = BatchTiming(
                crossing.copy_times if first else None, self.device.new_event(timing=True),
                self.device.new_event(timing=True),
            )  # fmt: skip
            timing.wait_start.record(self.stream(key))
        if crossing.ready_on != key:
            self._order_after_copy(crossing, key)
        if timing is not None:
            timing.wait_end.record(self.stream(key))
        if crossing.batches is None:
            crossing.batches = self._rebuild(crossing)
        batch = crossing.batches.popleft()
        crossing.handed_out += 1
        if crossing.handed_out == len(crossing.parts):
            ep.issued.popleft()
        self._count(plan)
        return batch, timing

    def _order_after_copy(self, crossing: Crossing, key: Any) -> None:
        """Make the stream ``key`` names wait, on the device, for the crossing's copies
        (and for the rebuild of its batches, if one ran on another stream)."""
        stream = self.stream(key)
        if crossing.ready_on is None:  # copied on the side stream
            stream.wait_event(crossing.done)
        else:  # ordered on another of the consumer's streams: mark where that one is now
            mark = self.device.new_event()
            mark.record(self.stream(crossing.ready_on))
            stream.wait_event(mark)
        for tensor in crossing.early:
            tensor.record_stream(stream)
        crossing.ready_on = key

    @staticmethod
    def _rebuild(crossing: Crossing) -> deque[Any]:
        """Every batch of the crossing, rebuilt on the device at once: a run of batches that
        share a layout takes one strided view per tensor for the whole run."""
        on_device, parts, batches = crossing.on_device, crossing.parts, deque()
        direct = [iter(outs) for outs in crossing.direct_out]
        i = 0
        while i < len(parts):
            plan, offset = parts[i]
            layout, j = plan.layout, i + 1
            while j < len(parts) and parts[j][0].layout is layout:
                j += 1
            if j - i == 1:
                own = None if on_device is None else on_device[offset : offset + layout.nbytes]
                batches.append(rebuild(own, layout.spec, direct[i]))
            else:  # offsets of a run step by exactly layout.nbytes (a multiple of ALIGN)
                batches.extend(rebuild_run(on_device, layout.spec, offset, layout.nbytes, j - i,
                                           direct[i:j]))  # fmt: skip
            i = j
        crossing.direct_out = []
        return batches

    def close(self) -> None:
        """Wait for driver copies still reading the caller's memory."""
        while self.sources_in_flight:
            self.sources_in_flight.popleft()[0].synchronize()


def _landing(source: torch.Tensor, target: torch.device) -> torch.Tensor:
    """Where a direct source tensor lands on the device: itself if it was copied there as it
    was read, else fresh memory of its shape."""
    if not source.is_cpu:
        return source
    return torch.empty(source.shape, dtype=source.dtype, device=target)
