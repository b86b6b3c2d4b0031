"""Reading ahead for ``DeviceLoader``: each batch read from the source, planned, and staged
(written into pinned staging memory, large writes on writer threads) as soon as it is read;
small batches in a row share one staging buffer. ``Stager`` does it for the ``Epoch`` under
way and hands ``Crossing``s to the issuer (``transfer/issuing.py``).

Why each batch is copied when it is read, and the pool's back-pressure:
docs/architecture/transfer-pipeline.md.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch

from gpuflow.accounting.tally import housekeeping
from gpuflow.common.errors import GpuflowError
from gpuflow.common.sizes import round_up
from gpuflow.device.accelerator import Device
from gpuflow.transfer.packing import ALIGN, PackPlan, Planner
from gpuflow.transfer.pinned import PinnedBuffer, PinnedPool, size_class

COALESCE_BYTES = 1 << 20  # consecutive batches share one staging buffer up to this size
_COALESCE_MAX_BATCH = COALESCE_BYTES // 4  # larger batches cross on their own
_COALESCE_MAX_COUNT = 32  # batches per shared copy: bounds how far the source is read ahead
# A shared staging buffer is taken before its first batch is read, at this size (a pool size
# class): each batch is written into it as soon as it is read.
_COALESCE_CAPACITY = COALESCE_BYTES
BACKGROUND_BYTES = 2 << 20  # staged writes this large run on the writer threads
_WRITE_CHUNK = 4 << 20  # bytes per writer job (1 MiB jobs were slower: docs/decisions/017)
_WRITERS = max(1, min(8, (os.cpu_count() or 2) // 2))


class Crossing:
    """Batches that share one staging buffer, one host->device copy and one destination on
    the device, plus one copy into a device tensor of its own per source tensor copied
    directly."""

    def __init__(self, shared: bool) -> None:
        self.parts: list[tuple[PackPlan, int]] = []  # each batch's plan, where its bytes start
        self.nbytes = 0  # staged bytes (0: every tensor is copied directly)
        self.wire = 0  # every byte that crosses
        self.shared = shared  # small batches share its staging buffer (taken at its start)
        self.host: PinnedBuffer | None = None
        self.writes: list[Future[object]] = []  # jobs on the writer threads, if any
        # allocated on the consumer's stream: the staged bytes (uint8), and each part's direct
        # tensors
        self.on_device: torch.Tensor | None = None
        self.direct_out: list[list[torch.Tensor]] = []
        # each part's direct source tensors, pinned (pageable ones by pin_memory() at staging),
        # or already on the device: those of a source that may write them again, copied as
        # they were read (``early`` holds them, ``early_done`` follows their copies)
        self.direct_sources: list[list[torch.Tensor]] = []
        self.early: list[torch.Tensor] = []
        self.early_done: Any = None
        self.early_start: Any = None  # a timing event before the first of them, when timed
        self.alloc_stream: Any = None  # that stream, when the copy ran on the side stream
        self.done: Any = None  # recorded after the copies when something needs it
        self.ready_on: Any = None  # the key of a stream ordered after the copies
        self.copy_times: tuple[Any, Any] | None = None
        self.batches: deque[Any] | None = None  # rebuilt on the device at the first take
        self.handed_out = 0

    def release_unused(self) -> None:
        """Let go of a crossing whose batches will never be handed out (no host wait)."""
        if self.alloc_stream is not None and self.done is not None:
            self.alloc_stream.wait_event(self.done)  # no block goes back under the copy
        self.on_device = self.batches = None
        self.direct_out, self.direct_sources, self.early = [], [], []


@dataclass
class BatchTiming:
    copy_times: tuple[Any, Any] | None  # the crossing's, on its first batch only
    wait_start: Any
    wait_end: Any
    released: Any = None


class Epoch:
    """One pass over the source: what it has read ahead and not yet handed out.

    ``owned``: whether what the source yields is the loader's as soon as it is read (batches
    made fresh for each read, which nothing else writes); ``pinned``: whether its tensors
    are all pinned (DataLoader's pin thread made the batches). Otherwise every batch is copied when
    it is read (into staging memory; a large pinned tensor straight to the device), and the
    copy has finished before the source is asked for the next one, so a source that refills
    one buffer, or a pinned buffer it reuses, is read as it was when it yielded."""

    def __init__(self, source: Iterator[Any], owned: bool, pinned: bool = False) -> None:
        self.source: Iterator[Any] | None = source  # None once it is used up
        self.owned = owned
        self.pinned = pinned  # every tensor the source yields is pinned (a pin thread made it)
        self.carried: Crossing | None = None  # started by a batch that did not fit the last
        self.failure: Exception | None = None  # the source's error, raised in its turn
        self.pulled: deque[Crossing] = deque()  # staged, copies not queued yet
        self.issued: deque[Crossing] = deque()  # copies queued, batches still to hand out
        self.held: BatchTiming | None = None  # the timing of the batch in use
        self.ended = False
        # Taken while a batch is handed out: a second thread reading the same epoch at once
        # is refused rather than handed batches twice or never (a generator does the same).
        self.reading = threading.Lock()


class _SourceCopies:
    """The copies, by every loader in the process, still reading memory that a source yielded
    and may write again: two loaders over one source share that memory, so a read of a
    source waits for the other loader's copies too, not only its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes: set[Future[object]] = set()  # writer-thread jobs
        self._stagers: weakref.WeakSet[Stager] = weakref.WeakSet()  # their early copies

    def add_stager(self, stager: Stager) -> None:
        with self._lock:
            self._stagers.add(stager)

    def add_writes(self, futures: list[Future[object]]) -> None:
        with self._lock:
            self._writes.update(futures)
        for future in futures:  # (outside the lock: a job done already calls back at once)
            future.add_done_callback(self._done)

    def _done(self, future: Future[object]) -> None:
        with self._lock:
            self._writes.discard(future)

    def pending(self) -> tuple[list[Future[object]], list[Any]]:
        """The writer jobs still running, and each loader's last early copy (its event) that
        has not run yet: one that has is not waited for again on every later read."""
        with self._lock:
            stagers = list(self._stagers)
            writes = list(self._writes)
        events = (s.early_done for s in stagers)
        return writes, [e for e in events if e is not None and not e.query()]


SOURCE_COPIES = _SourceCopies()


class Stager:
    """Reads the epochs' sources ahead and stages their batches, into a pool of pinned
    staging buffers capped at ``depth + 2`` crossings per epoch (``pool_bytes`` caps it
    instead). ``times`` gathers the source's and the waits' seconds (shared with the
    loader's stats); ``epochs`` are those under way, for the pool's size."""

    def __init__(
        self, device: Device, depth: int, planner: Planner, pool_bytes: int | None,
        coalesce: bool, times: dict[str, float], epochs: list[Epoch],
    ) -> None:  # fmt: skip
        self.depth, self.planner = depth, planner
        self.coalesce = coalesce and depth > 0
        self.pool_bytes, self.times, self.epochs = pool_bytes, times, epochs
        # A cap below one buffer's least size is refused where staging runs out, in the
        # cap's own words, as any cap too small for the batches is.
        self.pool = PinnedPool(device, max_bytes=max(pool_bytes or 0, size_class(0)))
        self.writer: ThreadPoolExecutor | None = None  # started by the first large write
        # Copies a pinned host tensor to the device at once: (device tensor, done event,
        # start event when timed). The issuer's (``Pipeline`` sets it), whose counts and
        # streams it uses; only direct tensors take it, and only devices with streams (cuda,
        # xpu) have direct tensors.
        self.cross_early: Callable[[torch.Tensor], tuple[torch.Tensor, Any, Any]]
        self.early_done: Any = None  # after the last of those copies, of any epoch (in order)
        SOURCE_COPIES.add_stager(self)

    def top_up(self, ep: Epoch) -> None:
        """Read and stage batches until ``depth + 1`` crossings are on their way."""
        while ep.source is not None and len(ep.pulled) + len(ep.issued) <= self.depth:
            crossing = self._gather(ep)
            if crossing is None:
                break
            ep.pulled.append(crossing)

    def next_plan(self, ep: Epoch) -> PackPlan | None:
        """The source's next batch, planned; None at its end or after an error in it."""
        if ep.source is None:
            return None
        if not ep.owned:
            self._settle_writes(ep)  # the source may refill what they read from
        started = time.perf_counter()
        try:
            batch = next(ep.source)
            # a lone pinned tensor crosses where it lies only in a batch that is the loader's
            # own (staging is what takes a source's memory) and too large to share a crossing
            lone_over = _COALESCE_MAX_BATCH if ep.owned else None
            return self.planner.plan_pack(batch, lone_over, pinned=ep.pinned)
        except StopIteration:
            self.end_source(ep)
        except Exception as exc:  # raised to the consumer after the batches before it
            ep.failure = exc
            self.end_source(ep)
        finally:
            self.times["source_s"] += time.perf_counter() - started
        return None

    def _gather(self, ep: Epoch) -> Crossing | None:
        """The next crossing: one batch, or several small ones in a row, each staged (copied
        into staging memory, its direct tensors pinned or copied) as soon as it is read."""
        crossing, ep.carried = ep.carried, None
        if crossing is None:
            plan = self.next_plan(ep)
            if plan is None:
                return None
            crossing = self.start(plan, ep)
        if not crossing.shared:
            return crossing
        try:
            while len(crossing.parts) < _COALESCE_MAX_COUNT:
                plan = self.next_plan(ep)
                if plan is None:
                    break
                offset = round_up(crossing.nbytes, ALIGN)
                fits = (
                    self._small(plan)
                    and crossing.wire + plan.wire_nbytes <= COALESCE_BYTES
                    and offset + plan.nbytes <= crossing.host.bytes.numel()
                )
                if not fits:
                    ep.carried = self.start(plan, ep)  # the next crossing's first batch
                    break
                self._stage_part(crossing, plan, offset, ep)
        except BaseException:
            self.drop_staging(crossing)
            raise
        return crossing

    def _small(self, plan: PackPlan) -> bool:
        return (
            self.coalesce
            and plan.wire_nbytes <= _COALESCE_MAX_BATCH
            and plan.nbytes <= _COALESCE_CAPACITY
        )

    def start(self, plan: PackPlan, ep: Epoch) -> Crossing:
        """A crossing whose first batch is ``plan``, staged: a small batch in a staging buffer
        that later small batches share, any other in one of its own size."""
        crossing = Crossing(shared=self._small(plan))
        try:
            size = _COALESCE_CAPACITY if crossing.shared else plan.nbytes
            if size:
                crossing.host = self._staging_buffer(size)
            self._stage_part(crossing, plan, 0, ep)
        except BaseException:
            self.drop_staging(crossing)
            raise
        return crossing

    def _stage_part(self, crossing: Crossing, plan: PackPlan, offset: int, ep: Epoch) -> None:
        """Add ``plan`` to ``crossing`` at ``offset`` of its staging buffer: its staged tensors
        written there (on the writer threads when large), its direct ones pinned by
        ``pin_memory()`` if pageable, or, if the source's pinned memory is not the loader's to
        read later, copied to the device now (the source is read again only once that copy
        has run: ``_settle_writes``). A copy straight to the device costs the host no memcpy,
        where one into pinned memory of the loader's own was the loader's largest cost from
        pinned sources (docs/decisions/037)."""
        sources = []
        for leaf, source in plan.direct_pairs():
            if leaf.pin:
                source = source.pin_memory()
            elif not ep.owned:
                source, done, start = self.cross_early(source)
                crossing.early.append(source)
                crossing.early_done = self.early_done = done
                if crossing.early_start is None:
                    crossing.early_start = start
            sources.append(source)
        crossing.direct_sources.append(sources)
        crossing.parts.append((plan, offset))
        crossing.nbytes = offset + plan.nbytes
        crossing.wire += plan.wire_nbytes
        if not plan.has_staged or crossing.host is None:
            return
        staging = crossing.host.bytes
        if plan.nbytes >= BACKGROUND_BYTES:
            if self.writer is None:
                self.writer = ThreadPoolExecutor(_WRITERS, thread_name_prefix="gpuflow-write")
            jobs = plan.write_jobs(staging, _WRITE_CHUNK, offset)
            futures = [self.writer.submit(job) for job in jobs]
            crossing.writes += futures
            if not ep.owned:
                SOURCE_COPIES.add_writes(futures)
            return
        plan.write_into(staging, offset)

    def _settle_writes(self, ep: Epoch) -> None:
        """Wait until the writer threads, and the copies made as batches were read, have read
        every batch read so far of a source that may write its memory again: by this epoch,
        another under way (two epochs of one source may share the memory it refills), or
        another loader (``SOURCE_COPIES``). The writers' errors are raised in their turn, by
        ``issue_ready``."""
        writes, early = SOURCE_COPIES.pending()
        if not writes and not early:
            return
        started = time.perf_counter()
        with housekeeping():
            wait(writes)
            for done in early:
                done.synchronize()  # a loader's copies run in order: its last covers all
            self.early_done = None
        self.times["stall_s"] += time.perf_counter() - started

    def drop_staging(self, crossing: Crossing) -> None:
        """Cancel or wait out the crossing's writes and give its staging buffer back, unused
        (no copy read it)."""
        for future in crossing.writes:
            future.cancel()
        with housekeeping():
            wait(crossing.writes)
        crossing.writes = []
        if crossing.host is not None:
            self.pool.release(crossing.host)
            crossing.host = None

    def _staging_buffer(self, nbytes: int) -> PinnedBuffer:
        """A staging buffer from the pool, capped at ``depth + 2`` crossings: those read ahead
        and one whose copy may still run. The cap is the back-pressure: when the device falls
        behind, staging waits for a copy to finish instead of pinning more memory."""
        if self.pool_bytes is None:
            # per epoch under way: depth + 1 read ahead, the next one started, one in a copy
            crossings = (self.depth + 3) * max(1, len(self.epochs))
            self.pool.max_bytes = max(self.pool.max_bytes, crossings * size_class(nbytes))
        started = time.perf_counter()
        try:
            with housekeeping():  # the loader's own wait, reported in stats.stall_s
                return self.pool.acquire(nbytes)
        except GpuflowError as exc:
            if self.pool_bytes is None or not ("cap" in str(exc) or "full" in str(exc)):
                raise
            raise GpuflowError(  # the loader's knob, not the pool's
                f"DeviceLoader needs {self.depth + 2} staging buffers of {nbytes:,} bytes, "
                f"more than pool_bytes={self.pool_bytes:,} holds; raise pool_bytes or leave "
                "it unset"
            ) from None
        finally:
            self.times["stall_s"] += time.perf_counter() - started

    def finish_writes(self, crossing: Crossing) -> None:
        if not crossing.writes:
            return
        started = time.perf_counter()
        try:
            for future in crossing.writes:
                future.result()
            crossing.writes = []
        except BaseException:
            self.drop_staging(crossing)
            raise
        finally:
            self.times["stall_s"] += time.perf_counter() - started

    def end_source(self, ep: Epoch) -> None:
        """Stop reading the epoch's source (a batch started for the next crossing stays),
        once nothing still reads memory it may free or reuse when closed."""
        if not ep.owned and ep.source is not None:
            self._settle_writes(ep)
        source, ep.source = ep.source, None
        close_source = getattr(source, "close", None)  # a generator's finally blocks run now
        if close_source is not None:
            with suppress(Exception):
                close_source()

    def close(self) -> None:
        """Stop the writer threads (idle: every epoch's writes were waited for)."""
        if self.writer is not None:
            self.writer.shutdown(wait=False)
