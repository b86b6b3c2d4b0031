"""The pretraining loop: sample, forward, backward, clip, step; log, evaluate, checkpoint.

The steady-state step queues device work only: token ids cross as uint16, scalars come back
through ``AsyncScalars``, and the learning rate is set before the step is queued. Ctrl-C is
honoured at the next step boundary with a checkpoint, so an interrupted run resumes exactly.
"""

from __future__ import annotations

import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuflow.console import err_console
from gpuflow.data.batches import WindowSampler, validation_windows
from gpuflow.data.prepare import PrepareConfig, prepare
from gpuflow.data.tokens import TokenFolder
from gpuflow.device import Device
from gpuflow.errors import GpuflowError
from gpuflow.loader import upload_tokens
from gpuflow.mirror import AsyncScalars, read_now
from gpuflow.model import GPT, flops_per_token
from gpuflow.train import checkpoint as ckpt
from gpuflow.train.config import RunConfig
from gpuflow.train.display import TrainDisplay
from gpuflow.train.optim import build_optimizer, lr_at
from gpuflow.train.run import MetricsLog, copy_tokenizer, truncate_metrics, write_config


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
    data = TokenFolder.open(folder)
    data.check_vocab(config.model.vocab_size)
    return data


class _StopFlag:
    """Turns the first Ctrl-C into a request to stop at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False

    @contextmanager
    def installed(self) -> Iterator[None]:
        def handler(signum: int, frame: object) -> None:
            if self.requested:  # a second Ctrl-C: stop now, without a checkpoint
                raise KeyboardInterrupt
            self.requested = True

        try:
            previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: leave signals alone
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


class Trainer:
    def __init__(self, config: RunConfig, run_dir: Path, device: Device) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.device = device

    def run(self, resume: bool = False) -> TrainResult:
        cfg, device = self.config, self.device
        tc = cfg.train
        started = time.perf_counter()
        data = open_training_data(cfg)

        device.configure_for_training()
        torch.manual_seed(tc.seed)
        model = GPT(cfg.model).to(device.torch)
        optimizer = build_optimizer(model, tc, device)

        start_step = 0
        latest = ckpt.latest_checkpoint(self.run_dir) if resume else None
        if latest is not None:
            record = ckpt.load_checkpoint(latest, model, optimizer)
            start_step = int(record["step"])
            torch.set_rng_state(ckpt.decode_byte_tensor(record["rng"]["torch"]))
            if record["rng"].get("device") and device.rng_state() is not None:
                device.set_rng_state(ckpt.decode_byte_tensor(record["rng"]["device"]))
        if start_step >= tc.steps:
            raise GpuflowError(
                f"{self.run_dir} already finished {start_step} of {tc.steps} steps; "
                f"pass --steps N with N > {start_step} to train further"
            )
        # Only now, with the checkpoint known to fit, does the run folder change.
        write_config(self.run_dir, cfg)
        copy_tokenizer(self.run_dir, data.tokenizer_path)
        truncate_metrics(self.run_dir, start_step)

        sampler = WindowSampler(data.train, tc.batch_size, cfg.model.max_len, tc.seed)
        # The validation set is uploaded once and stays on the device.
        val_batches = [
            upload_tokens(w, device)
            for w in validation_windows(data.val, tc.batch_size, cfg.model.max_len, tc.eval_batches)
        ]
        tokens_per_step = tc.batch_size * cfg.model.max_len
        peak = device.peak_bf16_flops()

        def mfu(tokens_per_s: float | None) -> float | None:
            return (
                tokens_per_s * flops_per_token(cfg.model) / peak if tokens_per_s and peak else None
            )

        def evaluate() -> float:
            model.eval()
            total = torch.zeros((), device=device.torch)
            with torch.no_grad(), device.autocast():
                for batch in val_batches:
                    total += model(batch[:, :-1], batch[:, 1:])
            model.train()
            return read_now(total)[0] / len(val_batches)

        def save(step: int) -> Path:
            state = {
                "rng": {
                    "torch": ckpt.encode_tensor(torch.get_rng_state()),
                    "device": (
                        ckpt.encode_tensor(rs) if (rs := device.rng_state()) is not None else None
                    ),
                },
                "data": {"sampler": "window-v1", "seed": tc.seed, "next_step": step},
                "tokens_seen": step * tokens_per_step,
            }
            return ckpt.save_checkpoint(
                self.run_dir, step, model, optimizer, state, tc.keep_checkpoints
            )

        scalars = AsyncScalars(("loss", "grad_norm"), device)
        metrics = MetricsLog(self.run_dir)
        rates: list[float] = []
        interval_info: dict[int, dict[str, Any]] = {}  # flush tag -> lr and timing
        stop = _StopFlag()
        step = start_step
        no_clip = torch.zeros((), device=device.torch)

        def publish(results: list[tuple[int, dict[str, float]]], display: TrainDisplay) -> None:
            for tag, means in results:
                info = interval_info.pop(tag)
                record = {"step": tag, **means, **info}
                metrics.write(record)
                display.record(record)

        with TrainDisplay(tc.steps, start_step) as display, stop.installed():
            if latest is not None:
                display.note(f"resumed {self.run_dir} at step {start_step} from {latest.name}")
            try:
                if start_step == 0:  # the untrained baseline, so the curve shows what was learnt
                    record = {"step": 0, "val_loss": evaluate()}
                    metrics.write(record)
                    display.record(record)
                clock = time.perf_counter()
                interval_steps = 0
                while step < tc.steps:
                    lr = lr_at(step, tc)
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    tokens = upload_tokens(sampler.batch(step), device)  # (B, T+1) int64
                    with device.autocast():
                        loss = model(tokens[:, :-1], tokens[:, 1:])
                    loss.backward()
                    grad_norm = (
                        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
                        if tc.grad_clip > 0
                        else no_clip
                    )
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    scalars.add(loss=loss, grad_norm=grad_norm)
                    step += 1
                    interval_steps += 1

                    is_last = step == tc.steps
                    checkpoint_now = step % tc.checkpoint_interval == 0 or is_last or stop.requested
                    if step % tc.log_interval == 0 or checkpoint_now:
                        now = time.perf_counter()
                        rate = interval_steps * tokens_per_step / max(now - clock, 1e-9)
                        rates.append(rate)
                        interval_info[step] = {
                            "lr": lr,
                            "tokens_per_s": rate,
                            "mfu": mfu(rate),
                            "elapsed_s": now - started,
                        }
                        publish(scalars.flush(step), display)
                        display.step(step)
                        clock, interval_steps = now, 0
                    paused = time.perf_counter()  # evaluation and checkpoints don't count
                    if step % tc.eval_interval == 0 or is_last:
                        record = {"step": step, "val_loss": evaluate()}
                        metrics.write(record)
                        display.record(record)
                    if checkpoint_now:
                        publish(scalars.drain(step), display)
                        path = save(step)
                        if stop.requested:
                            display.note(
                                f"interrupted: saved {path}; continue with "
                                f"`gpuflow train --name {self.run_dir.name} --resume`"
                            )
                            break
                    clock += time.perf_counter() - paused
            finally:
                metrics.close()

        steady = rates[1:] or rates  # the first interval pays for warm-up
        median_rate = statistics.median(steady) if steady else None
        return TrainResult(
            run_dir=self.run_dir,
            start_step=start_step,
            last_step=step,
            interrupted=stop.requested,
            seconds=time.perf_counter() - started,
            device=device.describe(),
            parameters=model.parameter_count(),
            tokens_per_s=median_rate,
            mfu=mfu(median_rate),
        )
