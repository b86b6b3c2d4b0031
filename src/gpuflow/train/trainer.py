"""The pretraining loop: sample, forward, backward, clip, step; log, evaluate, checkpoint.

The steady-state step queues device work only. Batches come by the run's data path
(``gpuflow.train.datapath``): by default the corpus is resident on the device and, on CUDA,
the whole step is one CUDA graph replay (``gpuflow.train.capture``); streamed, token ids
cross as uint16 through a ``DeviceLoader``. Scalars come back through ``AsyncScalars``.
Ctrl-C is honoured at the next step boundary with a checkpoint, so an interrupted run
resumes exactly.

The last step of each logging interval runs under a ``TransferLedger`` (and is left out of
tokens/s, the ledger slowing it): its host->device and device->host bytes, host syncs and
cudaMalloc calls go into metrics.jsonl and the progress display, the interval's scalar
readback spread over the interval's steps.
"""

from __future__ import annotations

import math
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuflow.accounting.ledger import StepTotals, TransferLedger
from gpuflow.baselines.naive import naive_gradients
from gpuflow.common.console import err_console
from gpuflow.common.errors import GpuflowError
from gpuflow.data.batches import WindowSampler, validation_windows
from gpuflow.data.prepare import PrepareConfig, prepare
from gpuflow.data.tokens import TokenFolder
from gpuflow.device.accelerator import Device, out_of_memory_figures
from gpuflow.model.gpt import GPT, flops_per_token
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.capture import WARMUP_STEPS, CapturedStep, lr_tensor
from gpuflow.train.config import RunConfig
from gpuflow.train.datapath import Batches, open_batches, resolve_data_path
from gpuflow.train.display import TrainDisplay
from gpuflow.train.master_adamw import MasterAdamW, with_fp32_masters
from gpuflow.train.optim import build_optimizer, global_grad_norm, lr_at
from gpuflow.train.run import TOKENIZER_FILE, MetricsLog, RunFolder, truncate_metrics
from gpuflow.transfer.loader import upload_tokens
from gpuflow.transfer.mirror import AsyncScalars, read_now

# At seed-d384's size the step is made of small kernels: inductor launches independent ones
# (the weights' bf16 casts, say) as one, +2.7% tokens/s (benchmarks/NOTES.md, where tuning
# inductor's kernels is left out: +1% for 95 s more of compiling).
COMPILE_OPTIONS = {"combo_kernels": True}
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
    tokens_per_s: float | None  # median over logging intervals
    mfu: float | None


def open_training_data(config: RunConfig) -> TokenFolder:
    """The run's token folder; the built-in corpus is prepared on first use."""
    folder = config.data.resolved_dir(config.model.vocab_size)
    if not config.data.dir and not folder.exists():
        err_console.print(f"preparing the built-in corpus into {folder} (once)")
        prepare(PrepareConfig(out=str(folder), vocab_size=config.model.vocab_size))
    return TokenFolder.open(folder)


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

        try:
            previous = {sig: signal.signal(sig, handler) for sig in self.SIGNALS}
        except ValueError:  # not the main thread: leave signals alone
            yield
            return
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


@dataclass
class _Interval:
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


class _Throughput:
    """Tokens/s per logging interval, timed by device events, evaluation, checkpoints and the
    ledger's sampled step left out.

    A host clock would time the host's queueing: with a captured step the host runs up to
    two intervals ahead of the device, and an interval's clock reading could be many times
    the device's rate. Events recorded on the device's stream at the interval's ends are
    read once its scalars have landed, which is after the device has passed them.
    """

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

    def close_interval(self) -> _Interval:
        interval = _Interval(self._steps, self._start, self._now(), self._pauses)
        self._start, self._steps, self._pauses = interval.end, 0, []
        return interval

    def rate(self, interval: _Interval) -> float | None:
        """The interval's tokens/s, once the device has passed its end (None: no timed step
        in it, its only step the ledger's)."""
        if not interval.steps:
            return None
        rate = interval.steps * self.tokens_per_step / interval.seconds()
        self.rates.append(rate)
        return rate

    @contextmanager
    def paused(self) -> Iterator[None]:
        begin = self._now()
        try:
            yield
        finally:
            self._pauses.append((begin, self._now()))

    def steady_median(self) -> float | None:
        steady = self.rates[1:] or self.rates  # the first interval pays for warm-up
        return statistics.median(steady) if steady else None


def _bus_fields(totals: StepTotals) -> dict[str, float]:
    """What one sampled step moved, waited for and allocated (metrics.jsonl fields)."""
    return {
        "h2d_bytes_per_step": float(totals.h2d_bytes),
        "d2h_bytes_per_step": float(totals.d2h_bytes),
        "syncs_per_step": float(totals.syncs),
        "device_allocs_per_step": float(totals.device_allocs),
    }


class Trainer:
    """One run: builds the model, restores its checkpoint, trains, logs and saves."""

    SCALARS = ("loss", "grad_norm")

    def __init__(self, config: RunConfig, run_dir: Path, device: Device) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.device = device
        self.tokens_per_step = config.train.batch_size * config.model.max_len
        self._flops_per_token = flops_per_token(config.model)
        self._peak_flops = device.peak_bf16_flops()

    # ---- setup ------------------------------------------------------------------------------

    def build(self, resume: bool, say: Callable[[str], None] = err_console.print) -> Path | None:
        """Model, optimizer and data, and the checkpoint restored if resuming (returns its
        path). Reads, never writes: everything that can refuse a run does so here, before its
        folder changes."""
        cfg, device = self.config, self.device
        self.mode, self.mode_note = resolve_data_path(cfg.train.data_path, device)
        self._last_val: float | None = None  # the latest validation loss, for checkpoints
        data = open_training_data(cfg)
        self.data = data
        data.check_vocab(cfg.model.vocab_size, splits=("val",))  # train: as it is read
        # The validation set is read now (a split too short for one window is refused) and
        # uploaded once; it stays on the device.
        self.val_batches = [
            upload_tokens(w, device)
            for w in validation_windows(
                data.val, cfg.train.batch_size, cfg.model.max_len, cfg.train.eval_batches
            )
        ]
        device.configure_for_training()
        torch.manual_seed(cfg.train.seed)
        self.model = GPT(cfg.model).to(device.torch)
        # The training step's forward (and so its backward); evaluation stays eager.
        self.forward = self.model
        if cfg.train.compile and device.type == "cuda":
            # A fresh compile per model: compiled code cached for an earlier model in this
            # process was seen to run it eagerly instead (the benchmark builds several).
            torch._dynamo.reset()
            self.forward = torch.compile(self.model, options=COMPILE_OPTIONS)
        self.optimizer = build_optimizer(self.model, cfg.train, device)
        self._no_clip = torch.zeros((), device=device.torch)  # the grad norm without clipping
        self.start_step = 0
        self.best_val = math.inf
        checkpoint = None
        if resume:
            self._check_same_data(say)
            checkpoint = ckpt.resumable_checkpoint(self.run_dir, say)
            if checkpoint is None:
                say(f"{self.run_dir} has no checkpoint yet: training it from step 0")
            else:
                self.start_step = self._restore(checkpoint)
        if self.start_step >= cfg.train.steps:
            raise GpuflowError(
                f"{self.run_dir} already finished {self.start_step} of {cfg.train.steps} steps; "
                f"pass --steps N with N > {self.start_step} to train further"
            )
        self._warn_about_repeats(say)
        return checkpoint.path if checkpoint is not None else None

    @cached_property
    def sampler(self) -> WindowSampler:
        """Batches drawn on the host (the naive, standard and streamed paths): built on first
        use, after every train shard's ids are checked (a resident corpus checks its own)."""
        cfg = self.config
        self.data.check_vocab(cfg.model.vocab_size, splits=("train",))
        return WindowSampler(
            self.data.train, cfg.train.batch_size, cfg.model.max_len, cfg.train.seed
        )

    def _restore(self, checkpoint: ckpt.CheckpointData) -> int:
        ckpt.apply_checkpoint(checkpoint, self.model, self.optimizer)
        record = checkpoint.record
        torch.set_rng_state(ckpt.decode_byte_tensor(record["rng"]["torch"]))
        if record["rng"].get("device") and self.device.rng_state() is not None:
            self.device.set_rng_state(ckpt.decode_byte_tensor(record["rng"]["device"]))
        best = ckpt.best_checkpoint(self.run_dir)
        if best is not None:
            with suppress(GpuflowError):  # a damaged best only loses its record
                self.best_val = float(ckpt.read_record(best).get("val_loss", math.inf))
        return checkpoint.step

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

    def token_batches(self) -> Iterator[np.ndarray]:
        """The run's batches from its current step on: (B, T+1) uint16 windows."""
        for step in range(self.start_step, self.config.train.steps):
            yield self.sampler.batch(step)

    @property
    def resident_budget(self) -> int | None:
        mb = self.config.data.device_budget_mb
        return int(mb * 1e6) if mb > 0 else None

    def train_step(
        self, step: int, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on (B, T) int64 ``inputs`` and ``targets`` on the device;
        queues device work only and returns (loss, grad norm), still on the device."""
        self._set_lr(step)
        with self.device.autocast():
            loss = self.forward(inputs, targets)
        return self._backward_and_update(loss)

    def _set_lr(self, step: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.config.train)

    def train_step_on_tokens(
        self, step: int, batch: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``train_step`` on a (B, T+1) batch of token ids (any integer type) on the device."""
        tokens = batch.long()  # widened on the device, never on the bus
        return self.train_step(step, tokens[:, :-1], tokens[:, 1:])

    def _backward_and_update(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss.backward()
        return loss, self._update()

    def _update(self) -> torch.Tensor:
        """Clip, step and clear the gradients; returns the grad norm (on the device)."""
        tc = self.config.train
        if tc.grad_clip > 0 and self.optimizer.defaults.get("fused"):
            # Fused AdamW divides each gradient by ``grad_scale`` as it reads it, so the clip
            # costs no pass over the gradients of its own (clip_grad_norm_'s factor,
            # max_norm / (norm + 1e-6) capped at 1, inverted).
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = global_grad_norm(grads)
            self.optimizer.grad_scale = ((grad_norm + 1e-6) / tc.grad_clip).clamp(min=1.0)
        elif tc.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        else:
            grad_norm = self._no_clip
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def stepper(
        self,
        mode: str,
        batches: Batches,
        scalars: AsyncScalars,
        draw: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> Callable[[int], None]:
        """A function that runs training step ``step`` of ``mode`` (device work only; the
        loss of eager steps is kept in ``last_loss``). ``draw`` replaces the batches with
        fixed (inputs, targets): the benchmark's pre-placed synthetic batch."""
        self.last_loss: torch.Tensor | None = None
        if mode == "naive":

            def naive(step: int) -> None:
                self._set_lr(step)
                self.last_loss = naive_gradients(self, batches.host_tokens(step))
                scalars.add(loss=self.last_loss, grad_norm=self._update())

            return naive
        if mode != "resident-graph":

            def eager(step: int) -> None:
                inputs, targets = draw() if draw else batches.inputs(step)
                self.last_loss, grad_norm = self.train_step(step, inputs, targets)
                scalars.add(loss=self.last_loss, grad_norm=grad_norm)

            return eager

        # bf16 weights with fp32 masters, all updated by one kernel: autocast has no weights
        # to cast, and the gradients it writes are half the bytes.
        self.optimizer = with_fp32_masters(self.optimizer, self.device)
        # The optimizer reads the learning rate from a device tensor the step itself writes,
        # from a device step counter: the resident corpus's, or one of its own.
        self._lr = torch.zeros((), device=self.device.torch)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr
            group["capturable"] = True  # fused AdamW keeps its step counts on the device
        tokens = getattr(batches, "tokens", None)
        counter = torch.full((), self.start_step, dtype=torch.int64, device=self.device.torch)
        sample = tokens.sample if tokens is not None else None
        schedule = lambda step: lr_tensor(step, self.config.train)  # noqa: E731
        if self.forward is not self.model:
            # Compiled, the draw's dozen small kernels (hash, gather, widen) fuse into a few,
            # and the schedule's ten into one.
            if sample is not None:
                sample = torch.compile(sample, options=COMPILE_OPTIONS)
            schedule = torch.compile(schedule, options=COMPILE_OPTIONS)

        def body() -> None:
            step_now = tokens.step if draw is None else counter
            self._lr.copy_(schedule(step_now))
            inputs, targets = sample() if draw is None else draw()
            if draw is not None:
                counter.add_(1)
            with self.device.autocast(cache=False):
                loss = self.forward(inputs, targets)
            loss, grad_norm = self._backward_and_update(loss)
            scalars.accumulate(loss=loss, grad_norm=grad_norm)

        graph = CapturedStep(body)

        def captured(step: int) -> None:
            """The first few steps eagerly on a side stream, then one capture, then replays."""
            if tokens is not None and draw is None:
                tokens.advance(step)  # a chunk switch happens here, outside the graph
            if step - self.start_step < WARMUP_STEPS:
                graph.warm_up(1)
            else:
                if graph.graph is None:
                    graph.capture()
                    if isinstance(self.optimizer, MasterAdamW):
                        self.optimizer.bind_captured_gradients()
                graph.replay()
            scalars.count()

        return captured

    def log_readback(
        self, batches: Batches, scalars: AsyncScalars, step: int
    ) -> list[tuple[int, dict[str, float]]]:
        """What a logging step reads back: the scalars' flush (no wait), and for the paths
        that do it, the loss read at once, as a standard loop prints it."""
        if batches.reads_loss_each_log and self.last_loss is not None:
            read_now(self.last_loss)
        return scalars.flush(step)

    def _evaluate(self) -> float:
        """Mean validation loss over the resident validation set (one blocking read)."""
        self.model.eval()
        total = torch.zeros((), device=self.device.torch)
        with torch.no_grad(), self.device.autocast():
            for batch in self.val_batches:
                total += self.model(batch[:, :-1], batch[:, 1:])
        self.model.train()
        return read_now(total)[0] / len(self.val_batches)

    def save(
        self, checkpointer: ckpt.Checkpointer, step: int, names: tuple[str, ...] | None = None
    ) -> None:
        """Checkpoint the state after ``step`` (its files are written while training goes on,
        unless ``checkpointer`` writes in the foreground)."""
        tc = self.config.train
        device_rng = self.device.rng_state()
        state = {
            "rng": {
                "torch": ckpt.encode_tensor(torch.get_rng_state()),
                "device": ckpt.encode_tensor(device_rng) if device_rng is not None else None,
            },
            # Every data path draws step s's batch from (seed, s): the step is the position.
            "data": {"path": self.mode, "seed": tc.seed, "next_step": step},
            "tokens_seen": step * self.tokens_per_step,
            "val_loss": self._last_val,
        }
        checkpointer.save(step, self.model, self.optimizer, state, names)

    def mfu(self, tokens_per_s: float | None) -> float | None:
        if not tokens_per_s or not self._peak_flops:
            return None
        return tokens_per_s * self._flops_per_token / self._peak_flops

    # ---- the loop ---------------------------------------------------------------------------

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
        say = err_console.print
        tc = self.config.train
        with RunFolder(self.run_dir, resume, say) as folder:
            latest = self.build(resume, say)
            with open_batches(self.mode, self, self.start_step, tc.steps) as batches:
                folder.start(self.config, self.data.tokenizer_path)
                # Records past the checkpoint are trained again; with none, the baseline too.
                if truncate_metrics(self.run_dir, self.start_step if latest else -1):
                    say("dropped the torn last line of metrics.jsonl (the run was stopped while "
                        "writing it)")  # fmt: skip
                checkpointer = ckpt.Checkpointer(self.run_dir, self.device, tc.keep_checkpoints)
                try:
                    step, rates = self._loop(batches, checkpointer, latest, started, show_bus)
                except KeyboardInterrupt:
                    raise  # a second signal: now; a write in flight is cleared at the next start
                except BaseException:
                    with suppress(Exception):  # finish the write in flight; report the first error
                        checkpointer.close()
                    raise
                checkpointer.close()  # the last checkpoint is on disk before the run reports
        if step < tc.steps:
            say(
                f"interrupted: saved {checkpointer.written[-1]}; continue with "
                f"`gpuflow train --name {self.run_dir.name} --resume`"
            )
        median_rate = rates.steady_median()
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
        )

    def _loop(
        self,
        batches: Batches,
        checkpointer: ckpt.Checkpointer,
        latest: Path | None,
        started: float,
        show_bus: bool,
    ) -> tuple[int, _Throughput]:
        """Steps from ``start_step`` until the end or a stop request; returns the step reached
        and the interval rates."""
        tc = self.config.train
        device, mode, why = self.device, self.mode, self.mode_note
        scalars = AsyncScalars(self.SCALARS, device)
        throughput = _Throughput(self.tokens_per_step, device)
        # Per logging step, its lr and timing, held until its scalars land on the host.
        pending: dict[int, dict[str, Any]] = {}
        stop = _StopFlag()
        step = self.start_step

        with (
            TrainDisplay(tc.steps, self.start_step, show_bus) as display,
            MetricsLog(self.run_dir) as metrics,
            stop.installed(),
        ):

            def emit(record: dict[str, Any]) -> None:
                metrics.write(record)
                display.record(record)

            def publish(results: list[tuple[int, dict[str, float]]]) -> None:
                for tag, means in results:
                    fields = pending.pop(tag)
                    rate = throughput.rate(fields.pop("interval"))  # its scalars landed
                    emit(
                        {
                            "step": tag,
                            **means,
                            **fields,
                            "tokens_per_s": rate,
                            "mfu": self.mfu(rate),
                        }
                    )
                    if not math.isfinite(means["loss"]):
                        self._diverged(tag, means["loss"], checkpointer)

            def evaluate(step: int) -> float:
                self._last_val = self._evaluate()
                emit({"step": step, "val_loss": self._last_val})
                return self._last_val

            display.note(f"data path: {mode}" + (f" ({why})" if why else ""))
            if latest is not None:
                display.note(f"resumed {self.run_dir} at step {step} from {latest.name}")
            else:  # the untrained baseline, so the curve shows what was learnt
                evaluate(step)
            throughput.restart()  # time training, not setup

            step_fn = self.stepper(mode, batches, scalars)
            # Steps that compile or capture are warm-up, not what a step costs: none of them
            # is sampled (and compiling under the ledger's dispatch mode is best avoided).
            warm = self.start_step
            if mode == "resident-graph" or self.forward is not self.model:
                warm += WARMUP_STEPS + 1
            bus: dict[str, float] = {}  # the interval's sampled step, per _bus_fields
            while step < tc.steps:
                # The last step of each interval runs under the ledger, untimed (it is slower).
                sampled = tc.log_interval > 1 and (step + 1) % tc.log_interval == 0
                sampled = sampled and step >= warm
                with (
                    throughput.paused() if sampled else nullcontext(),
                    TransferLedger(device) if sampled else nullcontext() as ledger,
                ):
                    step_fn(step)
                if sampled:
                    bus = _bus_fields(ledger.summary().totals)
                else:
                    throughput.step()
                step += 1
                is_last = step == tc.steps
                stopping = stop.requested  # read once: a signal may land mid-iteration
                # A checkpoint also closes a logging interval: metrics are whole up to it.
                checkpoint_now = step % tc.checkpoint_interval == 0 or is_last or stopping
                if step % tc.log_interval == 0 or checkpoint_now:
                    interval = throughput.close_interval()
                    # The logging step's readback is paid once per interval: spread over it.
                    with TransferLedger(device) if bus else nullcontext() as flush_ledger:
                        results = self.log_readback(batches, scalars, step)
                    if bus:
                        flushed = flush_ledger.summary().totals
                        bus["d2h_bytes_per_step"] += flushed.d2h_bytes / tc.log_interval
                        bus["syncs_per_step"] += flushed.syncs / tc.log_interval
                    pending[step] = {
                        "lr": lr_at(step - 1, tc),
                        "interval": interval,  # timed when its scalars land
                        "elapsed_s": time.perf_counter() - started,
                        **bus,
                        **device.memory_sample(),  # host reads only: the soak's record
                    }
                    bus = {}
                    publish(results)
                    display.step(step)
                evaluate_now = step % tc.eval_interval == 0 or is_last
                with throughput.paused() if evaluate_now or checkpoint_now else nullcontext():
                    names = []
                    if checkpoint_now:
                        publish(scalars.drain(step))  # and a diverged run stops before saving
                        names.append(ckpt.step_name(step))
                    if evaluate_now and evaluate(step) < self.best_val:
                        self.best_val = self._last_val
                        names.append(ckpt.BEST)
                    if names:
                        self.save(checkpointer, step, tuple(names))
                if stopping:
                    break
        return step, throughput

    def _diverged(self, step: int, loss: float, checkpointer: ckpt.Checkpointer) -> None:
        """Stop a run whose loss is no longer a number, before it saves such weights."""
        checkpointer.wait()
        last = checkpointer.written[-1].name if checkpointer.written else None
        where = f"its last good checkpoint is {last}" if last else "it has no checkpoint"
        raise GpuflowError(
            f"training diverged: the loss is {loss} at step {step} ({where}); lower train.lr "
            f"(now {self.config.train.lr:g}) or raise train.warmup_steps and train again"
        )
