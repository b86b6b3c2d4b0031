"""gpuflow: keep PyTorch training resident on the accelerator; move only what must cross.

The public names load lazily, so ``import gpuflow`` (and ``gpuflow --help``) stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncScalars": "gpuflow.transfer.scalars",
    "LedgerSummary": "gpuflow.accounting.ledger.records",
    "LoaderStats": "gpuflow.transfer.loader",
    "MirrorStats": "gpuflow.transfer.mirror",
    "PoolStats": "gpuflow.transfer.pinned",
    "StepTotals": "gpuflow.accounting.ledger.records",
    "BudgetExceeded": "gpuflow.accounting.budgets",
    "Device": "gpuflow.device.accelerator",
    "DeviceLoader": "gpuflow.transfer.loader",
    "GpuflowError": "gpuflow.common.errors",
    "HostMirror": "gpuflow.transfer.mirror",
    "PinnedPool": "gpuflow.transfer.pinned",
    "Ragged": "gpuflow.transfer.packing.spec",
    "ResidentDataset": "gpuflow.data.resident.dataset",
    "ResidentLoader": "gpuflow.data.resident.loader",
    "ResidentTokens": "gpuflow.data.resident.tokens",
    "StateSnapshot": "gpuflow.transfer.snapshot",
    "TransferLedger": "gpuflow.accounting.ledger",
    "budget": "gpuflow.accounting.budgets",
    "pack": "gpuflow.transfer.packing.plan",
    "peer_copy": "gpuflow.transfer.peer",
    "plan_pack": "gpuflow.transfer.packing.plan",
    "PackPlan": "gpuflow.transfer.packing.write",
    "unpack": "gpuflow.transfer.packing.rebuilding",
}

__all__ = ["__version__", *_EXPORTS]

# What type checkers and IDEs see ("X as X" marks a re-export); at run time names load on use.
if TYPE_CHECKING:
    from gpuflow.accounting.budgets import BudgetExceeded as BudgetExceeded
    from gpuflow.accounting.budgets import budget as budget
    from gpuflow.accounting.ledger import (
        TransferLedger as TransferLedger,
    )
    from gpuflow.accounting.ledger.records import (
        LedgerSummary as LedgerSummary,
    )
    from gpuflow.accounting.ledger.records import (
        StepTotals as StepTotals,
    )
    from gpuflow.common.errors import GpuflowError as GpuflowError
    from gpuflow.data.resident.dataset import ResidentDataset as ResidentDataset
    from gpuflow.data.resident.loader import ResidentLoader as ResidentLoader
    from gpuflow.data.resident.tokens import ResidentTokens as ResidentTokens
    from gpuflow.device.accelerator import Device as Device
    from gpuflow.transfer.loader import DeviceLoader as DeviceLoader
    from gpuflow.transfer.loader import LoaderStats as LoaderStats
    from gpuflow.transfer.mirror import HostMirror as HostMirror
    from gpuflow.transfer.mirror import MirrorStats as MirrorStats
    from gpuflow.transfer.packing.plan import pack as pack
    from gpuflow.transfer.packing.plan import plan_pack as plan_pack
    from gpuflow.transfer.packing.rebuilding import unpack as unpack
    from gpuflow.transfer.packing.spec import Ragged as Ragged
    from gpuflow.transfer.packing.write import PackPlan as PackPlan
    from gpuflow.transfer.peer import peer_copy as peer_copy
    from gpuflow.transfer.pinned import PinnedPool as PinnedPool
    from gpuflow.transfer.pinned import PoolStats as PoolStats
    from gpuflow.transfer.scalars import AsyncScalars as AsyncScalars
    from gpuflow.transfer.snapshot import StateSnapshot as StateSnapshot


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpuflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
