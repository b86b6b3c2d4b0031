"""The data paths of ``train.data_path``: which ones there are, which one runs on this device,
and what each is made of (its row in ``PATHS``).

The trainer's own paths are ``streamed`` (``DeviceLoader`` with uint16 ids), ``resident``
(the corpus uploaded once, batches drawn on the device) and ``resident-graph`` (``resident``
with the whole step as one CUDA graph; the default on CUDA). ``naive`` (the pipeline this
project replaces) and ``standard`` (what most PyTorch code does) are baselines, kept to
measure against: their names are here, since configs name them, but their rows are the
bench's, added with ``register_path`` when ``gpuflow.bench.baselines`` is imported, so that
the trainer's layers never import the bench. A row says where a path's batches come from,
which kind of step trains on them, whether several ranks wrap its model in DDP, whether its
corpus lives on the device and whether its step trains bf16 weights over fp32 masters. Adding
a path is a name in ``DataPath`` and a row in ``PATHS``. What each does, in detail:
docs/architecture/training.md (The data paths).

The run's config checks ``train.data_path`` against these names, and every step reads that
config: so a row names its step's kind, and ``gpuflow.train.step`` builds the step. Importing
this module loads no torch (the command line lists the paths as it builds its parser): a
batch source's module is imported when the source is opened.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import TYPE_CHECKING, Any

from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.batches import WindowSampler
from gpuflow.data.tokens import TokenFolder
from gpuflow.device.allocator import allocator_in

if TYPE_CHECKING:
    from gpuflow.data.resident.sources import BatchSource
    from gpuflow.device.accelerator import Device


class DataPath(StrEnum):
    AUTO = "auto"
    NAIVE = "naive"
    STANDARD = "standard"
    STREAMED = "streamed"
    RESIDENT = "resident"
    RESIDENT_GRAPH = "resident-graph"

    @classmethod
    def runnable(cls) -> tuple[DataPath, ...]:
        """Every path but ``auto``, slowest first: the benchmark's rows."""
        return tuple(p for p in cls if p is not cls.AUTO)


def resolve_data_path(
    requested: str, device: Device, allocator: str = "auto"
) -> tuple[DataPath, str | None]:
    """The path to run under ``allocator`` (``train.allocator``) and, when it differs from
    the one asked for, why."""
    path = DataPath(requested)
    if allocator == "auto":
        allocator = allocator_in(os.environ)
    captures = device.type == "cuda" and allocator != "cudaMallocAsync"
    no_capture = "the step cannot be captured under cudaMallocAsync; running resident eagerly"
    if path is DataPath.AUTO and device.type == "cuda":
        return (DataPath.RESIDENT_GRAPH, None) if captures else (DataPath.RESIDENT, no_capture)
    if path is DataPath.AUTO:
        return DataPath.RESIDENT, None
    if path is DataPath.RESIDENT_GRAPH and device.type != "cuda":
        why = f"resident-graph needs CUDA graphs; running resident eagerly on {device}"
        return DataPath.RESIDENT, why
    if path is DataPath.RESIDENT_GRAPH and not captures:
        # Memory the stream-ordered allocator hands out during a capture has no address
        # Triton accepts until the graph runs, so the step's Triton kernels cannot be
        # captured (torch 2.11).
        return DataPath.RESIDENT, no_capture
    return path, None


class StepKind(StrEnum):
    """The trainer's kinds of training step (``gpuflow.train.step``: ``STEPS`` holds their
    classes, and those of kinds registered beside a path's row, as the naive baseline's)."""

    EAGER = "eager"  # forward, backward, clip, update, launched one by one
    GRAPH = "graph"  # the whole step, batch draw included, as one CUDA graph


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
OpenSource = Callable[[BatchPlan, "Device", int, int], "BatchSource"]


def _streamed(plan: BatchPlan, device: Device, start: int, stop: int) -> BatchSource:
    from gpuflow.data.resident.sources import StreamedBatches

    return StreamedBatches(plan.sampler, device, start, stop)


def _resident(plan: BatchPlan, device: Device, start: int, stop: int) -> BatchSource:
    from gpuflow.data.resident.sources import ResidentBatches

    return ResidentBatches(
        plan.data.train, device, plan.batch_size, plan.seq_len, plan.seed, start,
        plan.device_budget_bytes, plan.vocab_size, plan.rank, plan.world_size, plan.resumed,
        plan.managed, plan.io,
    )  # fmt: skip


@dataclass(frozen=True)
class PathRow:
    open_source: OpenSource
    step: str  # a StepKind, or a kind registered with the step's class (``register_step``)
    # On several ranks the model is wrapped in DistributedDataParallel (which overlaps the
    # all-reduce with the eager backward); otherwise the step's averager reduces gradients
    # (the naive baseline's per-sequence backward is not one DDP can wrap).
    ddp: bool
    resident: bool  # the corpus lives on the device: data.placement and data.io apply
    master_weights: bool = False  # bf16 weights over fp32 masters, where the kernel runs


# The trainer's own rows, then those registered (``register_path``).
PATHS: dict[DataPath, PathRow] = {
    DataPath.STREAMED: PathRow(_streamed, StepKind.EAGER, ddp=True, resident=False),
    DataPath.RESIDENT: PathRow(_resident, StepKind.EAGER, ddp=True, resident=True),
    DataPath.RESIDENT_GRAPH: PathRow(
        _resident, StepKind.GRAPH, ddp=False, resident=True, master_weights=True
    ),
}


OWN_PATHS = frozenset(PATHS)


def register_path(path: DataPath, path_row: PathRow) -> None:
    """Give ``path`` its row: how the bench's baselines join the table
    (``gpuflow.bench.baselines``). The trainer's own rows cannot be replaced."""
    if path is DataPath.AUTO or path in OWN_PATHS:
        raise ValueError(f"{path} is the trainer's own; only a path without a row is registered")
    PATHS[path] = path_row


def registered(name: str) -> bool:
    """Whether ``train.data_path`` ``name`` can be built in this process: ``auto`` (which
    resolves to one of the trainer's own paths) or a path with a row."""
    return name == DataPath.AUTO or DataPath(name) in PATHS


def row(path: DataPath) -> PathRow:
    """``path``'s row; ``auto`` has none (``resolve_data_path`` first), and a baseline has
    one once the bench has registered it."""
    if path is DataPath.AUTO:
        raise ValueError(f"{path} is not a runnable data path; resolve_data_path first")
    if path not in PATHS:
        raise GpuflowError(
            f"train.data_path {path} is a baseline the bench registers: import "
            f"gpuflow.bench.baselines before building the run, or measure it with "
            f"gpuflow bench train --modes {path}"
        )
    return PATHS[path]


def open_batches(
    path: DataPath, plan: BatchPlan, device: Device, start: int, stop: int
) -> BatchSource:
    """The source of ``path`` for steps ``start`` to ``stop``."""
    return row(path).open_source(plan, device, start, stop)
