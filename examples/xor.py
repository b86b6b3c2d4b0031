"""XOR: the smallest problem a net needs a hidden layer for, trained through gpuflow.

    python examples/xor.py [--device cpu|cuda] [--steps 300] [--seed 0]

The truth table lives on the host. Each step one batch of it crosses through a
``DeviceLoader`` (packed into one buffer and copied ahead of use), the loss is summed on the
device by ``AsyncScalars`` and read back every ``flush_every`` steps without the host
waiting, and after a few warm-up steps every step runs under
``gpuflow.budget(syncs=0, device_allocs=0)``: on an accelerator a host sync or a cudaMalloc
in the step raises ``BudgetExceeded`` with the line that did it. (The ledger behind a budget
pays a few microseconds per operation, about doubling a step this small: a long run would
check a few steps, not all of them.)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gpuflow
from gpuflow.accounting.ledger import StepTotals
from gpuflow.transfer.loader import LoaderStats

INPUTS = np.array([[0, 0], [0, 1], [1, 0], [1, 1]], dtype=np.float32)  # (4, 2)
TARGETS = np.array([[0], [1], [1], [0]], dtype=np.float32)  # (4, 1)


@dataclass(frozen=True)
class Config:
    """The knobs of a run besides its length and seed."""

    hidden: int = 8
    lr: float = 0.05
    flush_every: int = 25  # steps between loss read-backs
    warmup: int = 3  # steps before the budget applies: allocator cache and Adam state fill up

    def __post_init__(self) -> None:
        if self.hidden < 2:
            raise ValueError(f"hidden must be >= 2 to separate XOR, got {self.hidden}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.flush_every < 1 or self.warmup < 0:
            raise ValueError("flush_every must be >= 1 and warmup >= 0")


@dataclass(frozen=True)
class Result:
    device: str
    predictions: np.ndarray  # (4,) P(output is 1) for each row of INPUTS
    final_loss: float  # binary cross-entropy of the trained net on the truth table
    losses: list[tuple[int, dict[str, float]]]  # (step, {"loss": mean since the last flush})
    steady_steps: list[StepTotals]  # what the ledger counted in each budgeted step
    loader: LoaderStats
    seconds: float

    @property
    def solved(self) -> bool:
        return bool(np.array_equal(np.round(self.predictions), TARGETS[:, 0]))


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def host_batches(steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The whole truth table as the batch of every step, as CPU tensors."""
    x, y = torch.from_numpy(INPUTS), torch.from_numpy(TARGETS)
    for _ in range(steps):
        yield x, y


def train_step_no_sync(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """One optimizer step; returns the loss as a 0-d device tensor and never waits for it."""
    loss = F.binary_cross_entropy_with_logits(model(x), y)  # (), from logits (4, 1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train(
    device: str | gpuflow.Device = "auto",
    steps: int = 300,
    seed: int = 0,
    config: Config | None = None,
) -> Result:
    """Train an MLP on XOR; deterministic for a given seed and device."""
    config = config or Config()
    if steps <= config.warmup:
        raise ValueError(f"steps must exceed the {config.warmup} warm-up steps, got {steps}")
    dev = gpuflow.Device.resolve(device)
    torch.manual_seed(seed)
    # Built on the host and moved once, so a seed gives the same weights on every device.
    model = make_model(config.hidden).to(dev.torch)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, fused=dev.supports_fused_adamw)
    scalars = gpuflow.AsyncScalars(("loss",), dev)
    losses: list[tuple[int, dict[str, float]]] = []
    steady: list[StepTotals] = []

    started = time.perf_counter()
    with gpuflow.DeviceLoader(host_batches(steps), dev) as loader:
        for step in range(steps):
            # After warm-up, a step that waits for the device or calls cudaMalloc raises.
            guard = (
                gpuflow.budget(syncs=0, device_allocs=0, device=dev)
                if step >= config.warmup
                else nullcontext()
            )
            # ---- the step: device work only; the host never waits ---------------------
            with guard as ledger:
                x, y = next(loader)  # (4, 2), (4, 1) on the device
                loss = train_step_no_sync(model, optimizer, x, y)
                scalars.add(loss=loss)
                if (step + 1) % config.flush_every == 0:
                    losses += scalars.flush(step + 1)  # earlier flushes whose copies landed
            # ---- logging, host only --------------------------------------------------
            if ledger is not None:
                steady.append(ledger.summary().totals)
        losses += scalars.drain(steps)  # the end of the run: waiting is fine now
    seconds = time.perf_counter() - started

    predictions, final_loss = evaluate(model, dev)
    return Result(str(dev), predictions, final_loss, losses, steady, loader.stats, seconds)


def evaluate(model: nn.Module, dev: gpuflow.Device) -> tuple[np.ndarray, float]:
    """Probabilities and loss on the truth table: one batch up, one read back."""
    with gpuflow.DeviceLoader([torch.from_numpy(INPUTS)], dev) as loader, torch.no_grad():
        logits = torch.cat([model(x) for x in loader]).cpu()  # (4, 1), after training
    loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(TARGETS))
    return torch.sigmoid(logits)[:, 0].numpy(), float(loss)


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description="Train a small MLP on XOR through gpuflow.")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, xpu or mps")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # A net this small gains nothing from intra-op threads; on a busy 2-core machine their
    # waiting made a CPU run ten times slower.
    torch.set_num_threads(1)

    result = train(args.device, args.steps, args.seed)
    print(f"xor on {result.device}: {args.steps} steps in {result.seconds:.2f} s")
    for step, means in result.losses:
        print(f"  step {step:5d}  loss {means['loss']:.4f}")
    for (a, b), target, p in zip(INPUTS, TARGETS[:, 0], result.predictions, strict=True):
        print(f"  {a:.0f} xor {b:.0f} = {target:.0f}   net: {p:.3f}")
    print(f"final loss {result.final_loss:.4f}; solved: {'yes' if result.solved else 'no'}")
    print_transfers(result.loader, result.steady_steps)
    return result


def print_transfers(loader: LoaderStats, steady: list[StepTotals]) -> None:
    h2d = sorted({t.h2d_bytes for t in steady})
    print(
        f"loader: {loader.batches} batches, {loader.bytes_moved:,} B moved; "
        f"{len(steady)} budgeted steps: {h2d} B host->device each, "
        f"{max((t.syncs for t in steady), default=0)} syncs, "
        f"{max((t.device_allocs for t in steady), default=0)} cudaMalloc"
    )


if __name__ == "__main__":
    main()
