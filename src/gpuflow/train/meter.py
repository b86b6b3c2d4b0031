"""What a run measures about itself: tokens/s per logging interval, and the bus figures of
one sampled step per interval.

``Throughput`` times intervals with device events, evaluation, checkpoints and the sampled
step left out. A host clock would time the host's queueing: with a captured step the host
runs up to two intervals ahead of the device. Events recorded on the device's stream at the
interval's ends are read once its scalars have landed, which is after the device has passed
them.

``BusMeter`` runs the last step of each interval under a ``TransferLedger`` (untimed: the
ledger slows the host) and the interval's readback too, spread over the interval's steps:
its host->device and device->host bytes, host syncs and cudaMalloc calls per step.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from gpuflow.accounting.ledger import TransferLedger
from gpuflow.device.accelerator import Device


@dataclass
class Interval:
    """One logging interval's timing: device events at its ends and around its pauses."""

    steps: int
    start: Any
    end: Any
    pauses: list[tuple[Any, Any]]

    def seconds(self) -> float:
        """Device time between the ends less the pauses; the end must have been reached."""
        ms = self.start.elapsed_time(self.end)
        ms -= sum(begin.elapsed_time(finish) for begin, finish in self.pauses)
        return max(ms, 1e-6) / 1e3


class Throughput:
    """Tokens/s per logging interval, timed on the device."""

    def __init__(self, tokens_per_step: int, device: Device) -> None:
        self.tokens_per_step = tokens_per_step
        self.device = device
        self.rates: list[float] = []
        self.restart()

    def _now(self) -> Any:
        event = self.device.new_event(timing=True)
        event.record()
        return event

    def restart(self) -> None:
        self._start, self._steps, self._pauses = self._now(), 0, []

    def step(self) -> None:
        self._steps += 1

    def close_interval(self) -> Interval:
        interval = Interval(self._steps, self._start, self._now(), self._pauses)
        self._start, self._steps, self._pauses = interval.end, 0, []
        return interval

    def rate(self, interval: Interval) -> float | None:
        """The interval's tokens/s, once the device has passed its end (None: no timed step
        in it, its only step the ledger's)."""
        if not interval.steps:
            return None
        rate = interval.steps * self.tokens_per_step / interval.seconds()
        self.rates.append(rate)
        return rate

    @contextmanager
    def paused(self, pause: bool = True) -> Iterator[None]:
        if not pause:
            yield
            return
        begin = self._now()
        try:
            yield
        finally:
            self._pauses.append((begin, self._now()))

    def steady_median(self) -> float | None:
        steady = self.rates[1:] or self.rates  # the first interval pays for warm-up
        return statistics.median(steady) if steady else None


class BusMeter:
    """The bus figures of each logging interval, from its last step and its readback."""

    def __init__(self, device: Device, log_interval: int, first_sampled: int) -> None:
        self.device, self.log_interval, self.first_sampled = device, log_interval, first_sampled
        self.fields: dict[str, float] = {}

    def samples(self, step: int) -> bool:
        """Whether step ``step`` (about to run) is its interval's sampled one. Steps that
        compile or capture are not: they are warm-up, not steps to count."""
        last_of_interval = (step + 1) % self.log_interval == 0
        return self.log_interval > 1 and last_of_interval and step >= self.first_sampled

    @contextmanager
    def step(self, step: int, throughput: Throughput) -> Iterator[None]:
        """Around training step ``step``: under the ledger and out of the timing if sampled."""
        if not self.samples(step):
            yield
            throughput.step()
            return
        with throughput.paused(), TransferLedger(self.device) as ledger:
            yield
        self.fields = ledger.summary().totals.per_step()

    @contextmanager
    def readback(self) -> Iterator[None]:
        """Around a logging step's readback: paid once per interval, spread over it."""
        with TransferLedger(self.device) if self.fields else nullcontext() as ledger:
            yield
        if ledger is not None:
            flushed = ledger.summary().totals.per_step(self.log_interval)
            self.fields["d2h_bytes_per_step"] += flushed["d2h_bytes_per_step"]
            self.fields["syncs_per_step"] += flushed["syncs_per_step"]

    def take(self) -> dict[str, float]:
        """The interval's fields (empty when no step of it was sampled), then a fresh start."""
        fields, self.fields = self.fields, {}
        return fields
