"""Host -> device movement of batches: ``DeviceLoader`` and one-off uploads.

``DeviceLoader`` wraps any iterable of CPU batches. A background thread packs each batch
(``gpuflow.packing``: one buffer, integers narrowed) into pinned memory from a ``PinnedPool``;
large tensors that are already pinned are left where they are, with no staging copy. Each
``next()`` queues the copies of the batches ``depth`` ahead on a side stream, into one of
``depth`` device slots, and makes the consumer's stream wait on the copy of the batch it
returns: the host never waits for a copy, and copies run back to back while the device
computes. A slot is written again only after an event recorded on the consumer's stream
says the consumer's work on its last batch is done (an event, not ``record_stream``, so
memory stays flat: cf. timm issue #2781).

    with DeviceLoader(batches, "cuda", depth=2) as loader:
        for batch in loader:          # the same structure, on the device
            loss = step(batch)
    print(loader.stats)               # bytes, copies, stall, overlap

A batch's tensors that crossed unchanged are views of a slot: they are valid until the
next batch is taken (``clone()`` what must live longer). Narrowed or compressed tensors are
fresh device tensors. A pinned source tensor is read asynchronously, as with
``tensor.to(device, non_blocking=True)``: yield a fresh one per batch (as
``DataLoader(pin_memory=True)`` does) rather than refilling one buffer. On the cpu every
step runs synchronously with the same API.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuflow.device import Device
from gpuflow.errors import GpuflowError
from gpuflow.packing import PackPlan, plan_pack, rebuild
from gpuflow.pinned import PinnedBuffer, PinnedPool, size_class

_POLL_S = 0.05  # how often blocked threads look up to see whether the loader is closing


def upload_tokens(tokens: np.ndarray, device: Device) -> torch.Tensor:
    """Copy a (B, T) uint16/uint32 token array to ``device`` once and widen it there to int64.

    For one-off uploads (a validation set, a prompt); streams of batches use DeviceLoader.
    """
    host = torch.from_numpy(np.ascontiguousarray(tokens))
    if device.supports_pinned_memory:
        host = host.pin_memory()
    return host.to(device.torch, non_blocking=True).long()  # (B, T) int64, on the device


@dataclass(frozen=True)
class LoaderStats:
    """What a DeviceLoader moved and how well the copies hid behind compute.

    Times are device times from events: ``transfer_ms`` on the copy stream; ``exposed_ms``,
    the consumer stream's waits for copies (transfer not hidden); ``compute_ms``, the
    consumer stream's time from having a batch to moving on to the next.
    """

    batches: int
    copies: int
    bytes_moved: int  # as they crossed the bus
    logical_bytes: int  # as the source produced them
    stall_s: float  # host time the consumer spent blocked waiting for the packing thread
    transfer_ms: float
    exposed_ms: float
    compute_ms: float

    @property
    def overlap_ms(self) -> float:
        return max(0.0, self.transfer_ms - self.exposed_ms)

    @property
    def overlap_efficiency(self) -> float:
        """Seed 002's definition: overlap time / max(compute time, transfer time)."""
        longest = max(self.compute_ms, self.transfer_ms)
        return self.overlap_ms / longest if longest > 0 else 0.0

    @property
    def link_gb_per_s(self) -> float:
        """Bytes moved over the time the copies took: the rate the link delivered."""
        return self.bytes_moved / (self.transfer_ms * 1e6) if self.transfer_ms > 0 else 0.0


class _Slot:
    """One device buffer and the events that fence it (reused for every batch it holds)."""

    def __init__(self, device: Device) -> None:
        self.buffer: torch.Tensor | None = None
        self.copy_done = device.new_event()
        self.consumer_done = device.new_event()


class _Timing:
    """One batch's timing events, recycled once read."""

    def __init__(self, device: Device) -> None:
        self.copy_start, self.copy_end, self.wait_start, self.wait_end, self.released = (
            device.new_event(timing=True) for _ in range(5)
        )


@dataclass
class _Issued:
    slot: int
    plan: PackPlan  # holds the source tensors of direct copies until the batch is consumed
    timing: _Timing | None


@dataclass(frozen=True)
class _Failure:
    exc: BaseException


_END = object()


class DeviceLoader:
    """See the module docstring.

    ``depth`` device slots (2: double buffering). ``narrow`` and ``lossy_float`` are
    ``gpuflow.packing``'s codecs. ``pool_bytes`` caps the pinned staging memory (default:
    ``depth + 1`` batches). ``timing`` records events for ``stats``' device times.
    """

    def __init__(
        self,
        source: Iterable[Any],
        device: Device | str = "auto",
        depth: int = 2,
        *,
        narrow: bool = True,
        lossy_float: str | None = None,
        pool_bytes: int | None = None,
        timing: bool = True,
    ) -> None:
        if depth < 1:
            raise GpuflowError(f"DeviceLoader depth must be >= 1, got {depth}")
        self.device = Device.resolve(device)
        self.depth = depth
        self._source = source
        self._pack_options = {
            "narrow": narrow,
            "lossy_float": lossy_float,
            "direct_pinned": self.device.supports_pinned_memory,
        }
        self._copy_stream = self.device.new_stream()
        self._slots = [_Slot(self.device) for _ in range(depth)]
        self._next_slot = 0
        self._issued: deque[_Issued] = deque()
        self._held: _Issued | None = None
        self._timing = timing
        self._unread: deque[_Timing] = deque()  # timings of batches let go of, oldest first
        self._spare_timings: list[_Timing] = []
        self._pool_bytes = pool_bytes
        self._pool = PinnedPool(self.device, max_bytes=pool_bytes or size_class(0))
        self._packed: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._pending_end: Any = None  # _END or a _Failure, once the packing thread sent it
        self._stop = threading.Event()
        self._counts = {"batches": 0, "copies": 0, "bytes_moved": 0, "logical_bytes": 0}
        self._times = {"stall_s": 0.0, "transfer_ms": 0.0, "exposed_ms": 0.0, "compute_ms": 0.0}
        self._closed = False
        self._thread = threading.Thread(target=self._pack_all, name="gpuflow-loader", daemon=True)
        self._thread.start()

    # ---- the packing thread: host work only -------------------------------------------------

    def _pack_all(self) -> None:
        try:
            for batch in self._source:
                plan = plan_pack(batch, **self._pack_options)
                host = None
                if plan.has_staged:
                    self._size_pool_for(plan.nbytes)
                    host = self._pool.acquire(plan.nbytes, timeout=None)
                    plan.write_into(host.bytes)
                if not self._offer((plan, host)):
                    if host is not None:
                        self._pool.release(host)
                    return
            self._offer(_END)
        except BaseException as exc:  # re-raised in the consumer, traceback and all
            self._offer(_Failure(exc))

    def _size_pool_for(self, nbytes: int) -> None:
        """Cap the staging pool at ``depth + 1`` batches: ``depth`` copying or queued and one
        being packed, enough to keep the copy stream busy. The cap is the back-pressure: when
        the device falls behind, packing waits for copies to finish instead of pinning more
        memory, and every buffer is pinned within the first few batches."""
        if self._pool_bytes is None:
            needed = (self.depth + 1) * size_class(nbytes)
            self._pool.max_bytes = max(self._pool.max_bytes, needed)

    def _offer(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._packed.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    # ---- the consumer: queues copies, never waits for them ----------------------------------

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        stream = self.device.current_stream()
        self._let_go_of_held(stream)
        self._issue_ahead()
        if not self._issued:
            end = self._pending_end
            self.close()
            if isinstance(end, _Failure):
                raise end.exc
            raise StopIteration
        batch = self._issued.popleft()
        slot = self._slots[batch.slot]
        if batch.timing is not None:
            batch.timing.wait_start.record(stream)
        stream.wait_event(slot.copy_done)  # the device waits for the copy; the host does not
        if batch.timing is not None:
            batch.timing.wait_end.record(stream)
        self._held = batch
        self._counts["batches"] += 1
        self._read_finished_timings()
        return rebuild(slot.buffer, batch.plan.spec)

    def _let_go_of_held(self, stream: Any) -> None:
        """The consumer has queued all its work on the batch it holds: mark the slot."""
        if self._held is None:
            return
        self._slots[self._held.slot].consumer_done.record(stream)
        if self._held.timing is not None:
            self._held.timing.released.record(stream)
            self._unread.append(self._held.timing)
        self._held = None

    def _issue_ahead(self) -> None:
        """Queue copies for packed batches until ``depth`` are in flight; wait only when none
        is, since the consumer needs one now."""
        while len(self._issued) < self.depth and self._pending_end is None:
            item = self._take_packed(block=not self._issued)
            if item is None:
                return
            if item is _END or isinstance(item, _Failure):
                self._pending_end = item  # raised once the batches before it are consumed
                return
            plan, host = item
            self._issue(plan, host)

    def _take_packed(self, block: bool) -> Any:
        if not block:
            try:
                return self._packed.get_nowait()
            except queue.Empty:
                return None
        started = time.perf_counter()
        try:
            while True:
                try:
                    return self._packed.get(timeout=_POLL_S)
                except queue.Empty:
                    if not self._thread.is_alive() and self._packed.empty():
                        return _Failure(
                            RuntimeError("the DeviceLoader thread died without a result")
                        )
        finally:
            self._times["stall_s"] += time.perf_counter() - started

    def _issue(self, plan: PackPlan, host: PinnedBuffer | None) -> None:
        index = self._next_slot
        self._next_slot = (index + 1) % self.depth
        slot = self._slots[index]
        timing = self._new_timing() if self._timing else None
        segments = plan.segments()
        with self.device.use_stream(self._copy_stream):
            # Overwrite the slot only after the consumer's work on its last batch.
            self._copy_stream.wait_event(slot.consumer_done)
            if slot.buffer is None or slot.buffer.numel() < plan.nbytes:
                self._grow(slot, plan.nbytes)
            if timing is not None:
                timing.copy_start.record(self._copy_stream)
            for seg in segments:
                if seg.source is None:
                    source = host.bytes[seg.offset : seg.offset + seg.nbytes]
                else:
                    source = seg.source.reshape(-1).view(torch.uint8)
                slot.buffer[seg.offset : seg.offset + seg.nbytes].copy_(source, non_blocking=True)
            slot.copy_done.record(self._copy_stream)
            if timing is not None:
                timing.copy_end.record(self._copy_stream)
            if host is not None:
                # The pool gets an event of its own: the slot's is recorded again at the
                # slot's next copy and would keep this buffer looking busy until then.
                copied = self.device.new_event()
                copied.record(self._copy_stream)
                self._pool.release(host, after=copied)
        self._issued.append(_Issued(index, plan, timing))
        self._counts["copies"] += len(segments)
        self._counts["bytes_moved"] += sum(seg.nbytes for seg in segments)
        self._counts["logical_bytes"] += plan.logical_nbytes

    def _grow(self, slot: _Slot, nbytes: int) -> None:
        """A bigger device buffer for ``slot``, allocated on the copy stream (so the caching
        allocator hands out a block free in that stream's order) once the old one is idle."""
        if slot.buffer is not None:
            slot.consumer_done.synchronize()  # rare: only when batches grow
        slot.buffer = torch.empty(size_class(nbytes), dtype=torch.uint8, device=self.device.torch)

    # ---- timings ----------------------------------------------------------------------------

    def _new_timing(self) -> _Timing:
        return self._spare_timings.pop() if self._spare_timings else _Timing(self.device)

    def _read_finished_timings(self, wait: bool = False) -> None:
        while self._unread and (wait or self._unread[0].released.query()):
            t = self._unread.popleft()
            t.released.synchronize()
            self._times["transfer_ms"] += t.copy_start.elapsed_time(t.copy_end)
            self._times["exposed_ms"] += t.wait_start.elapsed_time(t.wait_end)
            self._times["compute_ms"] += t.wait_end.elapsed_time(t.released)
            self._spare_timings.append(t)

    # ---- lifetime ---------------------------------------------------------------------------

    @property
    def stats(self) -> LoaderStats:
        self._read_finished_timings()
        return LoaderStats(**self._counts, **self._times)

    def close(self) -> None:
        """Stop the packing thread, wait for queued copies, free pinned and device memory."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._pool.close()  # wakes the packing thread if it waits for a staging buffer
        self._thread.join()
        self._let_go_of_held(self.device.current_stream())
        self.device.synchronize()
        self._read_finished_timings(wait=True)
        self._issued.clear()
        for slot in self._slots:
            slot.buffer = None

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
