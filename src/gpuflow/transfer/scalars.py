"""``AsyncScalars``: running sums of training scalars kept on the device, brought back every
few steps through pinned memory without making the host wait."""

from __future__ import annotations

import numbers
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gpuflow.device.accelerator import Device


def _scalar_names(names: str | Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple, checked: a lone str is one name (iterating it would give its
    letters); names are non-empty strings, each once."""
    names = (names,) if isinstance(names, str) else tuple(names)
    if not names:
        raise ValueError("AsyncScalars needs at least one name, e.g. AsyncScalars('loss')")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"AsyncScalars names are str, got {name!r} in {names}")
        if not name:
            raise ValueError(f"AsyncScalars names must not be empty, got {names}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"AsyncScalars names must differ: {repeated} given more than once")
    return names


class AsyncScalars:
    """Sums of named scalars accumulated on ``device``, read back without stalling.

    ``names`` is one name (``"loss"``) or several, each a distinct non-empty str. ``add``
    queues device-side additions only. ``flush`` starts a non-blocking copy of the
    sums into a ring of pinned host buffers, resets them, and returns the means of earlier
    flushes whose copies have finished, so on an accelerator the numbers arrive an interval
    late and the host never waits. ``drain`` waits for everything still in flight: for the end
    of a run or a checkpoint. Sums are float64; each name's mean is over the ``add`` calls
    that gave it (a name given in none is left out of that flush's means).
    """

    def __init__(
        self,
        names: str | Sequence[str],
        device: Device | torch.device | str | int = "auto",
        depth: int = 2,
    ) -> None:
        self.names = _scalar_names(names)
        self.device = Device.resolve(device)
        self._index = {name: i for i, name in enumerate(self.names)}
        n = len(self.names)
        self._sums = torch.zeros(n, dtype=torch.float64, device=self.device.torch)  # (n,)
        self._host_sums = np.zeros(n)  # host values (floats, host tensors): no copy needed
        self._counts = np.zeros(n, dtype=np.int64)  # per name
        pin = self.device.supports_pinned_memory
        # A small ring: slot k is rewritten only after the result it held has been read.
        self._host = [
            torch.zeros(n, dtype=torch.float64, pin_memory=pin) for _ in range(max(depth, 1))
        ]
        # (slot, tag, event, counts, host sums) per flush in flight
        self._pending: list[tuple[int, int, Any, np.ndarray, np.ndarray]] = []
        self._next_slot = 0
        # add, flush and drain one at a time: sums added from several threads (a metric
        # counted where it is made) would otherwise lose some of their additions.
        self._lock = threading.Lock()

    def add(self, **values: torch.Tensor | float) -> None:
        """Accumulate one value per name given (any subset of ``names``): a 0-d or
        one-element tensor, on the device (device work only, never a sync) or the host, or a
        Python number."""
        unknown = set(values) - set(self.names)
        if unknown:
            raise ValueError(f"add() takes names from {self.names}, got {sorted(unknown)}")
        with self._lock:
            self._add(values)

    def _add(self, values: dict[str, torch.Tensor | float]) -> None:
        # Every value checked before any is summed: a refused call adds nothing.
        on_device, on_host = {}, {}
        for name, value in values.items():
            if (value.is_complex() if isinstance(value, torch.Tensor)
                    else not isinstance(value, numbers.Real)):  # fmt: skip
                raise ValueError(f"add({name}=...) takes a real number, got {value!r}")
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"add({name}=...) takes one number; got a tensor of shape "
                        f"{tuple(value.shape)} (reduce it first, e.g. .mean())"
                    )
                if value.device.type != "cpu":
                    on_device[name] = value
                    continue
                value = value.detach().reshape(()).item()  # a host tensor: no wait
            on_host[name] = float(value)
        for name, number in on_host.items():
            self._host_sums[self._index[name]] += number
        if len(on_device) == len(self.names):
            self.accumulate(**on_device)
        else:
            for name, value in on_device.items():
                i = self._index[name]
                self._sums[i : i + 1] += value.detach().reshape(1).double()
        for name in values:
            self._counts[self._index[name]] += 1

    def accumulate(self, **values: torch.Tensor) -> None:
        """Device work alone, for a CUDA graph to capture: one 0-d device tensor for every
        name, not counted; ``count`` then tells how many times it ran."""
        if set(values) != set(self.names):
            raise ValueError(f"accumulate() takes exactly {self.names}, got {tuple(values)}")
        self._sums += torch.stack(
            [values[name].detach().reshape(()).double() for name in self.names]
        )

    def count(self, n: int = 1) -> None:
        """``n`` more steps were summed by ``accumulate`` (or a graph replaying it)."""
        with self._lock:
            self._counts += n

    def flush(self, tag: int) -> list[tuple[int, dict[str, float]]]:
        """Start copying the means since the last flush (labelled ``tag``) to the host, and
        return ``(tag, means)`` for every earlier flush whose copy has completed.

        On the cpu the copy is synchronous, so the current means come back at once.
        """
        with self._lock:
            return self._flush(tag)

    def _flush(self, tag: int) -> list[tuple[int, dict[str, float]]]:
        ready = []
        if self._counts.any():
            if len(self._pending) == len(self._host):
                ready = self._collect(wait_for=1)  # free the oldest slot; its copy is old
            slot = self._next_slot
            self._next_slot = (slot + 1) % len(self._host)
            self._host[slot].copy_(self._sums, non_blocking=self.device.is_accelerator)
            event = self._record_event()
            self._pending.append((slot, tag, event, self._counts.copy(), self._host_sums.copy()))
            self._sums.zero_()  # stream-ordered after the copy's read
            self._counts[:] = 0
            self._host_sums[:] = 0.0
        return ready + self._collect(wait_for=0)

    def drain(self, tag: int) -> list[tuple[int, dict[str, float]]]:
        """Flush and wait for everything: all results not yet returned, in order."""
        with self._lock:
            ready = self._flush(tag)
            return ready + self._collect(wait_for=len(self._pending))

    def _record_event(self) -> Any:
        event = self.device.new_event()
        event.record()
        return event

    def _collect(self, wait_for: int) -> list[tuple[int, dict[str, float]]]:
        """Read the oldest ``wait_for`` pending results (waiting if needed), plus any more
        whose copies have already finished."""
        out = []
        while self._pending:
            slot, tag, event, counts, host_sums = self._pending[0]
            done = event.query()
            if len(out) >= wait_for and not done:
                break
            if not done:  # a wait only where the copy is still running
                event.synchronize()
            self._pending.pop(0)
            sums = self._host[slot].numpy() + host_sums
            means = {n: float(s / c) for n, s, c in zip(self.names, sums, counts, strict=True) if c}
            out.append((tag, means))
        return out
