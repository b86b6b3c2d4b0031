"""gpuflow: keep PyTorch training resident on the accelerator; move only what must cross.

The public names load lazily, so ``import gpuflow`` (and ``gpuflow --help``) stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncScalars": "gpuflow.transfer.mirror",
    "LedgerSummary": "gpuflow.accounting.ledger",
    "LoaderStats": "gpuflow.transfer.loader",
    "MirrorStats": "gpuflow.transfer.mirror",
    "PoolStats": "gpuflow.transfer.pinned",
    "StepTotals": "gpuflow.accounting.ledger",
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

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the names load on use
    from gpuflow.accounting.budgets import BudgetExceeded, budget
    from gpuflow.accounting.ledger import LedgerSummary, StepTotals, TransferLedger
    from gpuflow.common.errors import GpuflowError
    from gpuflow.data.resident import ResidentTokens
    from gpuflow.device.accelerator import Device
    from gpuflow.transfer.loader import DeviceLoader, LoaderStats
    from gpuflow.transfer.mirror import AsyncScalars, HostMirror, MirrorStats
    from gpuflow.transfer.packing import Ragged, pack, unpack
    from gpuflow.transfer.pinned import PinnedPool, PoolStats


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpuflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
