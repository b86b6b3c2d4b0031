"""Sine regression: an MLP learns y = sin(x) on [-pi, pi] from host data, through gpuflow.

    python examples/sine.py [--device cpu|cuda] [--steps 600] [--seed 0]

The training set is a numpy array on the host, shuffled every epoch there, and its
minibatches cross as ``{"x", "y"}`` dicts through a ``DeviceLoader``, which packs each into
one buffer and copies it while the device works on the one before. The loss is summed on the
device by ``AsyncScalars`` and read back every ``flush_every`` steps, a flush late. After a
few warm-up steps every step runs under ``gpuflow.budget(syncs=0, device_allocs=0)``, which
raises ``BudgetExceeded`` on an accelerator if the step waits for the device or calls
cudaMalloc. The trained net is scored on a grid of points it never saw.
"""

from __future__ import annotations

import argparse
import itertools
import math
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


@dataclass(frozen=True)
class Config:
    """The knobs of a run besides its length and seed."""

    train_points: int = 1024
    batch_size: int = 128
    hidden: int = 64
    lr: float = 3e-3
    flush_every: int = 50  # steps between loss read-backs
    warmup: int = 3  # steps before the budget applies: allocator cache and Adam state fill up
    grid_points: int = 201  # held-out evaluation points, evenly spaced

    def __post_init__(self) -> None:
        if not 0 < self.batch_size <= self.train_points:
            raise ValueError(
                f"batch_size must be in 1..train_points ({self.train_points}), "
                f"got {self.batch_size}"
            )
        if self.hidden < 1 or self.grid_points < 2:
            raise ValueError("hidden must be >= 1 and grid_points >= 2")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.flush_every < 1 or self.warmup < 0:
            raise ValueError("flush_every must be >= 1 and warmup >= 0")


@dataclass(frozen=True)
class Result:
    device: str
    grid: np.ndarray  # (G,) held-out inputs
    predictions: np.ndarray  # (G,) the net's sin(grid)
    final_loss: float  # mean squared error on the grid
    losses: list[tuple[int, dict[str, float]]]  # (step, {"loss": mean since the last flush})
    steady_steps: list[StepTotals]  # what the ledger counted in each budgeted step
    loader: LoaderStats
    seconds: float


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
    )


def host_batches(
    x: np.ndarray, y: np.ndarray, batch_size: int, rng: np.random.Generator
) -> Iterator[dict[str, np.ndarray]]:
    """Shuffled minibatches, epoch after epoch, cut on the host. Each is a fresh array, as a
    DataLoader would yield; a partial last batch is dropped so every batch has one shape."""
    per_epoch = len(x) // batch_size
    while True:
        order = rng.permutation(len(x))
        for i in range(per_epoch):
            take = order[i * batch_size : (i + 1) * batch_size]
            yield {"x": x[take], "y": y[take]}  # (B, 1) each


def train_step_no_sync(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """One optimizer step; returns the loss as a 0-d device tensor and never waits for it."""
    loss = F.mse_loss(model(x), y)  # (), from (B, 1) and (B, 1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train(
    device: str | gpuflow.Device = "auto",
    steps: int = 600,
    seed: int = 0,
    config: Config | None = None,
) -> Result:
    """Fit sin(x) on [-pi, pi]; deterministic for a given seed and device."""
    config = config or Config()
    if steps <= config.warmup:
        raise ValueError(f"steps must exceed the {config.warmup} warm-up steps, got {steps}")
    dev = gpuflow.Device.resolve(device)
    rng = np.random.default_rng(seed)
    x_train = rng.uniform(-math.pi, math.pi, (config.train_points, 1)).astype(np.float32)
    y_train = np.sin(x_train)  # (N, 1)
    torch.manual_seed(seed)
    # Built on the host and moved once, so a seed gives the same weights on every device.
    model = make_model(config.hidden).to(dev.torch)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, fused=dev.supports_fused_adamw)
    scalars = gpuflow.AsyncScalars(("loss",), dev)
    losses: list[tuple[int, dict[str, float]]] = []
    steady: list[StepTotals] = []

    batches = itertools.islice(host_batches(x_train, y_train, config.batch_size, rng), steps)
    started = time.perf_counter()
    with gpuflow.DeviceLoader(batches, dev) as loader:
        for step in range(steps):
            # After warm-up, a step that waits for the device or calls cudaMalloc raises.
            guard = (
                gpuflow.budget(syncs=0, device_allocs=0, device=dev)
                if step >= config.warmup
                else nullcontext()
            )
            # ---- the step: device work only; the host never waits ---------------------
            with guard as ledger:
                batch = next(loader)  # {"x": (B, 1), "y": (B, 1)} on the device
                loss = train_step_no_sync(model, optimizer, batch["x"], batch["y"])
                scalars.add(loss=loss)
                if (step + 1) % config.flush_every == 0:
                    losses += scalars.flush(step + 1)  # earlier flushes whose copies landed
            # ---- logging, host only --------------------------------------------------
            if ledger is not None:
                steady.append(ledger.summary().totals)
        losses += scalars.drain(steps)  # the end of the run: waiting is fine now
    seconds = time.perf_counter() - started

    grid = np.linspace(-math.pi, math.pi, config.grid_points, dtype=np.float32)  # (G,)
    predictions = predict(model, grid, dev)
    final_loss = float(np.mean((predictions - np.sin(grid)) ** 2))
    return Result(str(dev), grid, predictions, final_loss, losses, steady, loader.stats, seconds)


def predict(model: nn.Module, x: np.ndarray, dev: gpuflow.Device) -> np.ndarray:
    """The net's outputs for host inputs ``x`` (G,): one batch up, one read back."""
    with gpuflow.DeviceLoader([x[:, None]], dev) as loader, torch.no_grad():
        out = torch.cat([model(batch) for batch in loader]).cpu()  # (G, 1), after training
    return out[:, 0].numpy()


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description="Fit sin(x) with a small MLP through gpuflow.")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, xpu or mps")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # A net this small gains nothing from intra-op threads; on a busy 2-core machine their
    # waiting made a CPU run ten times slower.
    torch.set_num_threads(1)

    result = train(args.device, args.steps, args.seed)
    print(f"sine on {result.device}: {args.steps} steps in {result.seconds:.2f} s")
    for step, means in result.losses:
        print(f"  step {step:5d}  loss {means['loss']:.6f}")
    for i in np.linspace(0, len(result.grid) - 1, 5).astype(int):
        x, p = result.grid[i], result.predictions[i]
        print(f"  sin({x:+.3f}) = {math.sin(x):+.4f}   net: {p:+.4f}")
    print(f"held-out MSE {result.final_loss:.2e} on {len(result.grid)} points")
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
