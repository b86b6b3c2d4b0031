"""How each training step gets its batch: the data-path modes of ``train.data_path``.

- ``naive``: the pipeline this project replaces (``gpuflow.baselines.naive``): each sequence on
  its own, the embedding tables downloaded and the lookup done on the host, blocking
  uploads, the loss read after every sequence, no device memory caching.
- ``standard``: what most PyTorch code does (nanoGPT's ``get_batch``): the batch sampled on
  the host, widened to int64 there (8 bytes per token), pinned per batch, copied with
  ``non_blocking``; the loss read with ``.item()`` at every logging step.
- ``streamed``: ``DeviceLoader`` with uint16 ids (2 bytes per token), packed and copied on a
  side stream while the previous step computes; widened on the device.
- ``resident``: ``ResidentTokens``: the corpus uploaded once, batches drawn on the device;
  0 bytes per step.
- ``resident-graph``: ``resident`` with the whole step captured as one CUDA graph
  (``gpuflow.train.capture``). The default on CUDA; elsewhere it runs as ``resident``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from gpuflow.data.batches import WindowSampler
from gpuflow.data.resident import ResidentTokens
from gpuflow.data.shards import Shard
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader


def resolve_data_path(requested: str, device: Device) -> tuple[str, str | None]:
    """The mode to run and, when it differs from the one asked for, why."""
    if requested == "auto":
        return ("resident-graph" if device.type == "cuda" else "resident"), None
    if requested == "resident-graph" and device.type != "cuda":
        return "resident", f"resident-graph needs CUDA graphs; running resident eagerly on {device}"
    return requested, None


class Batches(AbstractContextManager):
    """One mode's source of (inputs, targets), (B, T) int64 on the device, for each step."""

    reads_loss_each_log = False  # standard mode's .item() at logging steps

    def inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        return None


class StandardBatches(Batches):
    reads_loss_each_log = True

    def __init__(self, sampler: WindowSampler, device: Device) -> None:
        self.sampler, self.device = sampler, device

    def inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        host = torch.from_numpy(self.sampler.batch(step).astype(np.int64))  # (B, T+1) int64
        if self.device.supports_pinned_memory:
            host = host.pin_memory()
        tokens = host.to(self.device.torch, non_blocking=True)
        return tokens[:, :-1], tokens[:, 1:]


class NaiveBatches(Batches):
    reads_loss_each_log = True

    def __init__(self, sampler: WindowSampler) -> None:
        self.sampler = sampler

    def host_tokens(self, step: int) -> np.ndarray:
        return self.sampler.batch(step).astype(np.int64)  # (B, T+1), on the host


class StreamedBatches(Batches):
    def __init__(self, sampler: WindowSampler, device: Device, start: int, stop: int) -> None:
        self.loader = DeviceLoader((sampler.batch(s) for s in range(start, stop)), device)
        self._batches = iter(self.loader)

    def inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = next(self._batches).long()  # (B, T+1) uint16 -> int64 on the device
        return tokens[:, :-1], tokens[:, 1:]

    def __exit__(self, *exc: object) -> None:
        self.loader.close()


class ResidentBatches(Batches):
    def __init__(
        self, shards: tuple[Shard, ...], device: Device, batch_size: int, seq_len: int,
        seed: int, start: int, budget_bytes: int | None = None, vocab_size: int | None = None,
    ) -> None:  # fmt: skip
        self.tokens = ResidentTokens(
            shards, device, batch_size, seq_len, seed=seed, budget_bytes=budget_bytes,
            vocab_size=vocab_size,
        )  # fmt: skip
        self.tokens.set_step(start)

    def inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.tokens.advance(step)
        return self.tokens.sample()

    def __exit__(self, *exc: object) -> None:
        self.tokens.close()


def open_batches(mode: str, trainer: Any, start: int, stop: int) -> Batches:
    """The ``Batches`` of ``mode`` for ``trainer``'s data, from step ``start``."""
    cfg = trainer.config
    if mode == "naive":
        return NaiveBatches(trainer.sampler)
    if mode == "standard":
        return StandardBatches(trainer.sampler, trainer.device)
    if mode == "streamed":
        return StreamedBatches(trainer.sampler, trainer.device, start, stop)
    return ResidentBatches(
        trainer.data.train,
        trainer.device,
        cfg.train.batch_size,
        cfg.model.max_len,
        cfg.train.seed,
        start,
        trainer.resident_budget,
        cfg.model.vocab_size,
    )
