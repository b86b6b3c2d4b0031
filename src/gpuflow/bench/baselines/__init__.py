"""How the baselines join the trainer: importing this package registers the ``naive`` and
``standard`` data paths (their rows in ``gpuflow.train.datapath.PATHS``) and the naive step
(its class in ``gpuflow.train.step.STEPS``).

They are the pipelines gpuflow replaces, kept to measure against, so the trainer's layers
never import them: ``gpuflow bench train`` imports this package for its modes, ``gpuflow
train`` and ``gpuflow profile`` when a run asks for one of them, and a program that builds
such a run through ``Trainer`` imports it first itself.
"""

from __future__ import annotations

from gpuflow.bench.baselines.naive import STEP_KIND, NaiveBatches, NaiveStep
from gpuflow.bench.baselines.standard import StandardBatches
from gpuflow.data.resident.sources import BatchSource
from gpuflow.device.accelerator import Device
from gpuflow.train.datapath import BatchPlan, DataPath, PathRow, StepKind, register_path
from gpuflow.train.step import register_step


def _naive(plan: BatchPlan, device: Device, start: int, stop: int) -> BatchSource:
    return NaiveBatches(plan.sampler)


def _standard(plan: BatchPlan, device: Device, start: int, stop: int) -> BatchSource:
    return StandardBatches(plan.sampler, device)


register_step(STEP_KIND, NaiveStep)
# (No DDP for naive: its per-sequence backward is not one DDP can wrap.)
register_path(DataPath.NAIVE, PathRow(_naive, STEP_KIND, ddp=False, resident=False))
register_path(DataPath.STANDARD, PathRow(_standard, StepKind.EAGER, ddp=True, resident=False))
