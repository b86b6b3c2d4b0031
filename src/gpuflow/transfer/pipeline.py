"""How ``DeviceLoader`` moves batches: reading ahead, staging, copies, handing out.

The steps a batch takes, which thread runs each, and why: docs/architecture/transfer-pipeline.md.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.common.sizes import round_up
from gpuflow.device.accelerator import Device
from gpuflow.device.drivercopy import driver_copy
from gpuflow.transfer.packing import ALIGN, PackPlan, Planner, rebuild, rebuild_run
from gpuflow.transfer.pinned import PinnedBuffer, PinnedPool, pinned_copy, size_class
from gpuflow.transfer.tally import housekeeping, report_copy

COALESCE_BYTES = 1 << 20  # consecutive batches share one staging buffer up to this size
_COALESCE_MAX_BATCH = COALESCE_BYTES // 4  # larger batches cross on their own
_COALESCE_MAX_COUNT = 32  # batches per shared copy: bounds how far the source is read ahead
# A shared staging buffer is taken before its first batch is read, at this size (a pool size
# class): each batch is written into it as soon as it is read.
_COALESCE_CAPACITY = COALESCE_BYTES
SIDE_STREAM_BYTES = 4 << 20  # copies this large overlap compute on a stream of their own
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
        # each part's direct source tensors, pinned (pageable ones by pin_memory() at staging)
        self.direct_sources: list[list[torch.Tensor]] = []
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
        self.direct_out, self.direct_sources = [], []


@dataclass
class BatchTiming:
    copy_times: tuple[Any, Any] | None  # the crossing's, on its first batch only
    wait_start: Any
    wait_end: Any
    released: Any = None


class Epoch:
    """One pass over the source: what it has read ahead and not yet handed out.

    ``owned``: whether what the source yields is the loader's as soon as it is read (batches
    made fresh for each read, which nothing else writes). Otherwise every batch is copied when
    it is read (into staging memory, or pinned memory of the loader's own), before the
    source is asked for the next one, so a source that refills one buffer, or a pinned
    buffer it reuses, is read as it was when it yielded."""

    def __init__(self, source: Iterator[Any], owned: bool) -> None:
        self.source: Iterator[Any] | None = source  # None once it is used up
        self.owned = owned
        self.carried: Crossing | None = None  # started by a batch that did not fit the last
        self.failure: Exception | None = None  # the source's error, raised in its turn
        self.pulled: deque[Crossing] = deque()  # staged, copies not queued yet
        self.issued: deque[Crossing] = deque()  # copies queued, batches still to hand out
        self.held: BatchTiming | None = None  # the timing of the batch in use
        self.ended = False


class Pipeline:
    """The loader's state: staging pool, copy stream, the epochs under way. It holds no
    reference to its ``DeviceLoader``, so a loader dropped without ``close()`` is collected
    and its finalizer frees what is here."""

    def __init__(
        self, device: Device, depth: int, planner: Planner, pool_bytes: int | None,
        timing: bool, coalesce: bool, side_copies: bool = True,
    ) -> None:  # fmt: skip
        self.device, self.depth, self.planner = device, depth, planner
        # Large copies on a stream of their own, apart from the consumer's work (off where
        # the current stream is already one that runs only copies: ``DeviceReader``'s).
        self.side_copies = side_copies and device.has_streams
        self.coalesce = coalesce and depth > 0
        self.pool_bytes, self.timing = pool_bytes, timing
        self.copy_stream = device.new_stream()
        self.fence = device.new_event()  # the consumer's progress, for the copy stream to wait on
        self.pool = PinnedPool(device, max_bytes=pool_bytes or size_class(0))
        # Copies through the driver (gpuflow.device.drivercopy) unless GPUFLOW_TORCH_COPIES=1.
        use_driver = device.type == "cuda" and not os.environ.get("GPUFLOW_TORCH_COPIES")
        self.driver = driver_copy() if use_driver else None
        # (done event, source tensors) of driver copies from the caller's pinned memory
        self.sources_in_flight: deque[tuple[Any, list[torch.Tensor]]] = deque()
        self.writer: ThreadPoolExecutor | None = None  # started by the first large write
        # stream objects by key: building one per batch would cost host time each batch
        self.streams: dict[Any, Any] = {}
        self.epochs: list[Epoch] = []  # those under way: each iter() starts one
        self.counts = {"batches": 0, "copies": 0, "bytes_moved": 0, "logical_bytes": 0}
        self.times = {"source_s": 0.0, "stall_s": 0.0}
        self.released = False

    # ---- reading ahead --------------------------------------------------------------------

    def top_up(self, ep: Epoch) -> None:
        """Read and stage batches until ``depth + 1`` crossings are on their way."""
        while ep.source is not None and len(ep.pulled) + len(ep.issued) <= self.depth:
            crossing = self._gather(ep)
            if crossing is None:
                break
            ep.pulled.append(crossing)

    def _next_plan(self, ep: Epoch) -> PackPlan | None:
        """The source's next batch, planned; None at its end or after an error in it."""
        if ep.source is None:
            return None
        if not ep.owned:
            self._settle_writes(ep)  # the source may refill what they read from
        started = time.perf_counter()
        try:
            batch = next(ep.source)
            return self.planner.plan_pack(batch)
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
            plan = self._next_plan(ep)
            if plan is None:
                return None
            crossing = self._start(plan, ep)
        if not crossing.shared:
            return crossing
        try:
            while len(crossing.parts) < _COALESCE_MAX_COUNT:
                plan = self._next_plan(ep)
                if plan is None:
                    break
                offset = round_up(crossing.nbytes, ALIGN)
                fits = (
                    self._small(plan)
                    and crossing.wire + plan.wire_nbytes <= COALESCE_BYTES
                    and offset + plan.nbytes <= crossing.host.bytes.numel()
                )
                if not fits:
                    ep.carried = self._start(plan, ep)  # the next crossing's first batch
                    break
                self._stage_part(crossing, plan, offset, ep.owned)
        except BaseException:
            self._drop_staging(crossing)
            raise
        return crossing

    def _small(self, plan: PackPlan) -> bool:
        return (
            self.coalesce
            and plan.wire_nbytes <= _COALESCE_MAX_BATCH
            and plan.nbytes <= _COALESCE_CAPACITY
        )

    def _start(self, plan: PackPlan, ep: Epoch) -> Crossing:
        """A crossing whose first batch is ``plan``, staged: a small batch in a staging buffer
        that later small batches share, any other in one of its own size."""
        crossing = Crossing(shared=self._small(plan))
        try:
            size = _COALESCE_CAPACITY if crossing.shared else plan.nbytes
            if size:
                crossing.host = self._staging_buffer(size)
            self._stage_part(crossing, plan, 0, ep.owned)
        except BaseException:
            self._drop_staging(crossing)
            raise
        return crossing

    def _stage_part(self, crossing: Crossing, plan: PackPlan, offset: int, owned: bool) -> None:
        """Add ``plan`` to ``crossing`` at ``offset`` of its staging buffer: its staged tensors
        written there (on the writer threads when large), its direct ones pinned by
        ``pin_memory()`` if pageable, or copied into pinned memory of the loader's own if the
        source's pinned memory is not the loader's to read later."""
        sources = []
        for leaf, source in plan.direct_pairs():
            if leaf.pin:
                source = source.pin_memory()
            elif not owned:
                source = pinned_copy(source)
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
            crossing.writes += [self.writer.submit(job) for job in jobs]
            return
        plan.write_into(staging, offset)

    def _settle_writes(self, ep: Epoch) -> None:
        """Wait until the writer threads have read every batch read so far (their errors are
        raised in their turn, by ``issue_ready``)."""
        pending = [f for c in (*ep.pulled, ep.carried) if c is not None for f in c.writes]
        if not pending:
            return
        started = time.perf_counter()
        with housekeeping():
            wait(pending)
        self.times["stall_s"] += time.perf_counter() - started

    def _drop_staging(self, crossing: Crossing) -> None:
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

    # ---- queueing copies --------------------------------------------------------------------

    def issue_ready(self, ep: Epoch, key: Any) -> None:
        """Queue the copies of staged crossings, up to ``depth`` ahead of the consumer, whose
        current stream is ``key``. Waits for writes only when the consumer has nothing else
        to take."""
        while ep.pulled and len(ep.issued) < max(self.depth, 1):
            crossing = ep.pulled[0]
            if ep.issued and not all(f.done() for f in crossing.writes):
                return
            ep.pulled.popleft()
            try:
                self._finish_writes(crossing)
            except Exception as exc:  # raised to the consumer after the batches before it
                ep.failure = exc
                self.discard(ep.pulled)
                self.end_source(ep)
                return
            self._issue(crossing, key)
            ep.issued.append(crossing)

    def _finish_writes(self, crossing: Crossing) -> None:
        if not crossing.writes:
            return
        started = time.perf_counter()
        try:
            for future in crossing.writes:
                future.result()
            crossing.writes = []
        except BaseException:
            self._drop_staging(crossing)
            raise
        finally:
            self.times["stall_s"] += time.perf_counter() - started

    def stream(self, key: Any) -> Any:
        """The stream object of ``key`` (the current stream's)."""
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = self.device.current_stream()
        return stream

    def _issue(self, crossing: Crossing, key: Any) -> None:
        """One copy of the staged bytes, and one per direct source tensor, into fresh device
        memory; docs/architecture/transfer-pipeline.md says which stream runs it."""
        side = crossing.wire >= SIDE_STREAM_BYTES and self.side_copies
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
                [
                    torch.empty(leaf.shape, dtype=leaf.dtype, device=target)
                    for leaf in (plan.layout.leaves[i] for i in plan.layout.direct_leaves)
                ]
                for plan, _ in crossing.parts
            ]
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
        start = None
        if self.timing:
            start = self.device.new_event(timing=True)
            start.record(stream)
        # Driver copies need the stream's handle, and run in the current device's context only.
        handle = None
        if self.driver is not None and torch.cuda.current_device() == self.device.index:
            handle = stream.cuda_stream
        kept: list[torch.Tensor] = []  # direct sources of driver copies, alive until they ran
        if crossing.host is not None and crossing.on_device is not None:  # (bytes staged)
            self._copy_bytes(crossing.on_device, crossing.host.bytes, crossing.nbytes, handle)
        for outs, sources in zip(crossing.direct_out, crossing.direct_sources, strict=True):
            for out, source in zip(outs, sources, strict=True):
                if self._copy_bytes(out, source, source.nbytes, handle):
                    kept.append(source)
        crossing.direct_sources = []
        if self.timing or crossing.host is not None or stream is self.copy_stream or kept:
            crossing.done = self.device.new_event(timing=self.timing)
            crossing.done.record(stream)
        if kept:
            self.sources_in_flight.append((crossing.done, kept))
        if self.timing:
            crossing.copy_times = (start, crossing.done)

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

    # ---- handing out --------------------------------------------------------------------------

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
        counts = self.counts
        counts["batches"] += 1
        wire = plan.wire_nbytes
        counts["bytes_moved"] += wire
        counts["logical_bytes"] += plan.logical_nbytes
        report_copy("h2d", wire, "DeviceLoader batch", "uint8", True)
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

    # ---- ending -------------------------------------------------------------------------------

    def end_source(self, ep: Epoch) -> None:
        """Stop reading the epoch's source (a batch started for the next crossing stays)."""
        source, ep.source = ep.source, None
        close_source = getattr(source, "close", None)  # a generator's finally blocks run now
        if close_source is not None:
            with suppress(Exception):
                close_source()

    def discard(self, crossings: deque[Crossing]) -> None:
        """Drop crossings never handed out (whole or in part); the host waits only for a
        write still running on a writer thread."""
        while crossings:
            crossing = crossings.popleft()
            self._drop_staging(crossing)
            crossing.release_unused()

    def end_epoch(self, ep: Epoch) -> None:
        """Stop the epoch: its source closed, what it read ahead dropped."""
        if ep.ended:
            return
        ep.ended = True
        self.end_source(ep)
        ep.failure = None
        if ep.carried is not None:
            self.discard(deque([ep.carried]))
            ep.carried = None
        self.discard(ep.pulled)
        self.discard(ep.issued)
        with suppress(ValueError):
            self.epochs.remove(ep)

    def release(self) -> None:
        """Free staging memory (also what the finalizer of a loader dropped without
        ``close()`` runs)."""
        if self.released:
            return
        self.released = True
        for ep in list(self.epochs):
            self.end_epoch(ep)
        if self.writer is not None:
            self.writer.shutdown(wait=False)  # idle: end_epoch waited for every write
        with housekeeping():
            while self.sources_in_flight:  # driver copies still reading the caller's memory
                self.sources_in_flight.popleft()[0].synchronize()
            self.pool.close()  # waits for copies still reading staging memory
