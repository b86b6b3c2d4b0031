"""gpuflow: keep PyTorch training resident on the accelerator; move only what must cross.

The public names load lazily, so ``import gpuflow`` (and ``gpuflow --help``) stays fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncScalars": "gpuflow.mirror",
    "BudgetExceeded": "gpuflow.budgets",
    "Device": "gpuflow.device",
    "DeviceLoader": "gpuflow.loader",
    "GpuflowError": "gpuflow.errors",
    "HostMirror": "gpuflow.mirror",
    "PinnedPool": "gpuflow.pinned",
    "Ragged": "gpuflow.packing",
    "ResidentTokens": "gpuflow.data.resident",
    "TransferLedger": "gpuflow.ledger",
    "budget": "gpuflow.budgets",
    "pack": "gpuflow.packing",
    "unpack": "gpuflow.packing",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpuflow' has no attribute {name!r}")
