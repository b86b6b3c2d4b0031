"""Batch sources: where each training step's (inputs, targets) come from.

A source gets only what it needs (the device, the corpus or a sampler, the shapes, the seed)
and yields, for step ``s``, (B, T) int64 inputs and targets on the device. Every source
draws step ``s``'s batch from ``(seed, s)``, so a checkpoint's step is its data position.

A *capturable* source can also draw on the device alone, from a device step counter, so
that the draw can sit inside a CUDA graph: ``prepare(s)`` does the host's part of step ``s``
(a chunk switch) before the graph runs, and ``draw()`` queues device work only and moves
the counter on.

The baselines' sources (``gpuflow.bench.baselines``) follow the same interface.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from gpuflow.data.resident.batches import WindowSampler
from gpuflow.data.resident.tokens import ResidentTokens
from gpuflow.data.shards import Shard
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader


class BatchSource(AbstractContextManager):
    """One step's (inputs, targets), (B, T) int64 on the device, for each step in order."""

    # Whether a logging step reads the loss back at once, as a standard loop prints it.
    reads_loss_each_log = False

    def inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        """Free what the source holds (threads, device memory); idempotent."""

    def position(self, step: int) -> dict[str, Any]:
        """Where the source is after ``step`` beyond the step itself, for a checkpoint (every
        source draws step s's batch from (seed, s); a streamed corpus adds its chunk)."""
        return {}

    def __exit__(self, *exc: object) -> None:
        self.close()


class CapturableSource(BatchSource):
    """A source whose draw is device work only, so it can be captured in a CUDA graph."""

    counter: torch.Tensor  # () int64 on the device: the step the next draw is for
    worth_compiling = False  # whether torch.compile fuses the draw's kernels into fewer

    def prepare(self, step: int) -> None:
        """The host's part of step ``step``, before its draw (outside any graph)."""

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of step ``counter``, then ``counter`` moves on; no copy, no sync."""
        raise NotImplementedError

    def inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.prepare(step)
        return self.draw()


class StreamedBatches(BatchSource):
    """Host-sampled uint16 windows through a ``DeviceLoader``: 2 bytes per token cross the
    bus, packed and their copy queued two steps ahead of the step that uses them."""

    def __init__(self, sampler: WindowSampler, device: Device, start: int, stop: int) -> None:
        batches = (sampler.batch(s) for s in range(start, stop))
        # One copy per step: the profile's cross-check counts copies per step window.
        self.loader = DeviceLoader(batches, device, coalesce=False)
        self._batches: Iterator[torch.Tensor] = iter(self.loader)

    def inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = next(self._batches).long()  # (B, T+1) uint16 -> int64 on the device
        return tokens[:, :-1], tokens[:, 1:]

    def close(self) -> None:
        self.loader.close()


class ResidentBatches(CapturableSource):
    """The corpus uploaded once (``ResidentTokens``) and every batch drawn on the device:
    0 bytes cross per step."""

    worth_compiling = True  # hash, gather and widen: a dozen small kernels

    def __init__(
        self, shards: tuple[Shard, ...], device: Device, batch_size: int, seq_len: int,
        seed: int, start: int, budget_bytes: int | None = None, vocab_size: int | None = None,
        rank: int = 0, world_size: int = 1, resumed: Mapping[str, Any] | None = None,
        managed: bool = False, io: str = "pinned",
    ) -> None:  # fmt: skip
        self.tokens = ResidentTokens(
            shards, device, batch_size, seq_len, seed=seed, rank=rank, world_size=world_size,
            budget_bytes=budget_bytes, vocab_size=vocab_size, managed=managed, io=io,
        )  # fmt: skip
        self.tokens.set_step(start, resumed)  # ``resumed``: the checkpoint's ``position``
        self.counter = self.tokens.step

    def position(self, step: int) -> dict[str, Any]:
        return self.tokens.position(step)

    def prepare(self, step: int) -> None:
        self.tokens.advance(step)  # a chunk switch happens here, outside any graph

    def turn_stats(self) -> dict[str, Any] | None:
        """What this rank's chunk turns have cost so far (turns, host seconds, bytes read);
        None while the corpus is resident. See ``ResidentTokens.turn_stats``."""
        return self.tokens.turn_stats()

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens.sample()

    def close(self) -> None:
        self.tokens.close()


class FixedBatch(CapturableSource):
    """One batch, placed on the device before training and reused by every step: no data
    path at all, the reference a data path's overhead is measured against."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, start: int = 0) -> None:
        self.batch = (inputs, targets)
        self.counter = torch.full((), start, dtype=torch.int64, device=inputs.device)

    @classmethod
    def first_of(cls, source: BatchSource, start: int = 0) -> FixedBatch:
        """A copy of ``source``'s batch for step ``start``."""
        inputs, targets = source.inputs(start)
        return cls(inputs.clone(), targets.clone(), start)

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.counter.add_(1)  # the schedule reads it, as it reads the resident corpus's
        return self.batch
