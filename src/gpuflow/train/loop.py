"""The training loop: steps, and *when* to log, sample the bus, evaluate, checkpoint, stop.

The step (``gpuflow.train.step``) does the work; ``Cadence`` says when the rest happens,
``BusMeter`` and ``Throughput`` (``gpuflow.train.meter``) measure, and a logging step's
record waits until its scalars have landed on the host, a few steps later.

Records fall on logging steps and the last step alone. A checkpoint inside an interval
keeps the means so far (``IntervalPart``) in its record instead of writing one: the record
closing the interval averages them in, so that a run resumed from that checkpoint writes
the records an uninterrupted run writes.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gpuflow.common.errors import GpuflowError
from gpuflow.common.signals import handling
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import TrainConfig
from gpuflow.train.display import TrainDisplay
from gpuflow.train.distributed import agree, largest
from gpuflow.train.meter import BusMeter, IntervalPart, Throughput
from gpuflow.train.runfolder import MetricsLog
from gpuflow.train.schedule import lr_at, warmup_notice
from gpuflow.train.step import TrainStep
from gpuflow.train.trackers import Tracker, open_trackers

if TYPE_CHECKING:
    from gpuflow.device.accelerator import Device
    from gpuflow.train.config import RunConfig
    from gpuflow.train.distributed import Ranks
    from gpuflow.train.setup import RunSetup


class LoopHost(Protocol):
    """What the loop asks of the run it steps (``Trainer`` is one): the run's settings and
    place, and the work that is not a step's."""

    config: RunConfig
    device: Device
    ranks: Ranks
    run_dir: Path
    setup: RunSetup

    @property
    def tokens_per_step(self) -> int: ...

    def evaluate(self) -> float: ...

    def gather_state(self) -> None: ...

    def save(
        self,
        checkpointer: ckpt.Checkpointer,
        step: int,
        names: tuple[str, ...] | None = None,
        interval: IntervalPart | None = None,
    ) -> None: ...

    def mfu(self, tokens_per_s: float | None) -> float | None: ...


class _StopFlag:
    """Turns the first Ctrl-C (SIGINT) or SIGTERM (what schedulers and ``kill`` send) into a
    request to stop at the next step boundary, with a checkpoint."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False

    @contextmanager
    def installed(self) -> Iterator[None]:
        def handler(signum: int, frame: object) -> None:
            if self.requested:  # a second signal: stop now, without a checkpoint
                raise KeyboardInterrupt
            self.requested = True

        with handling(self.SIGNALS, handler):
            yield


@dataclass(frozen=True)
class Cadence:
    """When the loop logs, evaluates and checkpoints, after ``done`` steps."""

    config: TrainConfig

    def logs(self, done: int) -> bool:
        return done % self.config.log_interval == 0

    def records(self, done: int) -> bool:
        """Whether a train record closes at ``done``: on logging steps and at the end."""
        return self.logs(done) or done == self.config.steps

    def evaluates(self, done: int) -> bool:
        return done % self.config.eval_interval == 0 or done == self.config.steps

    def checkpoints(self, done: int, stopping: bool) -> bool:
        tc = self.config
        return done % tc.checkpoint_interval == 0 or done == tc.steps or stopping


class _Quiet:
    """The display and metrics log of a rank other than 0: rank 0 shows and writes."""

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def record(self, record: dict[str, Any]) -> None:
        pass

    write = record

    def step(self, step: int) -> None:
        pass


def run_steps(
    train_step: TrainStep, first: int, stop: int, after_step: Callable[[int], None] | None = None
) -> None:
    """Steps ``first`` to ``stop`` as ``TrainLoop`` runs them, less its records, evaluations
    and checkpoints: each step, the readback a logging step makes where one ends an
    interval, then ``after_step(step)``. What the benches and ``profile`` measure."""
    when = Cadence(train_step.config)
    for step in range(first, stop):
        train_step(step)
        if when.logs(step + 1):
            train_step.readback(step + 1)
        if after_step is not None:
            after_step(step)


class TrainLoop:
    """The loop of one ``Trainer.run``: it runs the step and decides when to log, sample the
    bus, evaluate, checkpoint and stop; and it writes the records.

    In a data-parallel job every rank runs it; rank 0 alone evaluates, shows, writes and
    checkpoints, and a stop request is agreed on at logging steps (``agree``), so that every
    rank stops after the same step."""

    def __init__(
        self,
        trainer: LoopHost,
        train_step: TrainStep,
        checkpointer: ckpt.Checkpointer,
        started: float,
        show_bus: bool,
    ) -> None:
        self.trainer, self.train_step, self.checkpointer = trainer, train_step, checkpointer
        # the lowest validation loss so far (a resumed run's too)
        self.best_val = trainer.setup.best_val
        self.started, self.show_bus = started, show_bus
        self.config = trainer.config.train
        self.throughput = Throughput(trainer.tokens_per_step, trainer.device)
        first_sampled = trainer.setup.start_step + train_step.warmup
        self.bus = BusMeter(trainer.device, self.config.log_interval, first_sampled)
        # Per logging step, its lr and timing, held until its scalars land on the host.
        self.pending: dict[int, dict[str, Any]] = {}
        # The interval a checkpoint came inside, so far (a resumed run's from its checkpoint),
        # and the step the scalars were last flushed at.
        self.part: IntervalPart | None = trainer.setup.interval
        self.flushed = trainer.setup.start_step
        self.trackers: list[Tracker] = []  # TensorBoard, W&B: opened by run (rank 0)

    def run(self, latest: Path | None) -> int:
        """Steps from ``start_step`` until the end or a stop request; returns the step reached."""
        trainer, tc, when = self.trainer, self.config, Cadence(self.config)
        ranks = trainer.ranks
        main = ranks.is_main
        setup = trainer.setup
        step = setup.start_step
        stop = _StopFlag()
        with (
            TrainDisplay(tc.steps, step, self.show_bus) if main else _Quiet() as self.display,
            MetricsLog(trainer.run_dir) if main else _Quiet() as self.metrics,
            self._tracking(main),
            stop.installed(),
        ):
            # Said once the run is built: a run refused while building says only why.
            job = f", {ranks.world_size} ranks" if ranks.distributed else ""
            self.display.note(
                f"run folder {trainer.run_dir}, preset {trainer.config.preset}, "
                f"device {trainer.device}{job}"
            )
            why = f" ({setup.path_note})" if setup.path_note else ""
            self.display.note(f"data path: {setup.path}{why}")
            self.display.note(setup.batching.describe())
            if setup.val_bytes_note:
                self.display.note(setup.val_bytes_note)
            if setup.io is not None and trainer.device.type == "cuda":  # (a GPU-only choice)
                self.display.note(setup.io.describe())
            if notice := warmup_notice(tc):
                self.display.note(notice)
            if latest is not None:
                self.display.note(f"resumed {trainer.run_dir} at step {step} from {latest.name}")
            elif main:  # the untrained baseline, so the curve shows what was learnt
                self.evaluate(step)
            self.throughput.restart()  # time training, not setup
            while step < tc.steps:
                with self.bus.step(step, self.throughput):  # sampled: under the ledger
                    self.train_step(step)
                step += 1
                self.checkpointer.check()  # a failed write stops the run now, not an interval on
                stopping = stop.requested  # read once: a signal may land mid-iteration
                if ranks.distributed:  # every rank stops after the same step
                    stopping = when.logs(step) and agree(stopping, ranks)
                checkpoint_now = when.checkpoints(step, stopping)
                if when.records(step):
                    self.close_interval(step)
                if ranks.distributed and (checkpoint_now or when.evaluates(step)):
                    trainer.gather_state()  # any checkpoint below holds every rank's part
                evaluate_now = main and when.evaluates(step)
                with self.throughput.paused(evaluate_now or checkpoint_now):
                    names = []
                    if checkpoint_now:
                        self.settle(step)  # diverged: stops
                        names.append(ckpt.step_name(step))
                    if evaluate_now and (val := self.evaluate(step)) < self.best_val:
                        self.best_val = val
                        names.append(ckpt.BEST)
                    if names and main:
                        part = self.part if checkpoint_now else None  # (best alone: no resume)
                        trainer.save(self.checkpointer, step, tuple(names), part)
                if stopping:
                    break
        return step

    @contextmanager
    def _tracking(self, main: bool) -> Iterator[None]:
        """The trackers ``log`` asks for (rank 0's), open while the loop runs."""
        host = self.trainer
        if main:
            self.trackers = open_trackers(host.config, host.run_dir, host.device.describe())
        try:
            yield
        finally:
            for tracker in self.trackers:
                tracker.close()

    def emit(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        for tracker in self.trackers:
            tracker.record(record)
        self.display.record(record)

    def evaluate(self, step: int) -> float:
        val = self.trainer.evaluate()
        record: dict[str, Any] = {"step": step, "val_loss": val}
        # (from the bytes counted at setup: host arithmetic, nothing more read back)
        if (bpb := self.trainer.setup.bits_per_byte(val)) is not None:
            record["val_bpb"] = bpb
        self.emit(record)
        return val

    def close_interval(self, step: int) -> None:
        """A logging step: the interval's timing and bus figures wait for its scalars."""
        interval = self.throughput.close_interval()
        with self.bus.readback():
            results = self.train_step.readback(step)
        self.flushed = step
        # Under torchrun every rank counts its own sampled step; the record keeps the largest
        # figure of each (a sync on any rank shows), exchanged at this step on every rank.
        bus = largest(self.bus.take(), self.trainer.ranks)
        self.pending[step] = {
            "lr": lr_at(step - 1, self.config),
            "interval": interval,  # timed when its scalars land
            "elapsed_s": time.perf_counter() - self.started,
            **bus,
            **self.trainer.device.memory_sample(),  # host reads only: the soak's record
        }
        self.publish(results)
        self.display.step(step)

    def settle(self, step: int) -> None:
        """Before a checkpoint: every record due written, and the interval ``step`` falls
        inside (where it closes none) kept in ``part``, the checkpoint's to carry."""
        for tag, means in self.train_step.scalars.drain(step):
            if tag in self.pending:
                self.publish([(tag, means)])
                continue
            self.part = (self.part or IntervalPart(self.flushed)).then(tag, means)
            self.flushed = tag
            if not math.isfinite(self.part.means["loss"]):
                self.diverged(tag, self.part.means["loss"])

    def publish(self, results: list[tuple[int, dict[str, float]]]) -> None:
        """Write the records whose scalars have landed (the first of an interval a checkpoint
        came inside with the means of its part before)."""
        for tag, means in results:
            if self.part is not None and self.part.through < tag:
                means, self.part = dict(self.part.then(tag, means).means), None
            fields = self.pending.pop(tag)
            rate = self.throughput.rate(fields.pop("interval"))  # its scalars landed
            mfu = self.trainer.mfu(rate)
            self.emit({"step": tag, **means, **fields, "tokens_per_s": rate, "mfu": mfu})
            if not math.isfinite(means["loss"]):
                self.diverged(tag, means["loss"])

    def diverged(self, step: int, loss: float) -> None:
        """Stop a run whose loss is no longer a number, before it saves such weights."""
        self.checkpointer.wait()
        written = self.checkpointer.written
        where = (
            f"its last good checkpoint is {written[-1].name}" if written else "it has no checkpoint"
        )
        raise GpuflowError(
            f"training diverged: the loss is {loss} at step {step} ({where}); lower train.lr "
            f"(now {self.config.lr:g}) or raise train.warmup_steps and train again"
        )
