"""What the loader benches' training loops train on: synthetic images and a small CNN, token
batches cut from a token array and a small language model, and one step of each loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch

from gpuflow.bench.loop_timing import timed_steps
from gpuflow.device.accelerator import Device

# ---- the image loop's model and data -------------------------------------------------------------


class SyntheticImages(torch.utils.data.Dataset):
    """uint8 (3, side, side) images drawn from a fixed bank, with int64 labels: the
    decode-free end of an image pipeline, so the loop measures the movement, not a codec."""

    def __init__(self, length: int, side: int, bank: int = 512) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (bank, 3, side, side), dtype=torch.uint8,
                                    generator=generator)  # fmt: skip
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": self.images[i % len(self.images)], "label": i % 10}


def small_cnn() -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip


def image_step(
    device: Device, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
) -> int:  # fmt: skip
    """One training step of the image loop on ``batch``; the images in it."""
    x = batch["image"].float().div_(255)  # (B, 3, H, W) uint8 crossed; widened here
    with device.autocast():
        loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return len(batch["label"])


def train_images(
    device: Device, batches: Iterable[dict[str, torch.Tensor]], model: torch.nn.Module,
    optimizer: torch.optim.Optimizer, warmup: int,
) -> tuple[float, int]:  # fmt: skip
    """(seconds after ``warmup`` steps until the last step is done, images in that time)."""
    return timed_steps(device, batches, partial(image_step, device, model, optimizer), warmup)


# ---- the text loop's model and data --------------------------------------------------------------

VOCAB = 50_257  # GPT-2's: ids cross as uint16 when narrowed


class SmallLM(torch.nn.Module):
    """A two-block causal transformer over token ids: a step whose host dispatch is a few
    milliseconds, so that a feed's per-batch host time shows in tokens/s."""

    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        nn = torch.nn
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(block, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, VOCAB)
        h = self.embed(ids) + self.position[: ids.shape[1]]  # (B, T, width)
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def token_batches(
    tokens: np.ndarray, batch: int, context: int, steps: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets), each (batch, context) int64, at random offsets into the uint16
    ``tokens``: how a hand-written loop cuts batches from a token file."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - context - 1, batch)
        rows = np.stack([tokens[i : i + context + 1] for i in starts]).astype(np.int64)
        yield torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])


def train_text(
    device: Device, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], model: SmallLM,
    optimizer: torch.optim.Optimizer, warmup: int,
) -> tuple[float, int]:  # fmt: skip
    """(seconds after ``warmup`` steps until the last step is done, tokens in that time)."""

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        inputs, targets = batch
        with device.autocast():
            logits = model(inputs)  # (B, T, VOCAB)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return targets.numel()

    return timed_steps(device, batches, step, warmup)
