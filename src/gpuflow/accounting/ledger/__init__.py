"""Every bus crossing, host sync and device allocation in a region, counted with its source.

    with gpuflow.TransferLedger() as ledger:
        for step in range(20):
            train_step()
            ledger.step()                 # closes one step
    print(ledger.summary().table())      # totals, per-step medians, top locations

What it counts and how, what it cannot see, and what it costs: docs/architecture/ledger.md.
The modules beside this one count for it: ``records`` (what is counted), ``frames`` (where),
``threads`` (for which ledgers), ``dispatch`` (the counting kernels) and ``patches`` (what an
open ledger wraps in torch).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuflow.accounting import tally
from gpuflow.accounting.ledger.dispatch import _keep_out_of_dynamo, _record_reported
from gpuflow.accounting.ledger.frames import caller_location
from gpuflow.accounting.ledger.patches import (
    _install_waits,
    _remove_waits,
    _start_inference_counter,
    _stop_inference_counter,
)
from gpuflow.accounting.ledger.records import (
    COPY_KINDS,
    LedgerSummary,
    StepTotals,
    TransferEvent,
    _Allocator,
)
from gpuflow.accounting.ledger.threads import _carry, _state, _uncarry
from gpuflow.device.accelerator import Device

__all__ = [
    "COPY_KINDS",
    "LedgerSummary",
    "StepTotals",
    "TransferEvent",
    "TransferLedger",
    "caller_location",
]


@dataclass(eq=False)  # a ledger is a region: two are never the same because they counted alike
class TransferLedger:
    """See the module docstring. Ledgers nest, in any order of exit: an operation counts in
    every open ledger of its thread. ``device`` is whose allocator statistics are read."""

    device: Device | str = "auto"
    # Whether reads of host tensors count as the syncs they would be on a GPU: for the cpu
    # only; a ledger for an accelerator counts what waits on it.
    host_reads: bool = field(default=False, init=False)
    _events: list[TransferEvent] = field(default_factory=list, init=False, repr=False)
    _steps: list[StepTotals] = field(default_factory=list, init=False, repr=False)
    _step: int = field(default=0, init=False, repr=False)
    _step_start: int = field(default=0, init=False, repr=False)
    _open: bool = field(default=False, init=False, repr=False)
    # Sees each event as it is counted; an exception it returns is raised at the operation
    # (a budget with at_site=True).
    _watch: Callable[[TransferEvent], Exception | None] | None = field(
        default=None, init=False, repr=False
    )

    def __post_init__(self) -> None:
        self.device = Device.resolve(self.device)
        self.host_reads = self.device.type == "cpu"

    def __enter__(self) -> TransferLedger:
        if self._open:
            raise RuntimeError("this TransferLedger is already open")
        _keep_out_of_dynamo()
        self._allocator = _Allocator(self.device)
        self._region_start = dict(self._allocator.last)
        _install_waits()
        try:
            if not _state.recording:
                tally.listen(_record_reported)
                _state.recording = True
                _carry()
            _state.ledgers.append(self)
            _start_inference_counter(self)  # opened inside inference mode
        except BaseException:
            self._leave()
            raise
        self._open = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._leave()
        self._region_end = self._allocator.read()
        if self._step_start < len(self._events) or not self._steps:
            self.step()  # the events since the last step() form a last step
        self._open = False

    def _leave(self) -> None:
        """Whatever happens, the thread's last ledger out takes the recorder with it."""
        try:
            _state.ledgers[:] = [ledger for ledger in _state.ledgers if ledger is not self]
            _stop_inference_counter(self, is_ledger=True)
        finally:
            try:
                if _state.recording and not _state.ledgers:
                    _state.recording = False
                    try:
                        tally.stop_listening(_record_reported)
                    finally:
                        _uncarry()
            finally:
                _remove_waits()

    def step(self) -> StepTotals:
        """Close the current step; returns its totals."""
        events = self._events[self._step_start :]
        totals = StepTotals.of(events, self._allocator.delta() if self._open else {})
        self._steps.append(totals)
        self._step += 1
        self._step_start = len(self._events)
        return totals

    @property
    def events(self) -> list[TransferEvent]:
        return list(self._events)

    def summary(self, top: int = 5) -> LedgerSummary:
        end = getattr(self, "_region_end", None) or self._allocator.read()
        allocator = _Allocator.between(self._region_start, end)
        by_bytes: Counter[str] = Counter()
        by_syncs: Counter[str] = Counter()
        for e in self._events:
            if e.kind == "sync":
                by_syncs[e.location] += 1
            else:
                by_bytes[e.location] += e.nbytes
        return LedgerSummary(
            StepTotals.of(self._events, allocator),
            list(self._steps),
            by_bytes.most_common(top),
            by_syncs.most_common(top),
        )
