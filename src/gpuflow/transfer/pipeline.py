"""How ``DeviceLoader`` moves batches: a ``Stager`` reads ahead and stages
(``transfer/staging.py``), an ``Issuer`` copies and hands out (``transfer/issuing.py``), and
``Pipeline`` runs the epochs under way through both.

The steps a batch takes, which thread runs each, and why: docs/architecture/transfer-pipeline.md.
"""

from __future__ import annotations

from collections import deque
from contextlib import suppress
from typing import Any

from gpuflow.accounting.tally import housekeeping
from gpuflow.device.accelerator import Device
from gpuflow.transfer.issuing import Issuer
from gpuflow.transfer.packing import Planner
from gpuflow.transfer.staging import BatchTiming, Crossing, Epoch, Stager


class Pipeline:
    """The loader's state: the stager and its staging pool, the issuer and its copy stream,
    the epochs under way. It holds no reference to its ``DeviceLoader``, so a loader dropped
    without ``close()`` is collected and its finalizer frees what is here."""

    def __init__(
        self, device: Device, depth: int, planner: Planner, pool_bytes: int | None,
        timing: bool, coalesce: bool,
    ) -> None:  # fmt: skip
        self.device, self.depth, self.timing = device, depth, timing
        self.epochs: list[Epoch] = []  # those under way: each iter() starts one
        self.times = {"source_s": 0.0, "stall_s": 0.0}
        self.stager = Stager(device, depth, planner, pool_bytes, coalesce, self.times, self.epochs)
        self.issuer = Issuer(device, self.stager.pool, timing)
        self.stager.cross_early = self.issuer.cross_early
        self.coalesce = self.stager.coalesce
        self.pool = self.stager.pool
        self.counts = self.issuer.counts
        self.released = False
        # batches handed out as they are read, where copies run on streams and none is timed
        self.at_once = device.has_streams and not timing

    def take_at_once(self, ep: Epoch) -> Any:
        """The next batch, read, copied on the current stream and handed out now, when
        nothing of the epoch is read ahead and it is a batch DataLoader's pin thread made
        whose tensors all cross where they lie (``PackLayout.direct_only``). Reading it ahead
        would queue its copies on that same stream in the same order, and the host work of a
        crossing and of its reading ahead cost the image loop 3-4% of its step
        (docs/decisions/044). Otherwise None (such a batch holds a tensor, so it is never
        None), a batch read starting the next crossing."""
        if not (self.at_once and ep.pinned) or ep.pulled or ep.issued or ep.carried is not None:
            return None
        plan = self.stager.next_plan(ep)
        if plan is None:  # the source's end or error: take() reports it
            return None
        if not plan.layout.direct_only:
            ep.carried = self.stager.start(plan, ep)
            return None
        return self.issuer.hand_out_at_once(plan)

    def top_up(self, ep: Epoch) -> None:
        """Read and stage batches until ``depth + 1`` crossings are on their way."""
        self.stager.top_up(ep)

    def stream(self, key: Any) -> Any:
        """The stream object of ``key`` (the current stream's)."""
        return self.issuer.stream(key)

    def take(self, ep: Epoch, key: Any) -> tuple[Any, BatchTiming | None] | None:
        """The next batch, ordered after its copy on the stream ``key`` names (the current
        one), or None at the end of the epoch."""
        return self.issuer.take(ep, key)

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
                self.stager.finish_writes(crossing)
            except Exception as exc:  # raised to the consumer after the batches before it
                ep.failure = exc
                self.discard(ep.pulled)
                self.stager.end_source(ep)
                return
            self.issuer.issue(crossing, key)
            ep.issued.append(crossing)

    def discard(self, crossings: deque[Crossing]) -> None:
        """Drop crossings never handed out (whole or in part); the host waits only for a
        write still running on a writer thread."""
        while crossings:
            crossing = crossings.popleft()
            self.stager.drop_staging(crossing)
            crossing.release_unused()

    def end_epoch(self, ep: Epoch) -> None:
        """Stop the epoch: its source closed, what it read ahead dropped."""
        if ep.ended:
            return
        ep.ended = True
        self.stager.end_source(ep)
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
        self.stager.close()  # idle: end_epoch waited for every write
        with housekeeping():
            self.issuer.close()  # driver copies still reading the caller's memory
            self.pool.close()  # waits for copies still reading staging memory
