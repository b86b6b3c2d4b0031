"""Image classification: a small CNN learns the colour of noisy images, fed by a DataLoader.

    python examples/images.py [--device cpu|cuda] [--steps 48] [--seed 0] [--workers 2]

The images are made by a ``torch.utils.data.Dataset``, as a decoding dataset would make
them: (3, 32, 32) uint8, each class a colour of its own under heavy pixel noise and a random
brightness. A ``DataLoader`` with worker processes batches them into
``{"image": uint8, "label": int64}`` dicts, and a ``DeviceLoader`` takes its batches to the
device: the images cross as uint8 and are widened to floats there, the labels as the
DataLoader made them. As with a DataLoader, each ``iter()`` of the loader starts an epoch;
the run goes through as many as its steps need. The forward pass runs under bf16 autocast where the
device has it, the loss and the batch accuracy are summed on the device by ``AsyncScalars``
and read back a flush late, and after the first epoch and a step every step runs under
``gpuflow.budget(syncs=0, device_allocs=0)``, the steps that start later epochs included.
After training, the classifier's weights are read through a ``HostMirror`` and the net is
scored on images it never saw.
"""

from __future__ import annotations

import argparse
import colorsys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

import gpuflow
from gpuflow import LoaderStats, MirrorStats, StepTotals

IMAGE_SHAPE = (3, 32, 32)
TRAIN_SPLIT, TEST_SPLIT = 0, 1


@dataclass(frozen=True)
class Config:
    """The knobs of a run besides its length, seed and workers."""

    classes: int = 10
    train_images: int = 1024
    test_images: int = 512
    batch_size: int = 64
    lr: float = 0.01
    noise: float = 96.0  # standard deviation of the pixel noise, in uint8 levels
    flush_every: int = 8  # steps between read-backs of the loss and accuracy

    def __post_init__(self) -> None:
        if self.classes < 2:
            raise ValueError(f"classes must be >= 2, got {self.classes}")
        if not 0 < self.batch_size <= self.train_images:
            raise ValueError(
                f"batch_size must be in 1..train_images ({self.train_images}), "
                f"got {self.batch_size}"
            )
        if self.test_images < 1:
            raise ValueError(f"test_images must be >= 1, got {self.test_images}")
        if self.lr <= 0 or self.noise < 0:
            raise ValueError("lr must be > 0 and noise >= 0")
        if self.flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {self.flush_every}")

    @property
    def steps_per_epoch(self) -> int:
        return self.train_images // self.batch_size  # the partial last batch is dropped

    @property
    def warmup(self) -> int:
        """Steps before the budget applies: the first epoch and the step that starts the
        second. Until then the caching allocator on a GPU is still growing: Adam's state and
        the activations, then one more block the first time the loader reads a new epoch's
        first batches ahead (seen on an H100); later epochs start without a cudaMalloc."""
        return self.steps_per_epoch + 1


@dataclass(frozen=True)
class Result:
    device: str
    accuracy: float  # on test_images held-out images
    epochs: int  # passes over the training set begun
    losses: list[tuple[int, dict[str, float]]]  # (step, means of "loss" and "accuracy")
    head_weights: np.ndarray  # (classes, 32) the last layer's weights, read from the host
    mirror: MirrorStats  # what reading those weights fetched
    steady_steps: list[StepTotals]  # what the ledger counted in each budgeted step
    loader: LoaderStats
    seconds: float


class NoisyColours(Dataset):
    """Synthetic images whose class is their colour: one hue per class, scaled by a random
    brightness, under Gaussian pixel noise. Image ``i`` depends only on the seed, the split
    and ``i``, so worker processes make the same images as the main process would."""

    def __init__(self, size: int, classes: int, noise: float, seed: int, split: int) -> None:
        self.size, self.classes, self.noise = size, classes, noise
        self.seed, self.split = seed, split
        hues = [colorsys.hsv_to_rgb(k / classes, 0.5, 1.0) for k in range(classes)]
        self.palette = np.array(hues) * 255  # (C, 3)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | int]:
        rng = np.random.default_rng((self.seed, self.split, index))
        label = int(rng.integers(self.classes))
        colour = self.palette[label] * rng.uniform(0.5, 1.0)  # (3,)
        pixels = colour[:, None, None] + rng.normal(0.0, self.noise, IMAGE_SHAPE)  # (3, H, W)
        image = torch.from_numpy(np.clip(pixels, 0, 255).astype(np.uint8))
        return {"image": image, "label": label}  # collated to uint8 (B, 3, H, W), int64 (B,)


def make_loader(
    dataset: Dataset, batch_size: int, workers: int, shuffle_seed: int | None
) -> DataLoader:
    """A plain PyTorch DataLoader, as a user's loop has; ``shuffle_seed`` None keeps order."""
    shuffle = shuffle_seed is not None
    # Shuffled by a sampler with a generator of its own: a DataLoader's ``generator`` is also
    # drawn from for every new pool of workers, so persistent workers would change the order.
    sampler = (
        RandomSampler(dataset, generator=torch.Generator().manual_seed(shuffle_seed))
        if shuffle
        else None
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=shuffle,  # training batches of one shape: the device reuses their memory
        num_workers=workers,
        persistent_workers=workers > 0,  # workers start once, not at every epoch
    )


def make_model(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 16, 16, 16)
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 32, 8, 8)
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),  # (B, 32)
        nn.Linear(32, classes),  # (B, C)
    )  # fmt: skip


def as_inputs(images: torch.Tensor) -> torch.Tensor:
    """uint8 images, already on the device, as centred floats: the widening happens there."""
    return images.float().div_(255).sub_(0.5)  # (B, 3, H, W)


def train_step_no_sync(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    dev: gpuflow.Device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns the loss and the batch accuracy as 0-d device tensors and
    never waits for them."""
    with dev.autocast():  # bf16 on cuda and xpu, a no-op elsewhere
        logits = model(as_inputs(images))  # (B, C)
        loss = F.cross_entropy(logits, labels)  # (), autocast keeps it in fp32
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    accuracy = (logits.argmax(1) == labels).float().mean()  # ()
    return loss.detach(), accuracy


def train(
    device: str | gpuflow.Device = "auto",
    steps: int = 48,
    seed: int = 0,
    workers: int = 2,
    config: Config | None = None,
) -> Result:
    """Classify noisy colours; deterministic for a given seed and device, whatever
    ``workers`` is (0 reads the dataset in this process)."""
    config = config or Config()
    if steps <= config.warmup:
        raise ValueError(f"steps must exceed the {config.warmup} warm-up steps, got {steps}")
    dev = gpuflow.Device.resolve(device)
    train_set = NoisyColours(config.train_images, config.classes, config.noise, seed, TRAIN_SPLIT)
    dataloader = make_loader(train_set, config.batch_size, workers, shuffle_seed=seed)
    torch.manual_seed(seed)
    # Built on the host and moved once, so a seed gives the same weights on every device.
    model = make_model(config.classes).to(dev.torch)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, fused=dev.supports_fused_adamw)
    scalars = gpuflow.AsyncScalars(("loss", "accuracy"), dev)
    head = gpuflow.HostMirror(model[-1].weight)  # fetched when read, not per step
    losses: list[tuple[int, dict[str, float]]] = []
    steady: list[StepTotals] = []
    epochs = 0

    started = time.perf_counter()
    with gpuflow.DeviceLoader(dataloader, dev) as loader:
        for step in range(steps):
            if step % config.steps_per_epoch == 0:
                batches = iter(loader)  # an epoch: the DataLoader shuffles again
                epochs += 1
            # After warm-up, a step that waits for the device or calls cudaMalloc raises.
            guard = (
                gpuflow.budget(syncs=0, device_allocs=0, device=dev)
                if step >= config.warmup
                else nullcontext()
            )
            # ---- the step: device work only; the host never waits ---------------------
            with guard as ledger:
                batch = next(batches)  # {"image": (B, 3, H, W) uint8, "label": (B,) int64}
                loss, accuracy = train_step_no_sync(
                    model, optimizer, batch["image"], batch["label"], dev
                )
                scalars.add(loss=loss, accuracy=accuracy)
                if (step + 1) % config.flush_every == 0:
                    losses += scalars.flush(step + 1)  # earlier flushes whose copies landed
            # ---- logging, host only --------------------------------------------------
            if ledger is not None:
                steady.append(ledger.summary().totals)
        losses += scalars.drain(steps)  # the end of the run: waiting is fine now
    seconds = time.perf_counter() - started

    head_weights = head.numpy().copy()  # the first read: one fetch of the whole tensor
    test_set = NoisyColours(config.test_images, config.classes, config.noise, seed, TEST_SPLIT)
    test_loader = make_loader(test_set, config.batch_size, workers, shuffle_seed=None)
    accuracy = evaluate(model, test_loader, dev)
    return Result(
        str(dev), accuracy, epochs, losses, head_weights, head.stats, steady, loader.stats, seconds
    )


def evaluate(model: nn.Module, dataloader: DataLoader, dev: gpuflow.Device) -> float:
    """The fraction of ``dataloader``'s images classified right: counted on the device, read
    once at the end."""
    correct = torch.zeros((), dtype=torch.int64, device=dev.torch)
    with gpuflow.DeviceLoader(dataloader, dev) as loader, torch.no_grad(), dev.autocast():
        for batch in loader:
            predicted = model(as_inputs(batch["image"])).argmax(1)  # (B,)
            correct += (predicted == batch["label"]).sum()
    return correct.item() / len(dataloader.dataset)


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description="Classify noisy colours with a small CNN.")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, xpu or mps")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    args = parser.parse_args(argv)
    # On a small CPU the DataLoader's workers need the cores that intra-op threads would take.
    torch.set_num_threads(1)

    result = train(args.device, args.steps, args.seed, args.workers)
    print(
        f"images on {result.device}: {args.steps} steps ({result.epochs} epochs, "
        f"num_workers={args.workers}) in {result.seconds:.2f} s"
    )
    for step, means in result.losses:
        print(f"  step {step:5d}  loss {means['loss']:.4f}  accuracy {means['accuracy']:.3f}")
    print(f"held-out accuracy {result.accuracy:.3f}")
    rows, cols = result.head_weights.shape
    print(
        f"classifier weights ({rows}, {cols}) read through a HostMirror: "
        f"{result.mirror.bytes_fetched:,} B fetched, norm {np.linalg.norm(result.head_weights):.3f}"
    )
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
