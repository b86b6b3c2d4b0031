"""What each data path is made of, one row per path (``PATHS``): where its batches come from,
which step runs them, whether several ranks wrap its model in DDP, whether its corpus lives
on the device, whether its step trains bf16 weights over fp32 masters. Adding a path is a
name in ``train/datapath.py`` and a row here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
from gpuflow.train.optim import StepOptimizer
from gpuflow.train.optim.adamw import CapturableAdamW
from gpuflow.train.optim.master_adamw import with_fp32_masters
from gpuflow.train.step import EagerStep, GraphStep, NaiveStep, StepOptions, StepParts, TrainStep


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


# (the plan, the device, the first step, the step to stop before) -> the path's batches
OpenSource = Callable[[BatchPlan, Device, int, int], BatchSource]


def _naive(plan: BatchPlan, device: Device, start: int, stop: int) -> BatchSource:
    return NaiveBatches(plan.sampler)


def _standard(plan: BatchPlan, device: Device, start: int, stop: int) -> BatchSource:
    return StandardBatches(plan.sampler, device)


def _streamed(plan: BatchPlan, device: Device, start: int, stop: int) -> BatchSource:
    return StreamedBatches(plan.sampler, device, start, stop)


def _resident(plan: BatchPlan, device: Device, start: int, stop: int) -> BatchSource:
    return ResidentBatches(
        plan.data.train, device, plan.batch_size, plan.seq_len, plan.seed, start,
        plan.device_budget_bytes, plan.vocab_size, plan.rank, plan.world_size, plan.resumed,
        plan.managed, plan.io,
    )  # fmt: skip


@dataclass(frozen=True)
class PathRow:
    open_source: OpenSource
    step: type[TrainStep]
    # On several ranks the model is wrapped in DistributedDataParallel (which overlaps the
    # all-reduce with the eager backward); otherwise the step's averager reduces gradients
    # (the naive baseline's per-sequence backward is not one DDP can wrap).
    ddp: bool
    resident: bool  # the corpus lives on the device: data.placement and data.io apply
    master_weights: bool = False  # bf16 weights over fp32 masters, where the kernel runs


PATHS: Mapping[DataPath, PathRow] = {
    DataPath.NAIVE: PathRow(_naive, NaiveStep, ddp=False, resident=False),
    DataPath.STANDARD: PathRow(_standard, EagerStep, ddp=True, resident=False),
    DataPath.STREAMED: PathRow(_streamed, EagerStep, ddp=True, resident=False),
    DataPath.RESIDENT: PathRow(_resident, EagerStep, ddp=True, resident=True),
    DataPath.RESIDENT_GRAPH: PathRow(
        _resident, GraphStep, ddp=False, resident=True, master_weights=True
    ),
}


def row(path: DataPath) -> PathRow:
    """``path``'s row; ``auto`` has none (``resolve_data_path`` first)."""
    if path not in PATHS:
        raise ValueError(f"{path} is not a runnable data path; resolve_data_path first")
    return PATHS[path]


def open_batches(
    path: DataPath, plan: BatchPlan, device: Device, start: int, stop: int
) -> BatchSource:
    """The source of ``path`` for steps ``start`` to ``stop``."""
    return row(path).open_source(plan, device, start, stop)


def build_step(path: DataPath, parts: StepParts, batches: BatchSource) -> TrainStep:
    """The step of ``path`` over ``batches``."""
    return row(path).step(parts, batches)


def optimizer_for(
    path: DataPath, adamw: CapturableAdamW, device: Device, options: StepOptions,
    shard: tuple[int, int] = (0, 1),
) -> StepOptimizer:  # fmt: skip
    """The optimizer ``path``'s step runs: ``adamw`` (restored from a checkpoint, if any)
    handed to a MasterAdamW where the path trains bf16 weights and the kernel runs, updating
    part ``rank`` of ``shard=(rank, world_size)``; elsewhere ``adamw`` itself."""
    if row(path).master_weights and options.master_weights:
        return with_fp32_masters(adamw, device, shard)
    return adamw
