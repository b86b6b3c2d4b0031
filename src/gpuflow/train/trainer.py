"""One training run: setup, restore and save around the loop that drives the step.

The step itself (``gpuflow.train.step``) queues device work only: by default the corpus is
resident on the device and, on CUDA, the whole step is one CUDA graph replay; the data path
(``gpuflow.train.datapath``) says how batches arrive. Scalars come back through
``AsyncScalars`` a few steps late. The loop only decides *when*: log, sample the bus,
evaluate, checkpoint, stop. Ctrl-C is honoured at the next step boundary with a
checkpoint, so an interrupted run resumes exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError
from gpuflow.data.sources import BatchSource
from gpuflow.device.accelerator import Device, out_of_memory_figures
from gpuflow.model.gpt import flops_per_token
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import RunConfig
from gpuflow.train.distributed import Ranks, each_rank
from gpuflow.train.loop import TrainLoop
from gpuflow.train.meter import IntervalPart
from gpuflow.train.paths import build_step, open_batches
from gpuflow.train.runfolder import RunFolder, truncate_metrics
from gpuflow.train.setup import RunSetup, build_setup
from gpuflow.train.step import StepOptions, StepParts, TrainStep
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


class Trainer:
    """One run: builds the model and its optimizer, restores its checkpoint, opens its step,
    trains, logs and saves. ``options`` vary how the step is built (probes); the defaults
    are what ``gpuflow train`` runs. With ``ranks`` of a data-parallel job
    (``gpuflow.train.distributed``), this process is one rank: it trains on its slice of the
    corpus and only rank 0 writes."""

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

    # ---- setup ------------------------------------------------------------------------------

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

    # ---- the pieces of a run ----------------------------------------------------------------

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

    def gather_state(self) -> None:
        """Make this rank's optimizer state whole where the update is split over the ranks
        (before a checkpoint). Collective: every rank calls it at the same step."""
        self.setup.optimizer.gather_state()

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

    def save(
        self, checkpointer: ckpt.Checkpointer, step: int, names: tuple[str, ...] | None = None,
        interval: IntervalPart | None = None,
    ) -> None:  # fmt: skip
        """Checkpoint the state after ``step`` (its files are written while training goes on,
        unless ``checkpointer`` writes in the foreground); ``interval``: the logging interval
        ``step`` falls inside, so far."""
        tc, setup = self.config.train, self.setup
        data = {"path": str(setup.path), "seed": tc.seed, "next_step": step}
        state = ckpt.RunState.now(
            self.device,
            {**data, **self._batches.position(step)},
            setup.tokens_seen + (step - setup.start_step) * self.tokens_per_step,
            self.last_val,
            interval.as_record() if interval is not None else None,
        )
        checkpointer.save(step, setup.model, setup.optimizer, state.as_record(), names)

    def mfu(self, tokens_per_s: float | None) -> float | None:
        """The job's ``tokens_per_s`` as a fraction of its GPUs' bf16 peak."""
        if not tokens_per_s or not self._peak_flops:
            return None
        return tokens_per_s * self._flops_per_token / (self._peak_flops * self.ranks.world_size)

    # ---- the run ----------------------------------------------------------------------------

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
        main = self.ranks.is_main
        say = err_console.print  # on rank 0 only: build() silences the others itself
        tc = self.config.train
        folder_cm: AbstractContextManager[RunFolder | None] = (
            RunFolder(self.run_dir, resume, say) if main else nullcontext()
        )
        with folder_cm as folder:
            latest = self.build(resume, say)
            with self.open_step(self.setup.start_step, tc.steps) as train_step:
                if folder is not None:
                    folder.start(self.config, self.setup.data.tokenizer_path)
                # Records past the checkpoint are trained again; with none, the baseline too.
                if main and truncate_metrics(self.run_dir, self.setup.start_step if latest else -1):
                    say("dropped the torn last line of metrics.jsonl (the run was stopped while "
                        "writing it)")  # fmt: skip
                checkpointer = ckpt.Checkpointer(self.run_dir, self.device, tc.keep_checkpoints)
                try:
                    loop = TrainLoop(self, train_step, checkpointer, started, show_bus)
                    step = loop.run(latest)
                except KeyboardInterrupt:
                    raise  # a second signal: now; a write in flight is cleared at the next start
                except BaseException:
                    with suppress(Exception):  # finish the write in flight; report the first error
                        checkpointer.close()
                    raise
                checkpointer.close()  # the last checkpoint is on disk before the run reports
        if step < tc.steps and main:
            say(
                f"interrupted: saved {checkpointer.written[-1]}; continue with "
                f"`gpuflow train --name {self.run_dir.name} --resume`"
            )
        median_rate = loop.throughput.steady_median()
        averager = self.setup.averager
        peaks = None
        if self.device.type == "cuda":  # every rank reaches here (collective)
            peaks = each_rank(torch.cuda.max_memory_allocated(self.device.torch), self.ranks)
        return TrainResult(
            run_dir=self.run_dir,
            start_step=self.setup.start_step,
            last_step=step,
            interrupted=step < tc.steps,
            seconds=time.perf_counter() - started,
            device=self.device.describe(),
            parameters=self.setup.model.parameter_count(),
            tokens_per_s=median_rate,
            mfu=self.mfu(median_rate),
            world_size=self.ranks.world_size,
            tokens_per_step=self.tokens_per_step,
            micro_batch=self.setup.batching.micro_batch,
            accumulation=self.setup.batching.accumulation,
            collective_bytes_per_step=averager.bytes_per_step if averager else None,
            exchange=getattr(averager, "exchange", None),
            data_io=self.setup.io,
            chunk_turns=self._chunk_turns,
            peak_device_bytes=peaks,
        )
