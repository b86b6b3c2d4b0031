"""The optimizers a training step runs, and the contract between them and the step.

``StepOptimizer`` is what the step, the trainer and the checkpoints ask of an optimizer
beyond ``torch.optim.Optimizer``'s own methods. Two keep it: ``adamw.CapturableAdamW``
(torch's AdamW, fused on CUDA: the eager paths, and the captured step without masters) and
``master_adamw.MasterAdamW`` (bf16 weights over fp32 masters, one kernel, optionally split
over ranks). A new optimizer is a module here that keeps the contract, and a line in
``gpuflow.train.setup.optimizer_for``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class StepOptimizer(Protocol):
    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    # The clip's factor (>= 1), read as the update reads each gradient; None: no clip there.
    grad_scale: torch.Tensor | None

    def step(self, closure: None = None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def use_device_lr(self, lr: torch.Tensor) -> None:
        """For a captured step: read the learning rate from ``lr`` (a device scalar the step
        writes) and keep every other per-step value on the device."""
        ...

    def after_capture(self) -> None:
        """Called once the step is captured: rebind to what the capture's memory moved."""
        ...

    def gather_state(self) -> None:
        """Hold the whole optimizer state on this rank (before a checkpoint); collective
        where the state is split over ranks."""
        ...
