"""The transfer metrics, computed from measured data (the ledger, a trace, the link probe).

- link utilisation: the rate copies achieved while they ran ÷ the measured pinned peak of
  the same direction (``gpuflow info``'s link probe).
- transfer overhead: transfer time not hidden behind compute ÷ step time. 0 when every copy
  ran while a kernel did; 1 when the device did nothing but copy.
- memory efficiency: useful bytes (what the step consumes, e.g. a batch's token ids) ÷
  bytes moved across the bus (both directions). Above 1 when narrowing or compression
  moved fewer bytes than the step uses.
- overlap efficiency: time copies and kernels ran at once ÷ max(compute time, transfer
  time). 1 when the shorter of the two hid entirely behind the longer.
- transfer volume per batch and allocation count per batch: the ledger's per-step
  medians of bytes moved and of cudaMalloc calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuflow.accounting.crosscheck import Interval


def merged(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of spans as sorted, disjoint spans."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(spans: Iterable[tuple[float, float]]) -> float:
    return sum(end - start for start, end in merged(spans))


def intersection(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Time inside both unions."""
    a, b = merged(a), merged(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, high - low)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class TransferMetrics:
    transfer_us: float  # device time with at least one copy running
    compute_us: float  # device time with at least one kernel running
    overlap_us: float  # both at once
    step_us: float  # wall time per step
    steps: int
    bytes_moved: int  # host<->device, both directions, over the steps
    useful_bytes: int  # what the steps consumed
    achieved_h2d_gb_s: float | None
    peak_h2d_gb_s: float | None

    @property
    def exposed_transfer_us(self) -> float:
        return self.transfer_us - self.overlap_us

    @property
    def transfer_overhead(self) -> float:
        total = self.step_us * self.steps
        return self.exposed_transfer_us / total if total > 0 else 0.0

    @property
    def overlap_efficiency(self) -> float:
        longest = max(self.transfer_us, self.compute_us)
        return self.overlap_us / longest if longest > 0 else 0.0

    @property
    def memory_efficiency(self) -> float | None:
        return self.useful_bytes / self.bytes_moved if self.bytes_moved else None

    @property
    def link_utilisation(self) -> float | None:
        if not self.achieved_h2d_gb_s or not self.peak_h2d_gb_s:
            return None
        return self.achieved_h2d_gb_s / self.peak_h2d_gb_s


def from_activity(
    activity: list[Interval],
    *,
    wall_us: float,
    steps: int,
    bytes_moved: int,
    useful_bytes: int,
    peak_h2d_gb_s: float | None,
) -> TransferMetrics:
    """The metrics of a profiled region of ``steps`` steps that took ``wall_us``."""
    copies = [(a.start, a.end) for a in activity if a.kind in ("h2d", "d2h")]
    kernels = [(a.start, a.end) for a in activity if a.kind == "kernel"]
    h2d = [a for a in activity if a.kind == "h2d"]
    h2d_us = sum(a.end - a.start for a in h2d)
    achieved = sum(a.nbytes for a in h2d) / (h2d_us * 1e3) if h2d_us > 0 else None
    return TransferMetrics(
        transfer_us=covered(copies),
        compute_us=covered(kernels),
        overlap_us=intersection(copies, kernels),
        step_us=wall_us / steps if steps else 0.0,
        steps=steps,
        bytes_moved=bytes_moved,
        useful_bytes=useful_bytes,
        achieved_h2d_gb_s=achieved,
        peak_h2d_gb_s=peak_h2d_gb_s,
    )
