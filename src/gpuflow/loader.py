"""Host -> device movement of training batches.

Token batches cross the bus as the shards store them, uint16 (2 bytes per token, where
nanoGPT's int64 ids cost 8) and are widened to int64 on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from gpuflow.device import Device


def upload_tokens(tokens: np.ndarray, device: Device) -> torch.Tensor:
    """Copy a (B, T) uint16/uint32 token array to ``device`` and widen it there to int64."""
    host = torch.from_numpy(np.ascontiguousarray(tokens))
    if device.supports_pinned_memory:
        host = host.pin_memory()
    return host.to(device.torch, non_blocking=True).long()  # (B, T) int64, on the device
