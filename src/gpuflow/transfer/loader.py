"""Host -> device movement of batches: ``DeviceLoader`` and one-off uploads.

``DeviceLoader`` wraps any iterable of CPU batches and yields the same structure on the
device, with the copies queued ahead of the batch in use:

    with DeviceLoader(batches, "cuda") as loader:
        for batch in loader:          # the same structure, on the device
            loss = step(batch)
    print(loader.stats)               # batches, copies, bytes, host time waiting

How a batch crosses, and on which thread: docs/architecture/transfer-pipeline.md. What a
batch's tensors are, the loader's lifetime and how far it reads ahead (``depth``): the same
file (What DeviceLoader promises).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuflow.accounting.tally import housekeeping
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.transfer.packing import LossyFloat, Planner
from gpuflow.transfer.pinned import PoolStats
from gpuflow.transfer.pipeline import Pipeline
from gpuflow.transfer.staging import BatchTiming, Epoch


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
    """What a DeviceLoader moved, and where its host time went.

    ``copies`` counts host->device copy calls as they are queued: fewer than ``batches``
    when small batches were coalesced, more when batches read ahead were dropped (a
    ``break``). ``batches`` and the bytes count those handed out, as a ledger sees them.
    ``source_s`` is host time inside the source's ``next``; ``stall_s``, host time waiting
    for a staging buffer to come free (the device falling behind). The device times need
    ``timing=True`` (events off the hot path otherwise):
    ``transfer_ms`` on the copy stream; ``exposed_ms``, the consumer stream's waits for copies
    (transfer not hidden); ``compute_ms``, the consumer stream's time from having a batch to
    moving on to the next.
    """

    batches: int
    copies: int
    bytes_moved: int  # the batches handed out, as they crossed the bus
    logical_bytes: int  # as the source produced them
    source_s: float
    stall_s: float
    transfer_ms: float
    exposed_ms: float
    compute_ms: float

    @property
    def overlap_ms(self) -> float:
        return max(0.0, self.transfer_ms - self.exposed_ms)

    @property
    def overlap_efficiency(self) -> float:
        """How well the copies hid behind the consumer's work: the copies' time that ran
        under it (``overlap_ms``) over the longer of the two sides, compute or transfer. 1
        where the shorter side ran wholly under the longer, 0 where the consumer waited for
        every copy."""
        longest = max(self.compute_ms, self.transfer_ms)
        return self.overlap_ms / longest if longest > 0 else 0.0


class DeviceLoader:
    """See the module docstring.

    ``depth``: copies queued ahead of the batch in use (2: double buffering; a worker-fed
    ``DataLoader``'s batch whose tensors all cross where they lie is copied when asked for,
    which reading it ahead would not hasten: docs/decisions/044). ``depth=0``
    reads no batch before it is asked for and coalesces none: for a source that waits on the
    consumer's results (an actor feeding a learner), which reading ahead would deadlock;
    each copy then runs while the consumer waits on the device. ``narrow`` and
    ``lossy_float`` are ``gpuflow.transfer.packing``'s codecs, both off by default: each
    costs the host a pass over the values that, on the links of H100 and H200 hosts, took
    longer than the bytes it saved take to cross (docs/decisions/038); they pay where the
    link is slow or shared. ``pool_bytes`` caps the
    pinned staging memory (default: ``depth + 3`` staging buffers per epoch under way).
    ``timing`` records events for the device times in ``stats`` (off by default: they cost
    host time per batch). ``coalesce=False`` gives every batch its own
    copy, so that a ledger or profiler window of N steps sees N copies (``gpuflow train``'s
    streamed path, whose copies are profiled).

    What the loader reads ahead is its own from the moment it is read: each batch is copied
    as it is read (into staging memory; a large pinned tensor straight to the device),
    so a source may refill one buffer, or hand out views of a ring buffer, and every batch
    arrives as it was when yielded. ``fresh_batches=True`` tells the loader that every batch
    the source yields is memory made for it that nothing writes again (a generator that
    allocates each batch, say): the loader then reads pinned tensors where they lie, as
    ``tensor.to(device, non_blocking=True)`` does, saving that copy. A ``DataLoader`` that
    batches with its default ``collate_fn`` makes fresh batches and is read so by default.

    Like a ``DataLoader``, each ``iter(loader)`` is an epoch iterator of its own over the
    source (two at once, as ``zip(loader, loader)`` makes, each read their own batches);
    staging memory is shared and reused from one epoch to the next. ``next(loader)`` reads
    from an epoch of its own, started by the first ``next``. ``len()`` is the source's. A
    source that is itself an iterator (a generator) gives one epoch.

    A ``DataLoader`` with workers is read as ``pin_memory=True`` would read it, where the
    device has pinned memory: its own pin-memory thread takes each batch from the workers
    and pins it, and the loader copies it from there. The DataLoader's ``pin_memory`` is
    set only while the loader makes its iterator; one with ``persistent_workers=True`` keeps
    that iterator (and its pin-memory thread) for its later epochs, and serves one epoch at
    a time.
    """

    def __init__(
        self,
        source: Iterable[Any],
        device: Device | torch.device | str | int = "auto",
        depth: int = 2,
        *,
        narrow: bool = False,
        lossy_float: LossyFloat = None,
        pool_bytes: int | None = None,
        timing: bool = False,
        coalesce: bool = True,
        fresh_batches: bool = False,
    ) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise GpuflowError(f"DeviceLoader depth must be a whole number >= 0, got {depth!r}")
        if pool_bytes is not None and (
            not isinstance(pool_bytes, int) or isinstance(pool_bytes, bool) or pool_bytes < 0
        ):
            raise GpuflowError(
                f"DeviceLoader pool_bytes must be a whole number of bytes (or None: as many as "
                f"the batches need), got {pool_bytes!r}"
            )
        self.device = Device.resolve(device)
        self.depth = depth
        self.fresh_batches = fresh_batches
        self._source = source
        self._codecs = (narrow, lossy_float, self.device.supports_pinned_memory)
        planner = Planner(*self._codecs)
        self._pipeline = Pipeline(self.device, depth, planner, pool_bytes, timing, coalesce)
        # Runs on close(), on collection of a loader never closed, and at interpreter exit.
        self._finalizer = weakref.finalize(self, self._pipeline.release)
        self._epochs = 0
        self._own_epoch: Epoch | None = None  # the one next(loader) reads
        self._unread: deque[BatchTiming] = deque()  # timings of batches let go of
        self._device_times = {"transfer_ms": 0.0, "exposed_ms": 0.0, "compute_ms": 0.0}
        self._closed = False

    def __len__(self) -> int:
        if not hasattr(self._source, "__len__"):
            raise TypeError(
                f"this DeviceLoader's source ({type(self._source).__name__}) has no len()"
            )
        return len(self._source)

    # ---- epochs -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """A new epoch over the source, as an iterator of its own."""
        return _EpochIterator(self, self._start_epoch())

    def _start_epoch(self) -> Epoch:
        self._check_open()
        if _keeps_one_iterator(self._source) and any(
            ep.source is not None for ep in self._pipeline.epochs
        ):
            raise GpuflowError(
                "this DeviceLoader's DataLoader has persistent_workers=True, so it serves one "
                "epoch at a time (a second iter() restarts the first); finish or leave the "
                "epoch under way before starting another, or make the DataLoader with "
                "persistent_workers=False to read two at once (zip(loader, loader))"
            )
        batches = self._iterate_source()
        if batches is self._source and self._epochs > 0:
            raise GpuflowError(
                "this DeviceLoader's source is an iterator, which serves one epoch (a second "
                "iter() would go on where the first stopped, not start again); pass something "
                "that can be iterated again (a list, a DataLoader) for more epochs"
            )
        pinned = _pinned_from_workers(self._source, batches)
        owned = self.fresh_batches or _makes_fresh_batches(self._source) or pinned
        self._epochs += 1
        epoch = Epoch(batches, owned, pinned)
        self._pipeline.epochs.append(epoch)
        return epoch

    def _iterate_source(self) -> Iterator[Any]:
        """``iter(source)``; for a ``DataLoader`` with workers and no pin-memory thread, on a
        device with pinned memory, an iterator that has one (``pin_memory`` is set only while
        it is made): batches come from the workers already pinned, taken over and pinned on
        that thread, and the training thread only issues their copies
        (docs/decisions/039). A DataLoader with persistent workers keeps the iterator it
        makes first, pin-memory thread and all (or none, if it was iterated before)."""
        source = self._source
        if not (_fed_by_workers(source) and self.device.supports_pinned_memory):
            return iter(source)
        source.pin_memory = True
        try:
            return iter(source)
        finally:
            source.pin_memory = False

    def _check_open(self) -> None:
        if self._closed:
            raise GpuflowError("this DeviceLoader is closed; make a new one to iterate again")

    def __next__(self) -> Any:
        """The next batch of the loader's own epoch (started by the first call)."""
        self._check_open()
        if self._own_epoch is None:
            self._own_epoch = self._start_epoch()
        return self._next_of(self._own_epoch)

    def _next_of(self, epoch: Epoch) -> Any:
        if not epoch.reading.acquire(blocking=False):
            raise GpuflowError(
                "this DeviceLoader epoch is being read by another thread; give each thread "
                "an iterator of its own, iter(loader)"
            )
        try:
            return self._take_next(epoch)
        finally:
            epoch.reading.release()

    def _take_next(self, epoch: Epoch) -> Any:
        self._check_open()
        if epoch.ended:
            raise StopIteration
        self._let_go_of_held(epoch)
        pipeline = self._pipeline
        try:
            batch = pipeline.take_at_once(epoch)
            if batch is not None:
                return batch
            key = self.device.current_stream_key()
            pipeline.top_up(epoch)
            pipeline.issue_ready(epoch, key)
            taken = pipeline.take(epoch, key)
        except BaseException:
            self._end(epoch)
            raise
        if taken is None:
            self._end(epoch)
            raise StopIteration
        batch, epoch.held = taken
        return batch

    def _end(self, epoch: Epoch) -> None:
        """Let go of the epoch's batch in use and drop what it read ahead (device work only)."""
        self._let_go_of_held(epoch)
        self._pipeline.end_epoch(epoch)

    def _let_go_of_held(self, epoch: Epoch) -> None:
        if epoch.held is None:
            return
        epoch.held.released = self.device.new_event(timing=True)
        epoch.held.released.record(self._pipeline.stream(self.device.current_stream_key()))
        self._unread.append(epoch.held)
        epoch.held = None

    # ---- timings ----------------------------------------------------------------------------

    def _read_finished_timings(self, wait: bool = False) -> None:
        while self._unread and (wait or self._unread[0].released.query()):
            t = self._unread.popleft()
            if wait:
                t.released.synchronize()
            if t.copy_times is not None:
                self._device_times["transfer_ms"] += t.copy_times[0].elapsed_time(t.copy_times[1])
            self._device_times["exposed_ms"] += t.wait_start.elapsed_time(t.wait_end)
            self._device_times["compute_ms"] += t.wait_end.elapsed_time(t.released)

    # ---- lifetime ---------------------------------------------------------------------------

    @property
    def stats(self) -> LoaderStats:
        self._read_finished_timings()
        counts = self._pipeline.counts
        return LoaderStats(**counts, **self._pipeline.times, **self._device_times)

    @property
    def pool_stats(self) -> PoolStats:
        """The pinned staging pool's figures: bytes reserved, high water, hits and waits."""
        return self._pipeline.pool.stats

    def close(self) -> None:
        """Drop batches read ahead, wait for the copies still reading staging memory, and
        free it. Its waits are the loader's housekeeping: a ledger open around it does not
        count them."""
        if self._closed:
            return
        self._closed = True
        for epoch in list(self._pipeline.epochs):
            self._end(epoch)
        with housekeeping():
            self._read_finished_timings(wait=True)
        self._finalizer()  # released now, and not again when collected

    def __enter__(self) -> DeviceLoader:
        return self

    def __reduce__(self) -> Any:
        raise GpuflowError(
            "a DeviceLoader cannot be copied or pickled: it holds a thread, pinned buffers and "
            "batches in flight; make another DeviceLoader over the same source"
        )

    def __exit__(self, *exc: object) -> None:
        self.close()


class _EpochIterator:
    """One epoch over a ``DeviceLoader``'s source. It keeps its loader alive; dropped before
    its end (a ``break``), it drops what it read ahead when collected."""

    def __init__(self, loader: DeviceLoader, epoch: Epoch) -> None:
        self._loader, self._epoch = loader, epoch
        self._finalizer = weakref.finalize(self, loader._pipeline.end_epoch, epoch)

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        return self._loader._next_of(self._epoch)

    def __len__(self) -> int:
        return len(self._loader)


def _with_workers(source: object) -> bool:
    """A ``DataLoader`` that reads its batches in worker processes."""
    return isinstance(source, torch.utils.data.DataLoader) and source.num_workers > 0


def _fed_by_workers(source: object) -> bool:
    """A ``DataLoader`` with worker processes and no pin-memory thread of its own."""
    return _with_workers(source) and not source.pin_memory  # type: ignore[attr-defined]


def _keeps_one_iterator(source: object) -> bool:
    """A ``DataLoader`` whose every ``iter()`` resets one cached iterator."""
    return _with_workers(source) and source.persistent_workers  # type: ignore[attr-defined]


def _pinned_from_workers(source: object, batches: Iterator[Any]) -> bool:
    """Whether ``batches`` come from worker processes through a pin-memory thread: every
    tensor is then a pinned copy made for that batch (a worker's tensors reach this process
    in shared memory, which ``pin_memory()`` copies from), whatever the ``collate_fn``."""
    # (torch's iterator keeps whether it pins, as it was made)
    return _with_workers(source) and getattr(batches, "_pin_memory", False) is True


def _makes_fresh_batches(source: object) -> bool:
    """Whether every batch ``source`` yields is fresh memory nothing else writes: a
    ``DataLoader`` that batches with its default ``collate_fn`` stacks each batch into new
    tensors (its pin-memory step and its workers' shared memory keep them new)."""
    from torch.utils.data import DataLoader
    from torch.utils.data._utils.collate import default_collate

    return (
        isinstance(source, DataLoader)
        and source._auto_collation
        and source.collate_fn is default_collate
    )
