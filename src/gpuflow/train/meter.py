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

``IntervalPart`` is what a checkpoint inside an interval keeps of it: the means of its steps
so far, averaged into the record that closes the interval, in this run or a resumed one.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
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

    def __init__(self, device: Device, log_interval: int, first_sampled: int, steps: int) -> None:
        self.device, self.log_interval, self.first_sampled = device, log_interval, first_sampled
        self.steps = steps  # the run's: its last step closes an interval too
        self.fields: dict[str, float] = {}

    def samples(self, step: int) -> bool:
        """Whether step ``step`` (about to run) is its interval's sampled one: its last, or the
        run's last where that closes an interval cut short (of two steps or more: the sampled
        step is left out of the timing). Steps that compile or capture are not: they are
        warm-up, not steps to count."""
        last_of_interval = (step + 1) % self.log_interval == 0
        last_of_run = step + 1 == self.steps and step % self.log_interval > 0
        return (
            self.log_interval > 1
            and (last_of_interval or last_of_run)
            and step >= self.first_sampled
        )

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


@dataclass(frozen=True)
class IntervalPart:
    """The first steps of a logging interval that a checkpoint came inside: their means (the
    train step's scalars) up to step ``through``. The checkpoint records it (state.json's
    ``interval``), and the record closing the interval averages it in, so that a run resumed
    from that checkpoint logs the records, and the means, an uninterrupted run logs."""

    through: int  # the last step it covers
    steps: int = 0  # how many steps it covers, up to ``through``
    means: Mapping[str, float] = field(default_factory=dict)

    def then(self, through: int, means: Mapping[str, float]) -> IntervalPart:
        """This part and the steps after it up to ``through``, whose means are ``means``:
        each name's mean over both, weighted by their steps (a name one side lacks had no
        value there)."""
        later = through - self.through
        steps = self.steps + later
        merged = {}
        for name in dict.fromkeys([*self.means, *means]):
            if name not in self.means or name not in means:
                merged[name] = self.means.get(name, means.get(name, 0.0))
                continue
            merged[name] = (self.means[name] * self.steps + means[name] * later) / steps
        return IntervalPart(through, steps, merged)

    def as_record(self) -> dict[str, Any]:
        return {"through": self.through, "steps": self.steps, "means": dict(self.means)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> IntervalPart:
        """The part a checkpoint recorded (its type checked where the record was read)."""
        means = {name: float(value) for name, value in record["means"].items()}
        return cls(int(record["through"]), int(record["steps"]), means)
