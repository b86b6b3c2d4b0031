"""Handwritten digits, resident on the device: scikit-learn's 8x8 digits through
``ResidentDataset`` and ``ResidentLoader``.

    python examples/digits.py [--device cpu|cuda] [--epochs 12] [--seed 0]

The 1,797 scans bundled with scikit-learn (pixels 0-16, no download) are split once into
1,437 for training and 360 held out. Both splits go to the device once, as uint8 pixels and
uint8 labels; after that a step moves nothing across the bus. Each epoch's order is drawn on
the device from (seed, epoch), and each training image is moved by up to one pixel and
normalized there, the same way on every run. A small CNN trains under bf16 autocast where
the device has it; the steps after the first run under ``gpuflow.budget(h2d_bytes=0,
syncs=0)``, so a step that copies from the host or waits for the device raises, naming the
line. The loss is summed on the device and read back once an epoch.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gpuflow
from gpuflow.data.resident.augment import Compose, Normalize, Translate

TEST_SAMPLES = 360
MEAN, STD, SCALE = 4.9, 6.0, 1.0  # the pixels' mean and spread (0-16 levels)


@dataclass(frozen=True)
class Result:
    test_accuracy: float
    losses: list[float]  # the mean training loss of each epoch
    h2d_bytes_per_step: float  # in the budgeted steps, by the ledger
    syncs_per_step: float
    stored: tuple[str, str]  # how the dataset keeps images and labels on the device


def digits() -> tuple[np.ndarray, np.ndarray]:
    """(1797, 1, 8, 8) uint8 pixels 0-16 and (1797,) int64 labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images.astype(np.uint8)[:, None], bunch.target.astype(np.int64)


def net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (64, 4, 4)
        nn.Flatten(), nn.Linear(64 * 16, 10),
    )  # fmt: skip


def train(device: str = "auto", epochs: int = 12, seed: int = 0) -> Result:
    dev = gpuflow.Device.resolve(device)
    torch.manual_seed(seed)
    images, labels = digits()
    split = np.random.default_rng(0).permutation(len(labels))  # one fixed split
    test, train_rows = split[:TEST_SAMPLES], split[TEST_SAMPLES:]
    train_set = gpuflow.ResidentDataset(images[train_rows], labels[train_rows], device=dev)
    test_set = gpuflow.ResidentDataset(images[test], labels[test], device=dev)
    normalize = Normalize([MEAN], [STD], scale=SCALE)
    batches = gpuflow.ResidentLoader(
        train_set, batch_size=64, seed=seed, transform=Compose(Translate(1), normalize)
    )
    model = net().to(dev.torch)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    autocast = dev.autocast() if dev.supports_bf16_autocast else nullcontext()
    losses, steady, counted = [], [], gpuflow.TransferLedger(dev)
    with counted:
        for epoch in range(epochs):
            total = torch.zeros((), device=dev.torch)
            epoch_batches = iter(batches)  # each iter() is the next epoch
            for step in range(len(batches)):
                warm = epoch > 0 or step > 0  # the first step allocates Adam's state
                with gpuflow.budget(h2d_bytes=0, syncs=0) if warm else nullcontext():
                    x, y = next(epoch_batches)  # drawn and augmented on the device
                    with autocast:
                        loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    total += loss.detach()
                totals = counted.step()
                if warm:
                    steady.append(totals)
            losses.append(float(total) / len(batches))  # one read an epoch
            counted.step()  # that read, outside the steps
    model.eval()
    correct = 0
    with torch.no_grad(), autocast:
        for x, y in gpuflow.ResidentLoader(test_set, batch_size=120, shuffle=False):
            logits = model(normalize(x, y))
            correct += int((logits.argmax(1) == y).sum())
    return Result(
        test_accuracy=correct / len(test_set),
        losses=losses,
        h2d_bytes_per_step=sum(s.h2d_bytes for s in steady) / max(1, len(steady)),
        syncs_per_step=sum(s.syncs for s in steady) / max(1, len(steady)),
        stored=tuple(str(f.stored).removeprefix("torch.") for f in train_set.fields),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = train(args.device, args.epochs, args.seed)
    print(f"stored on the device as {result.stored[0]} images, {result.stored[1]} labels")
    print("training loss by epoch:", " ".join(f"{v:.3f}" for v in result.losses[::5]))
    print(
        f"per budgeted step: {result.h2d_bytes_per_step:g} bytes to the device, "
        f"{result.syncs_per_step:g} host syncs"
    )
    print(f"test accuracy on {TEST_SAMPLES} held-out digits: {result.test_accuracy:.3f}")


if __name__ == "__main__":
    main()
