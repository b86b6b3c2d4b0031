"""Host -> device movement of batches: ``DeviceLoader`` and one-off uploads.

``DeviceLoader`` wraps any iterable of CPU batches. A background thread packs each batch
(``gpuflow.transfer.packing``: one buffer, integers narrowed) into pinned memory from a
``PinnedPool`` (large tensors that are already pinned stay where they are, with no staging
copy) and queues its copy on a side stream into one of ``depth`` device slots, while the
device computes on earlier batches. Nothing waits on the host: the copy into a slot waits,
on the device, for an event the consumer's stream recorded when it moved past the slot's
last batch (an event, not ``record_stream``, so memory stays flat: cf. timm issue #2781),
and the consumer's stream waits on the copy's event before the batch is used.

    with DeviceLoader(batches, "cuda", depth=2) as loader:
        for batch in loader:          # the same structure, on the device
            loss = step(batch)
    print(loader.stats)               # bytes, copies, stall, overlap

A batch's tensors are its own, whatever their dtype: the slot's bytes are copied on the
device into fresh memory (one device-to-device copy per batch) and the slot goes back at
once. ``views=True`` skips that copy: tensors that crossed unchanged are then views of the
slot, valid only until the next batch is taken (narrowed or compressed ones are still
fresh, being converted). A pinned source tensor is read asynchronously, as with
``tensor.to(device, non_blocking=True)``: yield a fresh one per batch (as
``DataLoader(pin_memory=True)`` does) rather than refilling one buffer. On the cpu every
step runs synchronously with the same API.

Lifetime, as a ``DataLoader``'s: each ``iter(loader)`` is an epoch, its thread started then;
slots and pinned memory carry over to the next epoch; ``len()`` is the source's. ``close()``
(or leaving ``with``) returns within about a second even from a blocked source; a loader
dropped without it is stopped and freed when collected, and at interpreter exit.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.transfer.packing import LossyFloat, PackPlan, plan_pack, rebuild
from gpuflow.transfer.pinned import PinnedBuffer, PinnedPool, PoolStats, size_class
from gpuflow.transfer.tally import housekeeping, report_copy

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
    """A batch whose copies are queued: what the consumer needs to use and account for it."""

    slot: int | None  # None once the slot went back (the batch owns a copy of its bytes)
    plan: PackPlan  # holds the source tensors of direct copies until the batch is let go
    timing: _Timing | None
    copy_sizes: tuple[int, ...]  # bytes of each host->device copy


@dataclass(frozen=True)
class _Failure:
    exc: BaseException


_END = object()


class _Producer:
    """The loader's packing side: its slots, staging pool and copy stream, and the thread of
    the current epoch. It holds no reference to its ``DeviceLoader``, so a loader dropped
    without ``close()`` is collected and its finalizer stops the thread and frees memory."""

    def __init__(
        self, device: Device, depth: int, pack_options: dict[str, Any],
        pool_bytes: int | None, timing: bool,
    ) -> None:  # fmt: skip
        self.device, self.depth, self.pack_options = device, depth, pack_options
        self.pool_bytes, self.timing = pool_bytes, timing
        self.copy_stream = device.new_stream()
        self.slots = [_Slot(device) for _ in range(depth)]
        self.free_slots: queue.Queue[int] = queue.Queue()
        for index in range(depth):
            self.free_slots.put(index)
        self.pool = PinnedPool(device, max_bytes=pool_bytes or size_class(0))
        self.spare_timings: deque[_Timing] = deque()  # read; reused for later batches
        self.lock = threading.Lock()  # held while a batch's copies are issued
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()  # the current epoch's
        self.released = False

    def start(self, batches: Iterator[Any], ready: queue.Queue[Any]) -> None:
        """Pack ``batches`` and queue their copies on a thread of their own."""
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(batches, ready, self.stop), name="gpuflow-loader",
            daemon=True,
        )  # fmt: skip
        self.thread.start()

    def _run(self, batches: Iterator[Any], ready: queue.Queue[Any], stop: threading.Event) -> None:
        try:
            if self.device.has_streams:  # this thread's current device, for its copies
                self.device.backend.set_device(self.device.index)
            for batch in batches:
                if stop.is_set():
                    return
                plan = plan_pack(batch, **self.pack_options)
                host = None
                if plan.has_staged:
                    host = self._staging_buffer(plan.nbytes)
                    plan.write_into(host.bytes)
                index = self._take_free_slot(stop)
                with self.lock:
                    if index is None or stop.is_set():  # the epoch was let go of
                        if index is not None:
                            self.free_slots.put(index)
                        if host is not None:
                            self.pool.release(host)
                        return
                    ready.put(self._issue(index, plan, host))
            ready.put(_END)
        except BaseException as exc:  # re-raised in the consumer, traceback and all
            if not stop.is_set():
                ready.put(_Failure(exc))
        finally:
            close_source = getattr(batches, "close", None)  # a generator's finally blocks
            if close_source is not None:
                with suppress(Exception):
                    close_source()

    def _staging_buffer(self, nbytes: int) -> PinnedBuffer:
        self._size_pool_for(nbytes)
        try:
            return self.pool.acquire(nbytes, timeout=None)
        except GpuflowError as exc:
            if self.pool_bytes is None or "cap" not in str(exc):
                raise
            raise GpuflowError(  # the loader's knob, not the pool's
                f"a {nbytes:,}-byte batch needs more pinned staging memory than "
                f"pool_bytes={self.pool_bytes:,} allows; raise DeviceLoader's pool_bytes or "
                "leave it unset (depth batches)"
            ) from None

    def _size_pool_for(self, nbytes: int) -> None:
        """Cap the staging pool at ``depth`` batches: one being packed while the others'
        copies run. The cap is the back-pressure (when the device falls behind, packing waits
        for copies to finish instead of pinning more memory) and it keeps the staging memory
        small, which is faster: on an H100 host, staging 64 MiB batches through 2 rotating
        pinned buffers ran at 53 GB/s and through 3 at 43 (benchmarks/NOTES.md)."""
        if self.pool_bytes is None:
            needed = self.depth * size_class(nbytes)
            self.pool.max_bytes = max(self.pool.max_bytes, needed)

    def _take_free_slot(self, stop: threading.Event) -> int | None:
        while not stop.is_set():
            try:
                return self.free_slots.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None

    def _issue(self, index: int, plan: PackPlan, host: PinnedBuffer | None) -> _Issued:
        """Queue the plan's copies into slot ``index`` on the copy stream, behind the
        consumer's last use of the slot; the staging buffer goes back once they are done."""
        slot = self.slots[index]
        timing = self._new_timing() if self.timing else None
        segments = plan.segments()
        with self.device.use_stream(self.copy_stream):
            self.copy_stream.wait_event(slot.consumer_done)
            if slot.buffer is None or slot.buffer.numel() < plan.nbytes:
                self._grow(slot, plan.nbytes)
            if timing is not None:
                timing.copy_start.record(self.copy_stream)
            for seg in segments:
                if seg.source is None:
                    source = host.bytes[seg.offset : seg.offset + seg.nbytes]
                else:
                    source = seg.source.reshape(-1).view(torch.uint8)
                slot.buffer[seg.offset : seg.offset + seg.nbytes].copy_(source, non_blocking=True)
            slot.copy_done.record(self.copy_stream)
            if timing is not None:
                timing.copy_end.record(self.copy_stream)
            if host is not None:
                # The pool gets an event of its own: the slot's is recorded again at the
                # slot's next copy and would keep this buffer looking busy until then.
                copied = self.device.new_event()
                copied.record(self.copy_stream)
                self.pool.release(host, after=copied)
        return _Issued(index, plan, timing, tuple(seg.nbytes for seg in segments))

    def _grow(self, slot: _Slot, nbytes: int) -> None:
        """A bigger device buffer for ``slot``, allocated on the copy stream (so the caching
        allocator hands out a block free in that stream's order) once the old one is idle."""
        if slot.buffer is not None:
            slot.consumer_done.synchronize()  # rare: only when batches grow
        slot.buffer = torch.empty(size_class(nbytes), dtype=torch.uint8, device=self.device.torch)

    def _new_timing(self) -> _Timing:
        try:
            return self.spare_timings.pop()
        except IndexError:
            return _Timing(self.device)

    def halt(self, timeout: float) -> None:
        """Stop the current epoch's thread: it finishes the batch it is issuing, if any, and
        takes no more. Waits up to ``timeout`` seconds for it to exit; a thread still inside
        the source's ``next`` (a slow or blocked source) exits when that returns."""
        with self.lock:
            self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout)

    def release(self, timeout: float = 1.0) -> None:
        """Stop, wait for the copies already queued, and free the slots and pinned memory
        (also what the finalizer of a loader dropped without ``close()`` runs)."""
        if self.released:
            return
        self.released = True
        self.halt(timeout)
        with housekeeping():
            self.copy_stream.synchronize()  # no slot is freed under a copy into it
            self.pool.close()
        for slot in self.slots:
            slot.buffer = None


class DeviceLoader:
    """See the module docstring.

    ``depth`` device slots (2: double buffering). ``narrow`` and ``lossy_float`` are
    ``gpuflow.transfer.packing``'s codecs. ``pool_bytes`` caps the pinned staging memory (default:
    ``depth`` batches). ``timing`` records events for ``stats``' device times. ``views``:
    hand out views of the reused slots instead of tensors the batch owns (one device copy
    less per batch; see the module docstring).

    Like a ``DataLoader``, each ``iter(loader)`` is an epoch over the source, on a thread
    started then; slots and pinned memory are reused from one epoch to the next. ``len()``
    is the source's. A source that is itself an iterator (a generator) gives one epoch.
    """

    def __init__(
        self,
        source: Iterable[Any],
        device: Device | torch.device | str = "auto",
        depth: int = 2,
        *,
        narrow: bool = True,
        lossy_float: LossyFloat = None,
        pool_bytes: int | None = None,
        timing: bool = True,
        views: bool = False,
    ) -> None:
        if depth < 1:
            raise GpuflowError(f"DeviceLoader depth must be >= 1, got {depth}")
        self.device = Device.resolve(device)
        self.depth = depth
        self._source = source
        pack_options = {
            "narrow": narrow,
            "lossy_float": lossy_float,
            "direct_pinned": self.device.supports_pinned_memory,
        }
        self._producer = _Producer(self.device, depth, pack_options, pool_bytes, timing)
        # Runs on close(), on collection of a loader never closed, and at interpreter exit.
        self._finalizer = weakref.finalize(self, self._producer.release)
        self._ready: queue.Queue[Any] | None = None  # the current epoch's: _Issued, then the end
        self._epochs = 0
        self._held: _Issued | None = None
        self._unread: deque[_Timing] = deque()  # timings of batches let go of, oldest first
        self._counts = {"batches": 0, "copies": 0, "bytes_moved": 0, "logical_bytes": 0}
        self._times = {"stall_s": 0.0, "transfer_ms": 0.0, "exposed_ms": 0.0, "compute_ms": 0.0}
        self._closed = False
        self._views = views

    def __len__(self) -> int:
        if not hasattr(self._source, "__len__"):
            raise TypeError(
                f"this DeviceLoader's source ({type(self._source).__name__}) has no len()"
            )
        return len(self._source)

    # ---- epochs -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """Start an epoch (after stopping one still running)."""
        if self._closed:
            raise GpuflowError("this DeviceLoader is closed; make a new one to iterate again")
        self._end_epoch()
        batches = iter(self._source)
        if batches is self._source and self._epochs > 0:
            raise GpuflowError(
                "this DeviceLoader's source is an iterator, used up by its first epoch; pass "
                "something that can be iterated again (a list, a DataLoader) for more epochs"
            )
        self._epochs += 1
        self._ready = queue.Queue()
        self._producer.start(batches, self._ready)
        return self

    def _end_epoch(self, timeout: float = 1.0) -> None:
        """Let go of the held batch, stop the epoch's thread, and hand back the slots of
        batches copied but never taken. Queues device work only: nothing waits here."""
        self._let_go_of_held(self.device.current_stream())
        if self._ready is None:
            return
        self._producer.halt(timeout)
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Issued):
                self._producer.free_slots.put(item.slot)
        self._ready = None

    # ---- the consumer: takes queued batches, never waits for a copy -------------------------

    def __next__(self) -> Any:
        if self._ready is None:
            if self._epochs == 0 and not self._closed:
                iter(self)  # next() on a fresh loader starts its first epoch
            else:
                raise StopIteration
        stream = self.device.current_stream()
        self._let_go_of_held(stream)
        item = self._take_ready()
        if item is _END or isinstance(item, _Failure):
            self._end_epoch()
            if isinstance(item, _Failure):
                raise item.exc
            raise StopIteration
        slot = self._producer.slots[item.slot]
        if item.timing is not None:
            item.timing.wait_start.record(stream)
        stream.wait_event(slot.copy_done)  # the device waits for the copy; the host does not
        if item.timing is not None:
            item.timing.wait_end.record(stream)
        self._held = item
        self._counts["batches"] += 1
        self._counts["copies"] += len(item.copy_sizes)
        for nbytes in item.copy_sizes:  # counted by the ledgers open on this thread
            report_copy("h2d", nbytes, "DeviceLoader batch", "uint8", True)
        self._counts["bytes_moved"] += item.plan.nbytes
        self._counts["logical_bytes"] += item.plan.logical_nbytes
        self._read_finished_timings()
        if self._views:
            return rebuild(slot.buffer, item.plan.spec)
        owned = slot.buffer[: item.plan.nbytes].clone()  # on this stream, after the copy
        self._free_slot(item, stream)  # free for the next copy already; timing runs on
        return rebuild(owned, item.plan.spec)

    def _let_go_of_held(self, stream: Any) -> None:
        """The consumer has queued all its work on the batch it holds: fence the slot with
        an event on its stream, then hand the slot back for the next copy."""
        if self._held is None:
            return
        self._free_slot(self._held, stream)
        if self._held.timing is not None:
            self._held.timing.released.record(stream)
            self._unread.append(self._held.timing)
        self._held = None

    def _free_slot(self, item: _Issued, stream: Any) -> None:
        """Hand ``item``'s slot back once ``stream``'s work so far (its last reader) is done."""
        if item.slot is None:
            return
        self._producer.slots[item.slot].consumer_done.record(stream)
        self._producer.free_slots.put(item.slot)
        item.slot = None

    def _take_ready(self) -> Any:
        started = time.perf_counter()
        thread = self._producer.thread
        try:
            while True:
                try:
                    return self._ready.get(timeout=_POLL_S)
                except queue.Empty:
                    if not thread.is_alive() and self._ready.empty():
                        return _Failure(
                            RuntimeError("the DeviceLoader thread died without a result")
                        )
        finally:
            self._times["stall_s"] += time.perf_counter() - started

    # ---- timings ----------------------------------------------------------------------------

    def _read_finished_timings(self, wait: bool = False) -> None:
        while self._unread and (wait or self._unread[0].released.query()):
            t = self._unread.popleft()
            if wait:
                t.released.synchronize()
            self._times["transfer_ms"] += t.copy_start.elapsed_time(t.copy_end)
            self._times["exposed_ms"] += t.wait_start.elapsed_time(t.wait_end)
            self._times["compute_ms"] += t.wait_end.elapsed_time(t.released)
            self._producer.spare_timings.append(t)

    # ---- lifetime ---------------------------------------------------------------------------

    @property
    def stats(self) -> LoaderStats:
        self._read_finished_timings()
        return LoaderStats(**self._counts, **self._times)

    @property
    def pool_stats(self) -> PoolStats:
        """The pinned staging pool's figures: bytes reserved, high water, hits and waits."""
        return self._producer.pool.stats

    def close(self, timeout: float = 1.0) -> None:
        """Stop the packing thread, finish the queued copies, free pinned and device memory.
        Returns within about ``timeout`` seconds even when the source is slow or blocked (its
        thread then exits when the source returns). Its waits are the loader's housekeeping:
        a ledger open around it does not count them."""
        if self._closed:
            return
        self._closed = True
        self._end_epoch(timeout)
        with housekeeping():
            self._read_finished_timings(wait=True)
        self._finalizer.detach()  # released here, not again when collected
        self._producer.release(timeout=0)  # _end_epoch has already waited for the thread

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
