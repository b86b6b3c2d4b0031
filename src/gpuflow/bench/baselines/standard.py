"""The ``standard`` data path: what most PyTorch training code does (nanoGPT's ``get_batch``).

The batch is sampled on the host, widened to int64 there (8 bytes per token cross the bus),
pinned per batch and copied with ``non_blocking``; a logging step reads the loss with
``.item()``. Kept to measure gpuflow's paths against.
"""

from __future__ import annotations

import numpy as np
import torch

from gpuflow.data.resident.batches import WindowSampler
from gpuflow.data.resident.sources import BatchSource
from gpuflow.device.accelerator import Device


class StandardBatches(BatchSource):
    reads_loss_each_log = True

    def __init__(self, sampler: WindowSampler, device: Device) -> None:
        self.sampler, self.device = sampler, device

    def inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        host = torch.from_numpy(self.sampler.batch(step).astype(np.int64))  # (B, T+1) int64
        if self.device.supports_pinned_memory:
            host = host.pin_memory()  # a fresh pinned buffer every batch
        tokens = host.to(self.device.torch, non_blocking=True)
        return tokens[:, :-1], tokens[:, 1:]
