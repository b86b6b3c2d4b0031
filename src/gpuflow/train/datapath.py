"""The data paths of ``train.data_path``: how each training step gets its batch.

``naive`` (the pipeline this project replaces), ``standard`` (what most PyTorch code does),
``streamed`` (``DeviceLoader`` with uint16 ids), ``resident`` (the corpus uploaded once,
batches drawn on the device) and ``resident-graph`` (``resident`` with the whole step as one
CUDA graph; the default on CUDA). What each path is made of (its batch source, its step, DDP,
residency): its row in ``gpuflow.train.paths``; what each does, in detail:
docs/architecture/training.md (The data paths).
"""

from __future__ import annotations

import os
from enum import StrEnum
from typing import TYPE_CHECKING

from gpuflow.device.allocator import allocator_in

if TYPE_CHECKING:  # this module stays light: ``gpuflow --help`` lists the paths
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
