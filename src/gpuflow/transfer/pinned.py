"""A bounded pool of page-locked host buffers, reused only after their copies finish.

    pool = PinnedPool(device, max_bytes=256 << 20)
    buf = pool.acquire(nbytes)                    # a PinnedBuffer, at least nbytes long
    buf.bytes[:nbytes].copy_(payload_bytes)
    dev.copy_(buf.bytes[:nbytes], non_blocking=True)
    pool.release(buf, after=copy_done_event)      # reusable once the copy is done

Why a pool, and what it does at ``max_bytes``: docs/architecture/transfer-pipeline.md (The
pinned pool).
"""

from __future__ import annotations

import math
import operator
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device

MIN_CLASS_BYTES = 4096


def size_class(nbytes: int, minimum: int = MIN_CLASS_BYTES) -> int:
    """The power-of-two capacity that serves a request of ``nbytes``."""
    return max(minimum, 1 << max(0, nbytes - 1).bit_length())


@dataclass(frozen=True)
class PoolStats:
    hits: int  # acquires served by a buffer already pinned
    misses: int  # acquires that had to pin a new buffer
    waits: int  # acquires that waited for an in-flight copy or another thread
    evictions: int  # idle buffers unpinned to make room for another size
    bytes_reserved: int  # pinned now, lent or idle
    bytes_in_use: int  # lent out, or returned but with a copy still in flight
    high_water_bytes: int  # the most ever reserved at once


class PinnedBuffer:
    """A buffer lent by a ``PinnedPool``: ``bytes`` is its uint8 storage of ``capacity``."""

    __slots__ = ("_lent", "_pool", "bytes", "capacity")

    def __init__(self, storage: torch.Tensor, pool: PinnedPool) -> None:
        self.bytes = storage  # (capacity,) uint8, page-locked where the device supports it
        self.capacity = storage.numel()
        self._lent = True
        self._pool = pool  # the one pool it goes back to

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The buffer's first bytes seen as a tensor of ``dtype`` and ``shape``; one size of
        -1 takes as many as the buffer holds, as ``Tensor.view`` takes what is left."""
        shape = tuple(shape)
        holds = self.bytes.numel() // dtype.itemsize  # values of dtype the buffer has room for
        if shape.count(-1) > 1 or any(dim < -1 for dim in shape):
            raise GpuflowError(
                f"a view's shape takes one -1 at most and no other sizes below 0, got {shape}"
            )
        known = math.prod(dim for dim in shape if dim != -1)
        if -1 in shape:
            if known == 0:
                raise GpuflowError(
                    f"a view's -1 beside a size of 0 stands for no one size: {shape}"
                )
            shape = tuple(holds // known if dim == -1 else dim for dim in shape)
        n = math.prod(shape)
        if n > holds:
            raise GpuflowError(
                f"a {dtype} view of shape {shape} needs {n * dtype.itemsize:,} bytes; this buffer "
                f"holds {self.bytes.numel():,}"
            )
        return self.bytes[: n * dtype.itemsize].view(dtype).view(shape)


class PinnedPool:
    """See the module docstring. Thread-safe: a loader thread may acquire while the
    consumer releases. ``max_cached_per_class`` bounds the idle buffers kept per size (the
    cap of 50 small-parameter buffers in the seed's Metal backend is this setting)."""

    def __init__(
        self,
        device: Device | str = "auto",
        max_bytes: int = 1 << 30,
        max_cached_per_class: int | None = None,
    ) -> None:
        if max_bytes < MIN_CLASS_BYTES:
            raise GpuflowError(
                f"PinnedPool max_bytes must be >= {MIN_CLASS_BYTES}, got {max_bytes}"
            )
        self.device = Device.resolve(device)
        self.max_bytes = max_bytes
        self.max_cached_per_class = max_cached_per_class
        self._lock = threading.Condition()
        self._idle: dict[int, list[torch.Tensor]] = {}
        self._in_flight: deque[tuple[Any, torch.Tensor]] = deque()  # (event, storage)
        self._reserved = 0
        self._lent = 0
        self._high_water = 0
        self._counts = {"hits": 0, "misses": 0, "waits": 0, "evictions": 0}
        self._closed = False

    # ---- lending ----------------------------------------------------------------------------

    def acquire(self, nbytes: int, timeout: float | None = 0.0) -> PinnedBuffer:
        """A buffer of at least ``nbytes``.

        When the cap leaves no room, the pool first evicts idle buffers of other sizes, then
        waits for in-flight copies to finish. If neither can free room, the room can only
        come from a buffer still lent out: with ``timeout=0`` (the default, for one thread)
        that would be a wait forever, so it raises; a positive ``timeout`` (or None, no
        limit) waits that long for another thread to release one.
        """
        try:
            whole = -1 if isinstance(nbytes, bool) else operator.index(nbytes)
        except TypeError:
            whole = -1
        if whole < 0:
            raise GpuflowError(f"acquire takes a whole number of bytes, got {nbytes!r}")
        nbytes = whole
        capacity = size_class(nbytes)
        if capacity > self.max_bytes:
            raise GpuflowError(
                f"a {nbytes:,}-byte pinned buffer needs a {capacity:,}-byte size class, more than "
                f"the pool's cap of {self.max_bytes:,} bytes; raise max_bytes"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            waited = False
            while True:
                self._check_open()
                self._reclaim_finished()
                storage = self._take(capacity)
                if storage is not None:
                    self._counts["waits"] += waited
                    return PinnedBuffer(storage, self)
                waited = True
                if self._in_flight:
                    event, _ = self._in_flight[0]
                    self._lock.release()  # wait for the copy without blocking releasers
                    try:
                        event.synchronize()
                    finally:
                        self._lock.acquire()
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    why = (
                        f"no buffer came back within {timeout:g} s"
                        if timeout
                        else "none is waiting on a copy, so it would wait forever"
                    )
                    raise GpuflowError(
                        f"the pinned pool is full: {self._lent:,} of {self.max_bytes:,} bytes are "
                        f"lent out and {why}; release a buffer first or raise max_bytes"
                    )
                self._lock.wait(remaining)

    def release(self, buffer: PinnedBuffer, after: Any = None) -> None:
        """Return ``buffer``; it is lent again only once ``after`` (a device event recorded
        after the buffer's last copy was queued) has completed."""
        if not isinstance(buffer, PinnedBuffer):
            what = f"a {type(buffer).__name__}"
            if isinstance(buffer, torch.Tensor):
                what = "a tensor (give the buffer itself, not its .bytes)"
            raise GpuflowError(f"release takes the PinnedBuffer that acquire returned, not {what}")
        if buffer._pool is not self:
            raise GpuflowError(
                "this pinned buffer was lent by another PinnedPool; release it to the pool "
                "that lent it"
            )
        with self._lock:
            if not buffer._lent:
                raise GpuflowError("this pinned buffer was already released to its pool")
            buffer._lent = False
            if self._closed:
                return
            if after is not None and not after.query():
                self._in_flight.append((after, buffer.bytes))
            else:
                self._shelve(buffer.bytes)
            self._lock.notify_all()

    # ---- bookkeeping (lock held) -------------------------------------------------------------

    def _take(self, capacity: int) -> torch.Tensor | None:
        shelf = self._idle.get(capacity)
        if shelf:
            self._counts["hits"] += 1
            self._lent += capacity
            return shelf.pop()
        self._evict_until_room_for(capacity)
        if self._reserved + capacity > self.max_bytes:
            return None
        storage = self.device.pinned_empty(capacity)
        self._counts["misses"] += 1
        self._reserved += capacity
        self._lent += capacity
        self._high_water = max(self._high_water, self._reserved)
        return storage

    def _evict_until_room_for(self, capacity: int) -> None:
        for size in sorted(self._idle, reverse=True):
            while self._idle[size] and self._reserved + capacity > self.max_bytes:
                self._idle[size].pop()
                self._reserved -= size
                self._counts["evictions"] += 1

    def _reclaim_finished(self) -> None:
        while self._in_flight and self._in_flight[0][0].query():
            self._shelve(self._in_flight.popleft()[1])

    def _shelve(self, storage: torch.Tensor) -> None:
        capacity = storage.numel()
        self._lent -= capacity
        shelf = self._idle.setdefault(capacity, [])
        if self.max_cached_per_class is not None and len(shelf) >= self.max_cached_per_class:
            self._reserved -= capacity  # over the per-size cap: unpin it
            return
        shelf.append(storage)

    def _check_open(self) -> None:
        if self._closed:
            raise GpuflowError("this PinnedPool is closed")

    # ---- lifetime ---------------------------------------------------------------------------

    @property
    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                **self._counts,
                bytes_reserved=self._reserved,
                bytes_in_use=self._lent,
                high_water_bytes=self._high_water,
            )

    def close(self) -> None:
        """Wait for every in-flight copy, then unpin everything the pool holds. (A pool that
        never pinned anything leaves torch's pinned cache alone: the blocks cached there may
        be another loader's, pinned by ``pin_memory()``, and pinning memory is slow.)"""
        with self._lock:
            if self._closed:
                return
            for event, _ in self._in_flight:
                event.synchronize()
            held_memory = self._reserved > 0
            self._in_flight.clear()
            self._idle.clear()
            self._reserved = self._lent = 0
            self._closed = True
            self._lock.notify_all()
        if held_memory:
            release_cached_host_memory(self.device)

    def __enter__(self) -> PinnedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def release_cached_host_memory(device: Device) -> None:
    """Hand torch's cached pinned blocks back to the OS (torch keeps freed ones for reuse);
    nothing to do where ``device`` has no pinned memory."""
    if not device.supports_pinned_memory:
        return
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):
        empty = getattr(torch._C, name, None)
        if empty is not None:
            empty()
            return
