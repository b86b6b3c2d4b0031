"""AdamW with decoupled weight decay on matrices only; the global gradient norm."""

from __future__ import annotations

from typing import Any

import torch

from gpuflow.device.accelerator import Device
from gpuflow.train.config import TrainConfig


def decay_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Parameter groups where matrices decay and 1-d tensors do not: embeddings are matrices
    and decay too, as in GPT-2, while LayerNorm gains do not."""
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class CapturableAdamW(torch.optim.AdamW):
    """torch's AdamW keeping the step's optimizer contract (``gpuflow.train.optim``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grad_scale: torch.Tensor | None = None  # read by the fused kernel, when fused

    def use_device_lr(self, lr: torch.Tensor) -> None:
        for group in self.param_groups:
            group["lr"] = lr
            group["capturable"] = True  # the fused kernel keeps its step counts on the device

    def after_capture(self) -> None:
        """Nothing moves: the fused kernel finds the gradients by their tensors."""

    def gather_state(self) -> None:
        """The whole state is on every rank already."""


def build_optimizer(model: torch.nn.Module, config: TrainConfig, device: Device) -> CapturableAdamW:
    """AdamW over ``decay_groups``, fused into one kernel per step on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    return CapturableAdamW(
        decay_groups(params, config.weight_decay),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        fused=True if device.supports_fused_adamw else None,
    )


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``grads`` together, as a 0-d fp32 device tensor. Each tensor's norm
    is accumulated in fp32 whatever its dtype: bf16 gradients would otherwise give a bf16
    norm, three significant digits, to the clip and the logs."""
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)  # one launch per few tensors
    return torch.linalg.vector_norm(torch.stack(norms))
