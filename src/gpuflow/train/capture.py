"""The whole training step as one CUDA graph: sample, forward, backward, clip, update, sum.

Eager PyTorch launches a few hundred kernels per step from Python, and at small model sizes
the host's launching, not the device's arithmetic, sets the pace. A CUDA graph records the
step's kernels once and replays them with one launch. What makes the step capturable:
- every tensor it reads or writes lives at a fixed address: parameters, the optimizer's
  state (its step counts are device tensors), the resident corpus, the scalar sums;
- the batch is drawn on the device from ``ResidentTokens``' step counter (a device tensor
  the step advances), not passed in from the host;
- the learning rate is a device tensor computed inside the step from that counter, so the
  warmup and cosine schedule keeps moving across replays (a Python float would be baked
  into the graph at capture);
- gradient clipping computes its scale on the device, and autocast keeps no cast cache.

``CapturedStep`` warms the step up eagerly on a side stream (real training steps: cuBLAS
and the allocator settle), then captures it; ``replay`` runs one more step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gpuflow.train.config import TrainConfig

WARMUP_STEPS = 3


def lr_tensor(step: torch.Tensor, config: TrainConfig) -> torch.Tensor:
    """``gpuflow.train.optim.lr_at`` computed on the device from a 0-d step tensor."""
    s = step.float()
    warm = config.lr * (s + 1) / max(1, config.warmup_steps)
    span = max(1, config.schedule_steps - config.warmup_steps)
    progress = ((s - config.warmup_steps) / span).clamp(0.0, 1.0)
    floor = config.lr * config.min_lr_ratio
    decayed = floor + 0.5 * (config.lr - floor) * (1 + torch.cos(math.pi * progress))
    return torch.where(s < config.warmup_steps, warm, decayed)


class CapturedStep:
    """``body`` (one training step, device work only) captured as a CUDA graph."""

    def __init__(self, body: Callable[[], None]) -> None:
        self.body = body
        self.graph: torch.cuda.CUDAGraph | None = None

    def warm_up(self, steps: int = WARMUP_STEPS) -> None:
        """Run ``body`` eagerly ``steps`` times on a side stream, as capture requires."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(steps):
                self.body()
        torch.cuda.current_stream().wait_stream(side)

    def capture(self) -> None:
        """Record ``body`` without running it: the device state does not move."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.body()
        self.graph = graph

    def replay(self) -> None:
        assert self.graph is not None, "capture() first"
        self.graph.replay()
