"""One training run: setup, restore and save around the loop that drives the step.

The step itself (``gpuflow.train.step``) queues device work only: by default the corpus is
resident on the device and, on CUDA, the whole step is one CUDA graph replay; the data path
(``gpuflow.train.datapath``) says how batches arrive. Scalars come back through
``AsyncScalars`` a few steps late. The loop only decides *when*: log, sample the bus,
evaluate, checkpoint, stop. Ctrl-C is honoured at the next step boundary with a
checkpoint, so an interrupted run resumes exactly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError
from gpuflow.data.batches import validation_windows
from gpuflow.data.prepare import PrepareConfig, prepare
from gpuflow.data.resident import default_budget
from gpuflow.data.sources import BatchSource
from gpuflow.data.tokens import TokenFolder
from gpuflow.device.accelerator import Device, out_of_memory_figures
from gpuflow.device.allocator import check_allocator
from gpuflow.model.gpt import GPT, flops_per_token
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import RunConfig
from gpuflow.train.datapath import resolve_data_path
from gpuflow.train.distributed import (
    Averager,
    GradientAverager,
    Ranks,
    each_host_first,
    least,
)
from gpuflow.train.loop import TrainLoop
from gpuflow.train.optim.adamw import build_optimizer
from gpuflow.train.optim.master_adamw import MasterAdamW
from gpuflow.train.paths import BatchPlan, build_step, open_batches, optimizer_for, row
from gpuflow.train.runfolder import TOKENIZER_FILE, RunFolder, truncate_metrics
from gpuflow.train.sharded import ShardedAverager
from gpuflow.train.step import StepOptions, StepParts, TrainStep, compiled_forward
from gpuflow.transfer.diskread import IoChoice, choose_io
from gpuflow.transfer.loader import upload_tokens
from gpuflow.transfer.mirror import read_now
from gpuflow.transfer.upload import place

# Passes over the training tokens past which a run is told it will mostly memorise them.
MANY_PASSES = 4


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
    # What each rank handed NCCL per step (the gradients' all-reduce): computed from the
    # buffers it reduces, since the transfer ledger cannot see collectives. None: one process.
    collective_bytes_per_step: int | None = None
    data_io: IoChoice | None = None  # how the resident corpus was read; None: no such corpus


def open_training_data(config: RunConfig) -> TokenFolder:
    """The run's token folder; the built-in corpus is prepared on first use."""
    folder = config.data.resolved_dir(config.model.vocab_size)
    if not config.data.dir and not folder.exists():
        err_console.print(f"preparing the built-in corpus into {folder} (once)")
        prepare(PrepareConfig(out=str(folder), vocab_size=config.model.vocab_size))
    return TokenFolder.open(folder)


def _silent(message: str) -> None:
    """What ranks other than 0 say: nothing."""


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
        # Tokens of one step of the whole job: every rank trains on its own batch.
        self.tokens_per_step = (
            config.train.batch_size * config.model.max_len * self.ranks.world_size
        )
        self.averager: Averager | None = None  # chosen with the data path, in build
        self._flops_per_token = flops_per_token(config.model)
        self._peak_flops = device.peak_bf16_flops()

    # ---- setup ------------------------------------------------------------------------------

    def build(self, resume: bool, say: Callable[[str], None] = err_console.print) -> Path | None:
        """The data path, model, optimizer and data, and the checkpoint restored if resuming
        (returns its path). Reads, never writes: everything that can refuse a run does so
        here, before its folder changes."""
        cfg, device, ranks = self.config, self.device, self.ranks
        if not ranks.is_main:
            say = _silent  # rank 0 speaks for the job
        self.path, self.path_note = resolve_data_path(
            cfg.train.data_path, device, cfg.train.allocator
        )
        # Data-parallel: the eager paths leave the gradients to DDP, the others average
        # them in the step (the captured one inside its graph).
        ddp = ranks.distributed and row(self.path).ddp
        if ranks.distributed:
            self.averager = GradientAverager(ranks.world_size, reduce_gradients=not ddp)
        self.last_val: float | None = None  # the latest validation loss, for checkpoints
        with each_host_first(ranks):  # the built-in corpus is prepared once per host
            self.data = open_training_data(cfg)
        # The validation set is read now (a split too short for one window is refused) and
        # uploaded once, by the rank that evaluates (rank 0); it stays on the device. The
        # other ranks read nothing but their slice of the train split.
        self.val_batches = []
        if ranks.is_main:
            self.data.check_vocab(cfg.model.vocab_size, splits=("val",))  # train: as it is read
            windows = validation_windows(
                self.data.val, cfg.train.batch_size, cfg.model.max_len, cfg.train.eval_batches
            )
            self.val_batches = [upload_tokens(w, device) for w in windows]
        managed = cfg.data.placement == "managed"
        mb = cfg.data.device_budget_mb
        budget = int(mb * 1e6) if mb > 0 else None
        if budget is None and ranks.distributed:
            # One budget for every rank (the least free memory), so that they all keep their
            # slice resident or all stream the corpus in the same chunks.
            budget = least(default_budget(device), ranks)
        if managed and device.type != "cuda":
            raise GpuflowError(f"data.placement=managed is CUDA's managed memory, not {device}'s")
        resident = row(self.path).resident
        for setting, asked in (
            ("placement=managed", managed),
            ("io=kvikio", cfg.data.io == "kvikio"),
        ):
            if asked and not resident:
                raise GpuflowError(
                    f"data.{setting} is about the resident corpus; train.data_path "
                    f"{cfg.train.data_path!r} has none: use resident or resident-graph"
                )
        # How the resident corpus is read from disk (kvikio or pinned), and why.
        self.io = choose_io(cfg.data.io, device, managed) if resident else None
        self.plan = BatchPlan(
            self.data, cfg.train.batch_size, cfg.model.max_len, cfg.train.seed,
            cfg.model.vocab_size, budget, ranks.rank, ranks.world_size,
            managed=managed, io=self.io.path if self.io else "pinned",
        )  # fmt: skip
        if device.type == "cuda":
            check_allocator(cfg.train.allocator)  # chosen when torch loaded: refused if not
        device.configure_for_training()
        torch.manual_seed(cfg.train.seed)
        try:
            self.model = place(GPT(cfg.model), device.torch)
        except RuntimeError as exc:  # the host's allocator refusing (a device's is below)
            if "can't allocate memory" not in str(exc):
                raise
            m = cfg.model
            raise GpuflowError(
                f"the model does not fit in host memory (vocab {m.vocab_size:,} x d_model "
                f"{m.d_model} for its token table alone); lower model.vocab_size, "
                "model.d_model or model.n_layer"
            ) from None
        # The training step's forward (and so its backward); evaluation stays eager.
        trained: torch.nn.Module = self.model
        if ddp:
            trained = DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None
            )
        self.forward = (
            compiled_forward(trained, device, self.options) if cfg.train.compile else trained
        )
        adamw = build_optimizer(self.model, cfg.train, device)
        self.start_step = 0
        self.tokens_seen = 0  # by the run's checkpoint: its steps may have run on other ranks
        self.best_val = math.inf
        checkpoint = None
        if resume:
            self._check_same_data(say)
            checkpoint = ckpt.resumable_checkpoint(self.run_dir, say)
            if checkpoint is None:
                say(f"{self.run_dir} has no checkpoint yet: training it from step 0")
            else:
                self.start_step = checkpoint.step
                state = ckpt.RunState.from_record(
                    checkpoint.record, self.start_step * self.tokens_per_step
                )
                ckpt.apply_checkpoint(checkpoint, self.model, adamw)
                state.restore_rng(device)
                self.best_val = ckpt.best_val_loss(self.run_dir)
                self.plan = dataclasses.replace(self.plan, resumed=state.data)
                self.tokens_seen = state.tokens_seen
        if self.start_step >= cfg.train.steps:
            raise GpuflowError(
                f"{self.run_dir} already finished {self.start_step} of {cfg.train.steps} steps; "
                f"pass --steps N with N > {self.start_step} to train further"
            )
        # Chosen once, for the data path: the step never swaps it. The captured step on
        # several ranks splits the update over them (train/sharded.py).
        split = ranks.distributed and not ddp and self.options.fused_clip
        shard = (ranks.rank, ranks.world_size) if split else (0, 1)
        self.optimizer = optimizer_for(self.path, adamw, device, self.options, shard)
        if isinstance(self.optimizer, MasterAdamW) and self.optimizer.world_size > 1:
            self.averager = ShardedAverager(self.optimizer)
        self._warn_about_repeats(say)
        return checkpoint.path if checkpoint is not None else None

    def _check_same_data(self, say: Callable[[str], None]) -> None:
        """A resumed run must read the data it was trained on: same tokenizer."""
        kept = self.run_dir / TOKENIZER_FILE
        current = self.data.tokenizer_path
        if kept.is_file() and current is not None and kept.read_bytes() != current.read_bytes():
            raise GpuflowError(
                f"{current} is not the tokenizer {self.run_dir} was trained with ({kept}); "
                "point data.dir at the run's data, or start a new run"
            )
        if kept.is_file() and current is None:
            say(f"{self.data.path} has no tokenizer.json: cannot check it is the run's data")

    def _warn_about_repeats(self, say: Callable[[str], None]) -> None:
        """Say so when the run will read its training tokens many times over: validation
        loss then rises as the model memorises them (the best checkpoint is kept apart)."""
        tc = self.config.train
        tokens = self.data.train_tokens
        passes = tc.steps * self.tokens_per_step / max(tokens, 1)
        if passes > MANY_PASSES:
            say(
                f"note: {tc.steps:,} steps of {self.tokens_per_step:,} tokens read the "
                f"{tokens:,} training tokens {passes:.0f} times over; validation loss "
                "usually rises after a few passes, so checkpoints/best keeps the best one. "
                "More text (gpuflow prepare --data ...) or fewer --steps avoids it"
            )

    # ---- the pieces of a run ----------------------------------------------------------------

    @contextmanager
    def open_step(
        self, start: int, stop: int, source: BatchSource | None = None
    ) -> Iterator[TrainStep]:
        """The run's step over its data path's batches for steps ``start`` to ``stop`` (or
        over ``source``, which the step then closes); ``build`` first."""
        batches = source or open_batches(self.path, self.plan, self.device, start, stop)
        self._batches = batches  # whose position each checkpoint records
        with batches:
            parts = StepParts(
                self.model, self.forward, self.optimizer, self.config.train, self.device,
                self.options, self.averager,
            )  # fmt: skip
            train_step = build_step(self.path, parts, batches)
            try:
                yield train_step
            finally:
                train_step.close()

    def gather_state(self) -> None:
        """Make this rank's optimizer state whole where the update is split over the ranks
        (before a checkpoint). Collective: every rank calls it at the same step."""
        self.optimizer.gather_state()

    def evaluate(self) -> float:
        """Mean validation loss over the resident validation set (one blocking read); kept as
        ``last_val`` for the next checkpoint's record."""
        self.model.eval()
        total = torch.zeros((), device=self.device.torch)
        with torch.no_grad(), self.device.autocast():
            for batch in self.val_batches:
                total += self.model(batch[:, :-1], batch[:, 1:])
        self.model.train()
        self.last_val = read_now(total)[0] / len(self.val_batches)
        return self.last_val

    def save(
        self, checkpointer: ckpt.Checkpointer, step: int, names: tuple[str, ...] | None = None
    ) -> None:
        """Checkpoint the state after ``step`` (its files are written while training goes on,
        unless ``checkpointer`` writes in the foreground)."""
        tc = self.config.train
        data = {"path": str(self.path), "seed": tc.seed, "next_step": step}
        state = ckpt.RunState.now(
            self.device,
            {**data, **self._batches.position(step)},
            self.tokens_seen + (step - self.start_step) * self.tokens_per_step,
            self.last_val,
        )
        checkpointer.save(step, self.model, self.optimizer, state.as_record(), names)

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
            raise GpuflowError(
                f"out of device memory on {self.device} ({out_of_memory_figures(exc)}); lower "
                f"train.batch_size (now {cfg.train.batch_size}), model.max_len (now "
                f"{cfg.model.max_len}) or the model's size, or cap the resident corpus with "
                "data.device_budget_mb; the run's checkpoints are intact"
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
            with self.open_step(self.start_step, tc.steps) as train_step:
                if folder is not None:
                    folder.start(self.config, self.data.tokenizer_path)
                # Records past the checkpoint are trained again; with none, the baseline too.
                if main and truncate_metrics(self.run_dir, self.start_step if latest else -1):
                    say("dropped the torn last line of metrics.jsonl (the run was stopped while "
                        "writing it)")  # fmt: skip
                checkpointer = ckpt.Checkpointer(self.run_dir, self.device, tc.keep_checkpoints)
                try:
                    loop = TrainLoop(
                        self, train_step, checkpointer, started, show_bus, self.best_val
                    )
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
        return TrainResult(
            run_dir=self.run_dir,
            start_step=self.start_step,
            last_step=step,
            interrupted=step < tc.steps,
            seconds=time.perf_counter() - started,
            device=self.device.describe(),
            parameters=self.model.parameter_count(),
            tokens_per_s=median_rate,
            mfu=self.mfu(median_rate),
            world_size=self.ranks.world_size,
            tokens_per_step=self.tokens_per_step,
            collective_bytes_per_step=self.averager.bytes_per_step if self.averager else None,
            data_io=self.io,
        )
