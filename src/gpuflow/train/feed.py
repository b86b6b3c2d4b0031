"""The batch source of each data path, opened from what every source draws from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from gpuflow.baselines.naive import NaiveBatches
from gpuflow.baselines.standard import StandardBatches
from gpuflow.data.batches import WindowSampler
from gpuflow.data.sources import BatchSource, ResidentBatches, StreamedBatches
from gpuflow.data.tokens import TokenFolder
from gpuflow.device.accelerator import Device
from gpuflow.train.datapath import DataPath


@dataclass(frozen=True)
class BatchPlan:
    """What every source draws from: the train split, the batch shape and the seed."""

    data: TokenFolder
    batch_size: int
    seq_len: int
    seed: int
    vocab_size: int
    device_budget_bytes: int | None = None  # the resident corpus's cap (None: its default)
    rank: int = 0  # of a data-parallel job: every source draws from this rank's slice
    world_size: int = 1
    resumed: Mapping[str, Any] | None = None  # the checkpoint's data position, if resuming
    managed: bool = False  # the resident corpus in CUDA managed memory (data.placement)
    io: str = "pinned"  # how the resident corpus is read: pinned or kvikio (data.io, resolved)

    @cached_property
    def sampler(self) -> WindowSampler:
        """Batches drawn on the host, after every train shard's ids are checked (a resident
        corpus checks its own as it uploads them); built on first use."""
        self.data.check_vocab(self.vocab_size, splits=("train",))
        return WindowSampler(
            self.data.train, self.batch_size, self.seq_len, self.seed, self.rank, self.world_size
        )


def open_batches(
    path: DataPath, plan: BatchPlan, device: Device, start: int, stop: int
) -> BatchSource:
    """The source of ``path`` for steps ``start`` to ``stop``."""
    if path is DataPath.NAIVE:
        return NaiveBatches(plan.sampler)
    if path is DataPath.STANDARD:
        return StandardBatches(plan.sampler, device)
    if path is DataPath.STREAMED:
        return StreamedBatches(plan.sampler, device, start, stop)
    if path in (DataPath.RESIDENT, DataPath.RESIDENT_GRAPH):
        return ResidentBatches(
            plan.data.train, device, plan.batch_size, plan.seq_len, plan.seed, start,
            plan.device_budget_bytes, plan.vocab_size, plan.rank, plan.world_size, plan.resumed,
            plan.managed, plan.io,
        )  # fmt: skip
    raise ValueError(f"{path} is not a runnable data path; resolve_data_path first")
