"""The ledger checked against the device's own record: ``torch.profiler``'s memcpy events.

    with ProfiledLedger("trace.json") as run:
        for _ in range(10):
            step()
            run.step()
    for row in run.comparison():
        print(row)                     # h2d/d2h copies and bytes: ledger vs profiler

The trace opens in Perfetto (ui.perfetto.dev) or chrome://tracing. What each side sees, and
which rows are not compared: docs/architecture/ledger.md (The ledger against the profiler).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuflow.accounting.ledger import COPY_KINDS, TransferLedger
from gpuflow.device.accelerator import Device

_KIND_OF_NAME = {"HtoD": "h2d", "DtoH": "d2h", "DtoD": "d2d", "PtoP": "d2d"}


@dataclass(frozen=True)
class Interval:
    """One device activity from a trace, in microseconds."""

    start: float
    end: float
    stream: int
    kind: str  # "kernel" or a copy kind
    nbytes: int = 0
    name: str = ""  # the kernel's or copy's name in the trace


def device_activity(trace: dict[str, Any]) -> list[Interval]:
    """Kernels and memcpys of a Chrome trace written by ``torch.profiler``."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat, args = e.get("cat", ""), e.get("args", {})
        if cat == "kernel":
            kind = "kernel"
        elif cat == "gpu_memcpy":
            words = e.get("name", "").split()
            kind = _KIND_OF_NAME.get(words[1] if len(words) > 1 else "", "d2d")
        else:
            continue
        start = float(e["ts"])
        out.append(
            Interval(
                start,
                start + float(e.get("dur", 0)),
                int(args.get("stream", e.get("tid", 0)) or 0),
                kind,
                int(args.get("bytes", 0) or 0),
                e.get("name", ""),
            )
        )
    return out


@dataclass(frozen=True)
class CopyComparison:
    kind: str
    ledger_copies: int
    ledger_bytes: int
    profiler_copies: int
    profiler_bytes: int
    compared: bool  # False for d2d and disk2d (see the module docstring)

    @property
    def agrees(self) -> bool:
        return not self.compared or (
            self.ledger_copies == self.profiler_copies and self.ledger_bytes == self.profiler_bytes
        )


class DeviceTrace:
    """A ``torch.profiler`` run over a region: the trace written to ``trace_path`` and the
    device's kernels and copies read back from it into ``activity``."""

    def __init__(self, trace_path: str | Path, device: Device | str = "auto") -> None:
        self.trace_path = Path(trace_path)
        self.device = Device.resolve(device)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self.activity: list[Interval] = []

    def __enter__(self) -> DeviceTrace:
        self.device.synchronize()  # earlier work stays out of the record
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.device.synchronize()  # every queued kernel and copy lands in the trace
        self._profiler.__exit__(None, None, None)
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self.trace_path))
        self.activity = device_activity(json.loads(self.trace_path.read_text()))


class ProfiledLedger:
    """A ``TransferLedger`` inside a ``DeviceTrace``; see the module docstring."""

    def __init__(self, trace_path: str | Path, device: Device | str = "auto") -> None:
        self.device = Device.resolve(device)
        self.trace = DeviceTrace(trace_path, self.device)
        self.ledger = TransferLedger(self.device)

    @property
    def activity(self) -> list[Interval]:
        return self.trace.activity

    def __enter__(self) -> ProfiledLedger:
        self.trace.__enter__()
        self.ledger.__enter__()
        return self

    def step(self) -> None:
        self.ledger.step()

    def __exit__(self, *exc: object) -> None:
        self.ledger.__exit__(*exc)
        self.trace.__exit__(*exc)

    def comparison(self) -> list[CopyComparison]:
        totals = self.ledger.summary().totals
        rows = []
        for kind in COPY_KINDS:
            copies = [a for a in self.activity if a.kind == kind]
            rows.append(
                CopyComparison(
                    kind,
                    getattr(totals, f"{kind}_copies"),
                    getattr(totals, f"{kind}_bytes"),
                    len(copies),
                    sum(a.nbytes for a in copies),
                    compared=kind in ("h2d", "d2h") and self.device.type == "cuda",
                )
            )
        return rows
