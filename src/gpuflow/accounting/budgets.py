"""Transfer budgets: fail loudly when a region moves, waits or allocates more than it may.

    with gpuflow.budget(h2d_bytes=2 * tokens, syncs=0):
        train_step(batch)             # BudgetExceeded lists each offending operation

    @gpuflow.budget(d2h_bytes=0)      # checked on every call
    def step(): ...

    with gpuflow.budget(syncs=0, at_site=True):
        train_step(batch)             # raises at the first host wait, with its traceback

When each limit is checked, what ``syncs`` counts on the cpu, and the pytest marker and
fixture: docs/architecture/ledger.md (Budgets).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from gpuflow.accounting.ledger import StepTotals, TransferEvent, TransferLedger
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device

_F = TypeVar("_F", bound=Callable[..., Any])
_SHOWN = 10  # offending operations listed per exceeded limit

# limit name -> (the total it bounds, which events make it up)
_LIMITS: dict[str, tuple[str, Callable[[TransferEvent], bool]]] = {
    "h2d_bytes": ("h2d_bytes", lambda e: e.kind == "h2d"),
    "d2h_bytes": ("d2h_bytes", lambda e: e.kind == "d2h"),
    "d2d_bytes": ("d2d_bytes", lambda e: e.kind == "d2d"),
    "disk2d_bytes": ("disk2d_bytes", lambda e: e.kind == "disk2d"),
    "syncs": ("syncs", lambda e: e.kind == "sync"),
    "device_allocs": ("device_allocs", lambda e: False),  # from allocator counters
}


class BudgetExceeded(GpuflowError):
    """A region went over its transfer budget; ``over`` maps each limit to (used, allowed)
    and ``events`` holds the operations that count against the exceeded limits."""

    def __init__(self, over: dict[str, tuple[int, int]], events: list[TransferEvent]) -> None:
        self.over = over
        self.events = events
        lines = ["transfer budget exceeded:"]
        for name, (used, allowed) in over.items():
            lines.append(f"  {name}: {used:,} > {allowed:,}")
            offending = [e for e in events if _LIMITS[name][1](e)]
            lines += [f"    {e.describe()}" for e in offending[:_SHOWN]]
            if len(offending) > _SHOWN:
                lines.append(f"    ... and {len(offending) - _SHOWN} more")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Budget:
    h2d_bytes: int | None = None
    d2h_bytes: int | None = None
    d2d_bytes: int | None = None
    syncs: int | None = None
    device_allocs: int | None = None
    disk2d_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in _LIMITS:
            value = getattr(self, name)
            whole = isinstance(value, int) and not isinstance(value, bool)
            if value is not None and (not whole or value < 0):
                raise GpuflowError(f"budget {name} must be a whole number >= 0, got {value!r}")

    def check(self, totals: StepTotals, events: list[TransferEvent]) -> None:
        over = {}
        for name, (total, _) in _LIMITS.items():
            allowed = getattr(self, name)
            used = getattr(totals, total)
            if allowed is not None and used > allowed:
                over[name] = (used, allowed)
        if over:
            raise BudgetExceeded(over, events)


class _OpenRegions(threading.local):
    """A budget's open regions on each thread, innermost last: one budget may guard regions
    on several threads at once, and each thread's exit closes its own."""

    def __init__(self) -> None:
        self.regions: list[Any] = []


class budget:  # lower case: used like a function, ``with budget(...)`` or ``@budget(...)``
    """See the module docstring. ``device`` is whose allocator counts ``device_allocs``."""

    def __init__(
        self,
        *,
        h2d_bytes: int | None = None,
        d2h_bytes: int | None = None,
        d2d_bytes: int | None = None,
        syncs: int | None = None,
        device_allocs: int | None = None,
        disk2d_bytes: int | None = None,
        device: Device | str = "auto",
        at_site: bool = False,
    ) -> None:
        self.limits = Budget(h2d_bytes, d2h_bytes, d2d_bytes, syncs, device_allocs, disk2d_bytes)
        self.device = device
        self.at_site = at_site
        self.ledger: TransferLedger | None = None  # the last checked region's ledger
        self._open = _OpenRegions()

    @contextmanager
    def _region(self) -> Iterator[TransferLedger]:
        ledger = TransferLedger(self.device)
        if self.at_site:
            ledger._watch = self._watcher()
        self.ledger = ledger
        with ledger:
            yield ledger
        summary = ledger.summary()
        self.limits.check(summary.totals, ledger.events)

    def _watcher(self) -> Callable[[TransferEvent], Exception | None]:
        """Running totals of one region; the error for the event that goes over a limit."""
        used = dict.fromkeys(_LIMITS, 0)

        def watch(event: TransferEvent) -> Exception | None:
            for name, (_, counts) in _LIMITS.items():
                allowed = getattr(self.limits, name)
                if allowed is None or not counts(event):
                    continue
                used[name] += 1 if name == "syncs" else event.nbytes
                if used[name] > allowed:
                    return BudgetExceeded({name: (used[name], allowed)}, [event])
            return None

        return watch

    def __enter__(self) -> TransferLedger:
        region = self._region()
        ledger = region.__enter__()
        self._open.regions.append(region)  # a budget entered again, nested, checks both regions
        return ledger

    def __exit__(self, *exc: Any) -> bool | None:
        return self._open.regions.pop().__exit__(*exc)

    def __call__(self, fn: _F) -> _F:
        later = (
            inspect.isgeneratorfunction,
            inspect.iscoroutinefunction,
            inspect.isasyncgenfunction,
        )
        if any(runs_later(fn) for runs_later in later):
            # Calling one runs none of its body: the region would check nothing.
            raise TypeError(
                f"@budget cannot check {fn.__name__}: a generator or async function's body "
                "runs after the call returns; put `with budget(...):` inside it instead"
            )

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            with self._region():
                return fn(*args, **kwargs)

        return checked  # type: ignore[return-value]
