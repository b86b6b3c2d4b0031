"""gpuflow: keep PyTorch training resident on the accelerator; move only what must cross.

The public names load lazily, so ``import gpuflow`` (and ``gpuflow --help``) stays fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncScalars": "gpuflow.transfer.mirror",
    "BudgetExceeded": "gpuflow.accounting.budgets",
    "Device": "gpuflow.device.accelerator",
    "DeviceLoader": "gpuflow.transfer.loader",
    "GpuflowError": "gpuflow.common.errors",
    "HostMirror": "gpuflow.transfer.mirror",
    "PinnedPool": "gpuflow.transfer.pinned",
    "Ragged": "gpuflow.transfer.packing",
    "ResidentTokens": "gpuflow.data.resident",
    "TransferLedger": "gpuflow.accounting.ledger",
    "budget": "gpuflow.accounting.budgets",
    "pack": "gpuflow.transfer.packing",
    "unpack": "gpuflow.transfer.packing",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpuflow' has no attribute {name!r}")
