"""When a run's records are written, and what each holds.

A train record closes a logging interval (and the last step): the interval's mean loss and
grad norm, its learning rate, tokens/s, MFU, bus figures and memory. Its scalars come back
through ``AsyncScalars`` a few steps late, so the record waits, held with what the host
already knows, until they land; then it goes to metrics.jsonl, the trackers and the display
together. A validation record is written at once (its loss was read on the spot).

A checkpoint inside an interval keeps the means so far (``IntervalPart``) in its record
instead of writing one: the record closing the interval averages them in, so that a run
resumed from that checkpoint writes the records an uninterrupted run writes. A loss that is
no longer a number stops the run before it saves such weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.train.checkpoint import Checkpointer, latest_checkpoint
from gpuflow.train.config import TrainConfig
from gpuflow.train.meter import Interval, IntervalPart, Throughput
from gpuflow.train.schedule import lr_at
from gpuflow.transfer.scalars import AsyncScalars

Sink = Callable[[dict[str, Any]], None]  # where a record goes: metrics.jsonl, a tracker, ...


class Records:
    """The records of one run. In a data-parallel job every rank keeps its intervals and
    checks its losses; rank 0 alone has ``sinks``."""

    def __init__(
        self, sinks: Sequence[Sink], config: TrainConfig, device: Device, throughput: Throughput,
        mfu: Callable[[float | None], float | None], checkpointer: Checkpointer,
        part: IntervalPart | None, start_step: int, started: float,
    ) -> None:  # fmt: skip
        self.sinks, self.config, self.device = sinks, config, device
        self.throughput, self.mfu, self.checkpointer = throughput, mfu, checkpointer
        self.started = started  # the run's start, on the host clock: records' elapsed_s
        # Per logging step, its lr and timing, held until its scalars land on the host.
        self.pending: dict[int, dict[str, Any]] = {}
        # The interval a checkpoint came inside, so far (a resumed run's from its checkpoint),
        # and the step the scalars were last flushed at.
        self.part = part
        self.flushed = start_step

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink(record)

    def validation(self, step: int, val_loss: float, bits_per_byte: float | None) -> None:
        record: dict[str, Any] = {"step": step, "val_loss": val_loss}
        if bits_per_byte is not None:
            record["val_bpb"] = bits_per_byte
        self.write(record)

    def close(
        self, step: int, interval: Interval, bus: dict[str, float],
        landed: list[tuple[int, dict[str, float]]],
    ) -> None:  # fmt: skip
        """A logging step: the interval's record is held until its scalars land, and the
        records whose scalars have (``landed``, read back at this step) are written."""
        self.flushed = step
        self.pending[step] = {
            "lr": lr_at(step - 1, self.config),
            "interval": interval,  # timed when its scalars land
            "elapsed_s": time.perf_counter() - self.started,
            **bus,
            **self.device.memory_sample(),  # host reads only: the soak's record
        }
        self.publish(landed)

    def settle(self, step: int, scalars: AsyncScalars) -> None:
        """Before a checkpoint: every record due written, and the interval ``step`` falls
        inside (where it closes none) kept in ``part``, the checkpoint's to carry."""
        for tag, means in scalars.drain(step):
            if tag in self.pending:
                self.publish([(tag, means)])
                continue
            self.part = (self.part or IntervalPart(self.flushed)).then(tag, means)
            self.flushed = tag
            if not math.isfinite(self.part.means["loss"]):
                self._diverged(tag, self.part.means["loss"])

    def publish(self, landed: list[tuple[int, dict[str, float]]]) -> None:
        """Write the records whose scalars have landed (the first of an interval a checkpoint
        came inside with the means of its part before)."""
        for tag, means in landed:
            if self.part is not None and self.part.through < tag:
                means, self.part = dict(self.part.then(tag, means).means), None
            fields = self.pending.pop(tag)
            rate = self.throughput.rate(fields.pop("interval"))  # its scalars landed
            mfu = self.mfu(rate)
            self.write({"step": tag, **means, **fields, "tokens_per_s": rate, "mfu": mfu})
            if not math.isfinite(means["loss"]):
                self._diverged(tag, means["loss"])

    def _diverged(self, step: int, loss: float) -> None:
        """Stop a run whose loss is no longer a number, before it saves such weights."""
        self.checkpointer.wait()
        written = self.checkpointer.written
        # This session's newest, else one an earlier session left (a resumed run's)
        last = written[-1] if written else latest_checkpoint(self.checkpointer.run_dir)
        where = f"its last good checkpoint is {last.name}" if last else "it has no checkpoint"
        raise GpuflowError(
            f"training diverged: the loss is {loss} at step {step} ({where}); lower train.lr "
            f"(now {self.config.lr:g}) or raise train.warmup_steps and train again"
        )
