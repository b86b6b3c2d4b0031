"""One training run, top to bottom: ``Trainer.run`` sets the run up, steps it, and after each
step does what falls due (a logging interval's record, an evaluation, a checkpoint, a stop);
then it reports.

    gpuflow train --preset tiny
    torchrun --nproc_per_node=2 -m gpuflow train --preset seed-d384

The step (``gpuflow.train.step``) queues device work only: by default the corpus is resident
on the device and, on CUDA, the whole step is one CUDA graph replay; the data path
(``gpuflow.train.datapath``) says how batches arrive, and ``gpuflow.train.setup`` builds
what the run is made of. Scalars come back through ``AsyncScalars`` a few steps late, so a
record is written when they land (``gpuflow.train.records``). The loop itself only decides
*when* (``Cadence``). Ctrl-C or SIGTERM is honoured at the next step boundary with a
checkpoint, so an interrupted run resumes exactly.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError
from gpuflow.common.signals import handling
from gpuflow.data.resident.sources import BatchSource
from gpuflow.device.accelerator import Device, out_of_memory_figures
from gpuflow.model.gpt import flops_per_token
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import RunConfig, TrainConfig
from gpuflow.train.datapath import open_batches
from gpuflow.train.display import TrainDisplay
from gpuflow.train.distributed import Ranks, agree, each_rank, ignore_sigterm, largest
from gpuflow.train.meter import BusMeter, IntervalPart, Throughput
from gpuflow.train.records import Records, Sink
from gpuflow.train.resumed_data import record_fields, tokenizer_digest
from gpuflow.train.runfolder import TOKENIZER_FILE, MetricsLog, RunFolder, truncate_metrics
from gpuflow.train.schedule import warmup_notice
from gpuflow.train.setup import RunSetup, build_setup
from gpuflow.train.step import StepOptions, StepParts, TrainStep, build_step
from gpuflow.train.trackers import open_trackers
from gpuflow.transfer.diskread import IoChoice
from gpuflow.transfer.mirror import read_now

# Tokens one piece of an evaluation takes: its logits, 16384 x 50304 in bf16, 1.6 GB at most.
EVAL_PIECE_TOKENS = 16384


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    last_step: int
    interrupted: bool
    seconds: float
    device: dict[str, Any]
    parameters: int
    tokens_per_s: float | None  # the job's, median over logging intervals
    mfu: float | None
    world_size: int = 1
    tokens_per_step: int = 0  # the job's: every rank's batch
    micro_batch: int = 0  # sequences in one forward and backward
    accumulation: int = 1  # micro-batches per step on each rank
    # What each rank handed NCCL per step (the gradients' all-reduce): computed from the
    # buffers it reduces, since the transfer ledger cannot see collectives. None: one process.
    collective_bytes_per_step: int | None = None
    exchange: str | None = None  # how the ranks exchange gradients and weights
    data_io: IoChoice | None = None  # how the resident corpus was read; None: no such corpus
    # What the turns of a corpus streamed in chunks cost rank 0 (turns, host seconds, bytes
    # read); None: the corpus stayed resident, or the path has none.
    chunk_turns: dict[str, Any] | None = None
    # The most device memory each rank's tensors took at once while it trained (torch's
    # allocator: allocated, not the cache it reserves beside), in rank order; None off CUDA.
    peak_device_bytes: list[int] | None = None
    # The step after which the run's evaluations used today's validation windows (None: all
    # of them): the report's best loss counts only those (``train/resumed_data.py``).
    val_since: int | None = None


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


def resume_command(name: str, ranks: Ranks) -> str:
    """The command that continues run ``name``: under torchrun, the same launch (copied as
    one process, it would go on alone)."""
    resume = f"gpuflow train --name {name} --resume"
    if not ranks.distributed:
        return resume
    per_host = ranks.local_world_size or ranks.world_size
    hosts = ranks.world_size // per_host
    launch = f"--nnodes {hosts} (and the rest of the launch) " if hosts > 1 else ""
    return f"torchrun {launch}--nproc_per_node={per_host} -m {resume}"


class Trainer:
    """One run: builds the model and its optimizer, restores its checkpoint, opens its step,
    trains, logs and saves. ``options`` vary how the step is built (probes); the defaults
    are what ``gpuflow train`` runs. With ``ranks`` of a data-parallel job
    (``gpuflow.train.distributed``), this process is one rank: it trains on its slice of the
    corpus, and rank 0 alone evaluates, shows, writes and checkpoints; a stop request is
    agreed on at logging steps, so that every rank stops after the same step."""

    def __init__(
        self, config: RunConfig, run_dir: Path, device: Device, options: StepOptions | None = None,
        ranks: Ranks | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.run_dir = Path(run_dir)
        self.device = device
        self.options = options or StepOptions()
        self.ranks = ranks or Ranks()
        self.last_val: float | None = None  # the latest validation loss, for checkpoints
        self.setup: RunSetup  # the run's parts: ``build`` makes them
        self._flops_per_token = flops_per_token(config.model)
        self._peak_flops = device.peak_bf16_flops()

    def run(self, resume: bool = False, show_bus: bool = False) -> TrainResult:
        """Train from the start, or from the latest intact checkpoint; see ``RunFolder`` for
        what happens to the folder when this fails. ``show_bus``: the progress display
        shows the bus figures even while they are all zero."""
        try:
            return self._run(resume, show_bus)
        except torch.OutOfMemoryError as exc:
            cfg = self.config
            setup = getattr(self, "setup", None)
            micro = setup.batching.micro_batch if setup is not None else cfg.train.batch_size
            # (a run that failed before its first checkpoint was removed on the way here)
            kept = (
                "the run's checkpoints are intact"
                if self.run_dir.is_dir() and ckpt.latest_checkpoint(self.run_dir) is not None
                else "no checkpoint was written yet"
            )
            raise GpuflowError(
                f"out of device memory on {self.device} ({out_of_memory_figures(exc)}); lower "
                f"train.batch_size (the micro-batch, now {micro}; train.batch_tokens keeps the "
                f"step's size), model.max_len (now {cfg.model.max_len}) or the model's size, or "
                f"cap the resident corpus with data.device_budget_mb; {kept}"
            ) from None

    def _run(self, resume: bool, show_bus: bool) -> TrainResult:
        started = time.perf_counter()
        tc, device, ranks = self.config.train, self.device, self.ranks
        main = ranks.is_main
        when = Cadence(tc)
        say = err_console.print  # on rank 0 only: build() silences the others itself
        with ExitStack() as run:  # closed in reverse: the folder is let go last
            # ---- set-up: the folder, the run's parts, its step, where records go ----------
            folder = run.enter_context(RunFolder(self.run_dir, resume, say)) if main else None
            latest = self.build(resume, say)  # reads only: a refused run leaves no trace
            setup = self.setup
            step = setup.start_step
            train_step = run.enter_context(self.open_step(step, tc.steps))
            if folder is not None:
                folder.start(self.config, setup.data.tokenizer_path)
            # Records past the checkpoint are trained again; with none, the baseline too.
            last_kept = step if latest else -1
            if main and truncate_metrics(self.run_dir, last_kept):
                say("dropped the torn last line of metrics.jsonl (the run was stopped while "
                    "writing it)")  # fmt: skip
            # closed on the way out: the last checkpoint is on disk before the run reports
            checkpointer = run.enter_context(
                ckpt.Checkpointer(self.run_dir, device, tc.keep_checkpoints)
            )
            display: TrainDisplay | _Quiet = _Quiet()
            sinks: list[Sink] = []
            if main:
                display = run.enter_context(TrainDisplay(tc.steps, step, show_bus))
                metrics = run.enter_context(MetricsLog(self.run_dir))
                again = last_kept + 1 if resume else None  # the first step recorded again
                trackers = open_trackers(self.config, self.run_dir, device.describe(), again)
                for tracker in trackers:
                    run.callback(tracker.close)
                sinks = [metrics.write, *(t.record for t in trackers), display.record]
            stop = _StopFlag()
            run.enter_context(stop.installed(job=ranks.distributed))
            throughput = Throughput(self.tokens_per_step, device)
            bus = BusMeter(device, tc.log_interval, step + train_step.warmup, tc.steps)
            records = Records(
                sinks, tc, device, throughput, self.mfu, checkpointer, setup.interval, step,
                started,
            )  # fmt: skip
            for note in self._notes():  # said once built: a refused run says only why
                display.note(note)
            if latest is not None:
                display.note(f"resumed {self.run_dir} at step {step} from {latest.name}")
            elif main:  # the untrained baseline, so the curve shows what was learnt
                val = self.evaluate()
                records.validation(step, val, setup.bits_per_byte(val))
            best_val = setup.best_val  # the lowest validation loss so far (a resumed run's too)
            throughput.restart()  # time training, not set-up

            while step < tc.steps:
                # ---- the step: device work only (once an interval, under the ledger) -------
                with bus.step(step, throughput):
                    train_step(step)
                step += 1
                checkpointer.check()  # a failed write stops the run now, not an interval on

                # ---- a stop asked for: saved where it is, every rank after the same step ---
                stopping = stop.requested  # read once: a signal may land mid-iteration
                if ranks.distributed:
                    stopping = when.logs(step) and agree(stopping, ranks)
                checkpoint_now = when.checkpoints(step, stopping)
                evaluate_now = main and when.evaluates(step)

                # ---- logging, host only: an interval's record waits for its scalars --------
                if when.records(step):
                    interval = throughput.close_interval()
                    with bus.readback():
                        landed = train_step.readback(step)
                    # Every rank counts its own sampled step; the record keeps the largest
                    # figure of each (a sync on any rank shows), exchanged here on every rank.
                    records.close(step, interval, largest(bus.take(), ranks), landed)
                    display.step(step)

                # ---- evaluation and checkpoint, each at its interval, off the clock --------
                if ranks.distributed and (checkpoint_now or when.evaluates(step)):
                    self.gather_state()  # any checkpoint below holds every rank's part
                with throughput.paused(evaluate_now or checkpoint_now):
                    names = []
                    if checkpoint_now:
                        records.settle(step, train_step.scalars)  # diverged: stops here
                        names.append(ckpt.step_name(step))
                    if evaluate_now:
                        val = self.evaluate()
                        records.validation(step, val, setup.bits_per_byte(val))
                        if val < best_val:
                            best_val = val
                            names.append(ckpt.BEST)
                    if names and main:
                        part = records.part if checkpoint_now else None  # (best alone: no resume)
                        self.save(checkpointer, step, tuple(names), part)
                if stopping:
                    break

        # ---- the end: every file written and the folder let go; what the run did ----------
        if step < tc.steps and main:
            resume = resume_command(self.run_dir.name, ranks)
            say(f"interrupted: saved {checkpointer.written[-1]}; continue with `{resume}`")
        median_rate = throughput.steady_median()
        averager = setup.averager
        peaks = None
        if device.type == "cuda":  # every rank reaches here (collective)
            peaks = each_rank(torch.cuda.max_memory_allocated(device.torch), ranks)
        return TrainResult(
            run_dir=self.run_dir,
            start_step=setup.start_step,
            last_step=step,
            interrupted=step < tc.steps,
            seconds=time.perf_counter() - started,
            device=device.describe(),
            parameters=setup.model.parameter_count(),
            tokens_per_s=median_rate,
            mfu=self.mfu(median_rate),
            world_size=ranks.world_size,
            tokens_per_step=self.tokens_per_step,
            micro_batch=setup.batching.micro_batch,
            accumulation=setup.batching.accumulation,
            collective_bytes_per_step=averager.bytes_per_step if averager else None,
            exchange=getattr(averager, "exchange", None),
            data_io=setup.io,
            chunk_turns=self._chunk_turns,
            peak_device_bytes=peaks,
            val_since=setup.val_since,
        )

    # ---- the pieces of a run: the loop's, and what the benches and probes call ----------------

    def build(self, resume: bool, say: Callable[[str], None] = err_console.print) -> Path | None:
        """Build the run's parts (``setup``), restoring its checkpoint if resuming; returns
        the checkpoint's path. Reads, never writes (``build_setup``)."""
        self.setup = build_setup(
            self.config, self.run_dir, self.device, self.options, self.ranks, resume, say
        )
        return self.setup.checkpoint

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one step of the whole job (every rank trains its own batch); ``build``
        first: an automatic micro-batch is found there."""
        return self.setup.batching.tokens_per_step

    def _notes(self) -> list[str]:
        """What the run says about itself once it is built."""
        setup, ranks = self.setup, self.ranks
        job = f", {ranks.world_size} ranks" if ranks.distributed else ""
        why = f" ({setup.path_note})" if setup.path_note else ""
        notes = [
            f"run folder {self.run_dir}, preset {self.config.preset}, device {self.device}{job}",
            f"data path: {setup.path}{why}",
            setup.batching.describe(),
        ]
        if setup.val_bytes_note:
            notes.append(setup.val_bytes_note)
        if setup.io is not None and self.device.type == "cuda":  # (a GPU-only choice)
            notes.append(setup.io.describe())
        if notice := warmup_notice(self.config.train):
            notes.append(notice)
        return notes

    @contextmanager
    def open_step(
        self, start: int, stop: int, source: BatchSource | None = None
    ) -> Iterator[TrainStep]:
        """The run's step over its data path's batches for steps ``start`` to ``stop`` (or
        over ``source``, which the step then closes); ``build`` first."""
        setup = self.setup
        batches = source or open_batches(setup.path, setup.plan, self.device, start, stop)
        self._batches = batches  # whose position each checkpoint records
        self._chunk_turns = None
        with batches:
            parts = StepParts(
                setup.model, setup.forward, setup.optimizer, self.config.train, self.device,
                self.options, setup.averager, setup.batching.accumulation,
            )  # fmt: skip
            train_step = build_step(setup.path, parts, batches)
            try:
                yield train_step
            finally:
                train_step.close()
                turn_stats = getattr(batches, "turn_stats", None)  # a resident corpus's
                self._chunk_turns = turn_stats() if turn_stats is not None else None

    def evaluate(self) -> float:
        """Mean validation loss over the resident validation set (one blocking read); kept as
        ``last_val`` for the next checkpoint's record."""
        model, val_batches = self.setup.model, self.setup.val_batches
        model.eval()
        total = torch.zeros((), device=self.device.torch)
        rows = 0
        # In pieces: the captured step's memory pool keeps its activations while this runs
        # outside it, so a whole micro-batch's logits (64 x 1024 x 50304) may not fit beside.
        piece = max(1, EVAL_PIECE_TOKENS // self.config.model.max_len)
        with torch.no_grad(), self.device.autocast():
            for batch in val_batches:  # (B, T+1)
                for part in batch.split(piece):  # (b, T+1): each part's mean, weighted by b
                    total += model(part[:, :-1], part[:, 1:]) * part.shape[0]
                rows += batch.shape[0]
        model.train()
        self.last_val = read_now(total)[0] / rows
        return self.last_val

    def gather_state(self) -> None:
        """Make this rank's optimizer state whole where the update is split over the ranks
        (before a checkpoint). Collective: every rank calls it at the same step."""
        self.setup.optimizer.gather_state()

    @cached_property
    def _tokenizer_sha256(self) -> str | None:
        """The digest of the run's tokenizer.json, which no step changes: read once, at the
        first checkpoint, for every checkpoint's record."""
        return tokenizer_digest(self.run_dir / TOKENIZER_FILE)

    def save(
        self, checkpointer: ckpt.Checkpointer, step: int, names: tuple[str, ...] | None = None,
        interval: IntervalPart | None = None,
    ) -> None:  # fmt: skip
        """Checkpoint the state after ``step`` (its files are written while training goes on,
        unless ``checkpointer`` writes in the foreground); ``interval``: the logging interval
        ``step`` falls inside, so far."""
        tc, setup = self.config.train, self.setup
        data = {
            "path": str(setup.path), "seed": tc.seed, "next_step": step,
            **record_fields(setup.val_set, setup.val_since, setup.data.train_tokens,
                            self._tokenizer_sha256),
        }  # fmt: skip
        state = ckpt.RunState.now(
            self.device,
            {**data, **self._batches.position(step)},
            setup.tokens_seen + (step - setup.start_step) * self.tokens_per_step,
            self.last_val,
            interval.as_record() if interval is not None else None,
            asdict(self.config.model),
        )
        checkpointer.save(step, setup.model, setup.optimizer, state.as_record(), names)

    def mfu(self, tokens_per_s: float | None) -> float | None:
        """The job's ``tokens_per_s`` as a fraction of its GPUs' bf16 peak."""
        if not tokens_per_s or not self._peak_flops:
            return None
        return tokens_per_s * self._flops_per_token / (self._peak_flops * self.ranks.world_size)


def run_steps(
    train_step: TrainStep, first: int, stop: int, after_step: Callable[[int], None] | None = None
) -> None:
    """Steps ``first`` to ``stop`` as ``Trainer.run`` runs them, less its records, evaluations
    and checkpoints: each step, the readback a logging step makes where one ends an
    interval, then ``after_step(step)``. What the benches and ``profile`` measure."""
    when = Cadence(train_step.config)
    for step in range(first, stop):
        train_step(step)
        if when.logs(step + 1):
            train_step.readback(step + 1)
        if after_step is not None:
            after_step(step)


class _StopFlag:
    """Turns the first Ctrl-C (SIGINT) or SIGTERM (what schedulers and ``kill`` send) into a
    request to stop at the next step boundary, with a checkpoint."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False

    @contextmanager
    def installed(self, job: bool = False) -> Iterator[None]:
        """The handler for the block. In a ``job`` (a rank of several), a failure leaves
        SIGTERM ignored rather than put back: a rank that finds another gone inside the step
        (DDP's all-reduce) unwinds to where it says so, and torchrun's SIGTERM, sent to every
        rank once one is gone, would otherwise end it on the way."""

        def handler(signum: int, frame: object) -> None:
            if self.requested:  # a second signal: stop now, without a checkpoint
                raise KeyboardInterrupt
            self.requested = True

        with handling(self.SIGNALS, handler):
            try:
                yield
            except BaseException:
                if job:
                    ignore_sigterm()
                raise


class _Quiet:
    """The display of a rank other than 0: rank 0 shows the job."""

    def note(self, text: str) -> None:
        pass

    def step(self, step: int) -> None:
        pass
