"""Host -> device movement of batches: ``DeviceLoader`` and one-off uploads.

``DeviceLoader`` wraps any iterable of CPU batches. A background thread packs each batch
(``gpuflow.pack``: one buffer, integers narrowed) into pinned memory from a ``PinnedPool``
and queues its copy on a side stream into one of ``depth`` device slots, while the device
computes on the batch before. Large tensors that are already pinned are copied straight
from the source, with no staging copy; the thread then waits for that copy before taking
the next item, so a source may refill the same pinned buffer every time.

The consumer's stream waits on the copy's event, so the host never blocks on a copy, and a
slot is written again only after an event recorded on the consumer's stream says the
consumer's work on it is done (an event, not ``record_stream``, so memory stays flat: cf.
timm issue #2781).

    with DeviceLoader(batches, "cuda", depth=2) as loader:
        for batch in loader:          # the same structure, on the device
            loss = step(batch)
    print(loader.stats)               # bytes, copies, stall, overlap

A batch's tensors that crossed unchanged are views of a slot: they are valid until the
next batch is taken (``clone()`` what must live longer). Narrowed or compressed tensors are
fresh device tensors. On the cpu every step runs synchronously with the same API.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuflow.device import Device
from gpuflow.errors import GpuflowError
from gpuflow.pack import PackPlan, plan_pack, rebuild
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
    stall_s: float  # host time the consumer spent blocked waiting for the loader thread
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
    """One device buffer and the events that fence it."""

    def __init__(self, device: Device, timing: bool) -> None:
        self.buffer: torch.Tensor | None = None
        self.copy_done = device.new_event(timing)
        self.consumer_done = device.new_event(timing)
        self.timing = timing
        if timing:
            self.copy_start = device.new_event(True)
            self.wait_start = device.new_event(True)
            self.wait_end = device.new_event(True)
        self.measured = False  # its events hold a batch's timings not yet read


@dataclass(frozen=True)
class _Failure:
    exc: BaseException


_END = object()


class DeviceLoader:
    """See the module docstring.

    ``depth`` device slots are in flight at most (2: double buffering). ``narrow`` and
    ``lossy_float`` are ``gpuflow.pack``'s codecs. ``pool_bytes`` caps the pinned memory
    (default: no cap beyond what ``depth`` needs). ``timing`` records copy/wait events for
    ``stats``; turn it off to save a few microseconds per batch.
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
        self._slots = [_Slot(self.device, timing) for _ in range(depth)]
        self._pool = PinnedPool(self.device, max_bytes=pool_bytes or 1 << 46)
        self._free: queue.Queue[int] = queue.Queue()
        for index in range(depth):
            self._free.put(index)
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._stats_lock = threading.Lock()
        self._counts = {"batches": 0, "copies": 0, "bytes_moved": 0, "logical_bytes": 0}
        self._times = {"stall_s": 0.0, "transfer_ms": 0.0, "exposed_ms": 0.0, "compute_ms": 0.0}
        self._held: int | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._produce, name="gpuflow-loader", daemon=True)
        self._thread.start()

    # ---- the loader thread ------------------------------------------------------------------

    def _produce(self) -> None:
        try:
            if self.device.has_streams:  # this thread's current device, for its copies
                self.device.backend.set_device(self.device.index)
            for batch in self._source:
                plan = plan_pack(batch, **self._pack_options)
                host = None
                if plan.has_staged:
                    host = self._pool.acquire(plan.nbytes, timeout=None)
                    plan.write_into(host.bytes)
                index = self._wait_for_free_slot()
                if index is None:  # closing
                    if host is not None:
                        self._pool.release(host)
                    return
                copied = self._copy_into_slot(index, host, plan)
                if not self._offer((index, plan)):
                    return
                if plan.has_direct:
                    # Copied straight from the source's pinned memory: the source may refill
                    # that memory for its next item, so wait until this copy has read it.
                    copied.synchronize()
            self._offer(_END)
        except BaseException as exc:  # re-raised in the consumer, traceback and all
            self._offer(_Failure(exc))

    def _wait_for_free_slot(self) -> int | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None

    def _offer(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _copy_into_slot(self, index: int, host: PinnedBuffer | None, plan: PackPlan) -> Any:
        """Queue the plan's copies into slot ``index`` on the copy stream; returns an event
        recorded after them."""
        slot = self._slots[index]
        # The consumer's work on this slot's previous batch must be done before it is
        # overwritten (and before its timings can be read).
        slot.consumer_done.synchronize()
        self._harvest(slot)
        segments = plan.segments()
        with self.device.use_stream(self._copy_stream):
            if slot.buffer is None or slot.buffer.numel() < plan.nbytes:
                # Allocated on the copy stream, so the caching allocator hands out a block
                # that is free in this stream's order.
                slot.buffer = torch.empty(
                    size_class(plan.nbytes), dtype=torch.uint8, device=self.device.torch
                )
            if slot.timing:
                slot.copy_start.record(self._copy_stream)
            for seg in segments:
                source = (
                    host.bytes if seg.source is None else seg.source.reshape(-1).view(torch.uint8)
                )
                start = seg.offset if seg.source is None else 0
                slot.buffer[seg.offset : seg.offset + seg.nbytes].copy_(
                    source[start : start + seg.nbytes], non_blocking=True
                )
            slot.copy_done.record(self._copy_stream)
            # The pool gets an event of its own: the slot's is recorded again at the slot's
            # next copy, and would keep this buffer looking busy until that one finished.
            copied = self.device.new_event()
            copied.record(self._copy_stream)
        if host is not None:
            self._pool.release(host, after=copied)
        with self._stats_lock:
            self._counts["copies"] += len(segments)
            self._counts["bytes_moved"] += sum(seg.nbytes for seg in segments)
            self._counts["logical_bytes"] += plan.logical_nbytes
        return copied

    def _harvest(self, slot: _Slot) -> None:
        """Add a finished batch's event timings to the stats (its events are complete)."""
        if not slot.measured:
            return
        slot.measured = False
        if not slot.timing:
            return
        with self._stats_lock:
            self._times["transfer_ms"] += slot.copy_start.elapsed_time(slot.copy_done)
            self._times["exposed_ms"] += slot.wait_start.elapsed_time(slot.wait_end)
            self._times["compute_ms"] += slot.wait_end.elapsed_time(slot.consumer_done)

    # ---- the consumer -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        stream = self.device.current_stream()
        self._let_go_of_held(stream)
        started = time.perf_counter()
        item = self._take_ready()
        with self._stats_lock:
            self._times["stall_s"] += time.perf_counter() - started
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        index, plan = item
        slot = self._slots[index]
        if slot.timing:
            slot.wait_start.record(stream)
        stream.wait_event(slot.copy_done)  # the device waits for the copy; the host does not
        if slot.timing:
            slot.wait_end.record(stream)
        slot.measured = True
        self._held = index
        with self._stats_lock:
            self._counts["batches"] += 1
        return rebuild(slot.buffer, plan.spec)

    def _let_go_of_held(self, stream: Any) -> None:
        if self._held is None:
            return
        self._slots[self._held].consumer_done.record(stream)
        self._free.put(self._held)
        self._held = None

    def _take_ready(self) -> Any:
        while True:
            try:
                return self._ready.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    return _Failure(RuntimeError("the DeviceLoader thread died without a result"))

    # ---- lifetime ---------------------------------------------------------------------------

    @property
    def stats(self) -> LoaderStats:
        with self._stats_lock:
            return LoaderStats(**self._counts, **self._times)

    def close(self) -> None:
        """Stop the loader thread, wait for queued copies and free pinned and device memory."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join()
        if self._held is not None:
            self._let_go_of_held(self.device.current_stream())
        self.device.synchronize()
        for slot in self._slots:
            self._harvest(slot)
            slot.buffer = None
        self._pool.close()

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
