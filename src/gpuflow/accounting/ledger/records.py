"""What a ledger records: each counted event, a step's totals, a region's summary, and the
allocator counters read at step boundaries."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import ClassVar, Protocol

import torch

from gpuflow.device.accelerator import Device

# disk2d: file bytes read straight into device memory (kvikio), reported by the reader.
COPY_KINDS = ("h2d", "d2h", "d2d", "disk2d")


@dataclass(frozen=True)
class TransferEvent:
    """One counted operation: a copy (``kind`` h2d/d2h/d2d/disk2d) or a host ``sync``."""

    kind: str
    op: str
    location: str  # "file:line" of the caller
    step: int
    nbytes: int = 0
    dtype: str | None = None
    pinned: bool | None = None  # host memory of a copy: page-locked?
    blocking: bool = False  # did the host wait for it?

    def describe(self) -> str:
        if self.kind == "sync":
            return f"sync  {self.op}  at {self.location}"
        memory = {True: "pinned", False: "pageable", None: "device"}[self.pinned]
        if self.kind == "disk2d":
            memory = "file"
        mode = "blocking" if self.blocking else "async"
        return (
            f"{self.kind}  {self.nbytes:,} B {self.dtype} {memory} {mode} ({self.op})  "
            f"at {self.location}"
        )


@dataclass(frozen=True)
class StepTotals:
    """What one step (or a whole region) did."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    d2d_bytes: int = 0
    disk2d_bytes: int = 0
    h2d_copies: int = 0
    d2h_copies: int = 0
    d2d_copies: int = 0
    disk2d_copies: int = 0
    syncs: int = 0
    device_allocs: int = 0  # cudaMalloc calls
    device_frees: int = 0  # cudaFree calls
    alloc_retries: int = 0  # allocations that had to free cached blocks and retry
    allocator_requests: int = 0  # tensors served by the caching allocator
    reserved_bytes: int = 0  # device memory the allocator holds at the step's end

    @classmethod
    def of(cls, events: list[TransferEvent], allocator: dict[str, int]) -> StepTotals:
        counts: dict[str, int] = dict.fromkeys(f.name for f in fields(cls)) | dict(allocator)
        for name in counts:
            counts[name] = counts[name] or 0
        for e in events:
            if e.kind == "sync":
                counts["syncs"] += 1
            else:
                counts[f"{e.kind}_bytes"] += e.nbytes
                counts[f"{e.kind}_copies"] += 1
        return cls(**counts)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def per_step(self, steps: int = 1) -> dict[str, float]:
        """What each of ``steps`` steps moved, waited for and allocated: the bus fields of
        metrics.jsonl and of ``gpuflow bench train``."""
        return {
            "h2d_bytes_per_step": self.h2d_bytes / steps,
            "d2h_bytes_per_step": self.d2h_bytes / steps,
            "disk2d_bytes_per_step": self.disk2d_bytes / steps,
            "syncs_per_step": self.syncs / steps,
            "device_allocs_per_step": self.device_allocs / steps,
        }


@dataclass(frozen=True)
class LedgerSummary:
    totals: StepTotals
    steps: list[StepTotals]
    top_by_bytes: list[tuple[str, int]]  # (location, bytes copied)
    top_by_syncs: list[tuple[str, int]]  # (location, syncs)

    def median(self, name: str) -> float:
        values = [getattr(s, name) for s in self.steps]
        return statistics.median(values) if values else 0.0

    def table(self) -> str:
        """A plain-text report: totals, per-step medians and the busiest locations."""
        names = [f.name for f in fields(StepTotals)]
        width = max(map(len, names))
        lines = [f"{'':{width}}  {'total':>14}  {'per-step median':>16}"]
        for name in names:
            lines.append(
                f"{name:{width}}  {getattr(self.totals, name):>14,}  {self.median(name):>16,.1f}"
            )
        lines.append(f"steps: {len(self.steps)}")
        for title, rows, unit in (
            ("top locations by bytes", self.top_by_bytes, "B"),
            ("top locations by syncs", self.top_by_syncs, "syncs"),
        ):
            if rows:
                lines.append(title + ":")
                lines += [f"  {count:>14,} {unit}  {where}" for where, count in rows]
        return "\n".join(lines)


class _Allocator:
    """Cumulative device allocator counters, read at step boundaries (cuda only)."""

    KEYS: ClassVar[dict[str, str]] = {
        "device_allocs": "segment.all.allocated",
        "device_frees": "segment.all.freed",
        "alloc_retries": "num_alloc_retries",
        "allocator_requests": "allocation.all.allocated",
    }

    def __init__(self, device: Device) -> None:
        self.device = device
        self.active = device.type == "cuda" and torch.cuda.is_available()
        self.last = self.read()

    def read(self) -> dict[str, int]:
        if not self.active:
            return {}
        stats = torch.cuda.memory_stats(self.device.torch)
        return {name: int(stats.get(key, 0)) for name, key in self.KEYS.items()} | {
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0))
        }

    def delta(self) -> dict[str, int]:
        """The counters since the last delta (reserved bytes: as they are now)."""
        now = self.read()
        out = self.between(self.last, now)
        self.last = now
        return out

    @staticmethod
    def between(start: dict[str, int], end: dict[str, int]) -> dict[str, int]:
        out = {k: v - start.get(k, 0) for k, v in end.items() if k != "reserved_bytes"}
        if end:
            out["reserved_bytes"] = end["reserved_bytes"]
        return out


class OpenLedger(Protocol):
    """What the recorder sees of an open ``TransferLedger``: where an event goes. The modules
    that count sit below the ledger's own, so they name it by this."""

    host_reads: bool  # whether reads of host tensors count as syncs
    _events: list[TransferEvent]
    _step: int
    _watch: Callable[[TransferEvent], Exception | None] | None
