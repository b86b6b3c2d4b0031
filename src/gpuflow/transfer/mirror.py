"""Device -> host traffic: cached host views, training scalars and state snapshots.

``HostMirror`` keeps a host copy of a device tensor and fetches again only when the device
copy has changed (its version counter moved, or ``mark_dirty`` said so); reading it never
invalidates the device copy, and reading one element of a stale mirror fetches that element,
not the tensor. ``AsyncScalars`` keeps running sums of training scalars on the device and
brings them back every few steps through pinned memory without making the host wait.
``host_snapshot`` takes a host copy of a state dict (for checkpoints) with one wait.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuflow.device.accelerator import Device


@dataclass(frozen=True)
class MirrorStats:
    hits: int  # reads served from the host copy
    misses: int  # reads that had to fetch (whole or partial)
    bytes_fetched: int  # device -> host bytes, prefetches included


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _host_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        tensor = tensor.float()
    return tensor.numpy()


class HostMirror:
    """A cached, read-only host copy of a device tensor.

        mirror = HostMirror(weights)
        mirror.numpy()        # fetches once; again only after weights change
        mirror[3]             # stale: fetches only row 3; fresh: served from the copy
        mirror.refresh_async(); ...; mirror.numpy()   # the copy ran while the host worked

    Freshness follows ``tensor._version``, which every in-place op bumps. A CUDA graph
    replay writes memory without bumping it: call ``mark_dirty()`` after one. Views handed
    out are read-only numpy arrays, so reading can never stand for writing (the seed's
    ``data()`` that re-uploaded on every read). An array from ``numpy()`` shares the mirror's
    buffer: it stays valid until the next ``refresh_async`` or stale read.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        # Read through a detached view: same memory and version counter, so a parameter
        # (requires_grad) mirrors like any tensor and the copies never enter autograd.
        self.tensor = tensor.detach()
        self.device = Device.of(tensor.device)
        self._host: torch.Tensor | None = None
        self._host_version: int | None = None  # tensor._version when _host was copied
        self._staged: tuple[Any, int] | None = None  # (event, version) of a refresh in flight
        self._counts = {"hits": 0, "misses": 0, "bytes_fetched": 0}

    @property
    def stats(self) -> MirrorStats:
        return MirrorStats(**self._counts)

    def is_fresh(self) -> bool:
        return self._host is not None and self._host_version == self.tensor._version

    def mark_dirty(self) -> None:
        """The device copy changed in a way its version counter cannot see."""
        self._host_version = None
        self._staged = None

    def refresh_async(self) -> None:
        """Queue a copy of the whole tensor into pinned memory and return at once.

        The copy is queued on the current stream, after the work that writes the tensor and
        before any later write to it; the next read waits only for this copy's event.
        """
        if self.is_fresh():
            return
        if self._host is None:
            self._host = torch.empty(
                self.tensor.shape,
                dtype=self.tensor.dtype,
                pin_memory=self.device.supports_pinned_memory,
            )
        self._host.copy_(self.tensor, non_blocking=self.device.is_accelerator)
        event = self.device.new_event()
        event.record()
        self._staged = (event, self.tensor._version)
        self._counts["bytes_fetched"] += self.tensor.nbytes

    def numpy(self) -> np.ndarray:
        """The whole tensor on the host, read-only."""
        self._ensure_whole()
        return _read_only(_host_numpy(self._host))

    def tolist(self) -> list:
        return self.numpy().tolist()

    def __getitem__(self, index: Any) -> Any:
        """An element or slice: from the host copy when fresh, else fetching just those
        bytes (one small copy, no caching of the rest)."""
        if self._adopt_staged() or self.is_fresh():
            self._counts["hits"] += 1
            part = _host_numpy(self._host)[index]
        else:
            piece = self.tensor[index]
            self._counts["misses"] += 1
            self._counts["bytes_fetched"] += piece.nbytes
            part = _host_numpy(piece.cpu())
        return part.item() if part.ndim == 0 else _read_only(part)

    def _adopt_staged(self) -> bool:
        """Make a finished (or finishing) refresh the host copy, if it is still current."""
        if self._staged is None:
            return False
        event, version = self._staged
        self._staged = None
        if version != self.tensor._version:
            return False  # the tensor changed after the refresh was queued
        event.synchronize()
        self._host_version = version
        return True

    def _ensure_whole(self) -> None:
        if self.is_fresh():
            self._counts["hits"] += 1
            return
        if self._adopt_staged():
            self._counts["hits"] += 1  # fetched by the refresh, counted there
            return
        self.refresh_async()
        self._adopt_staged()
        self._counts["misses"] += 1


class AsyncScalars:
    """Sums of named scalars accumulated on ``device``, read back without stalling.

    ``add`` queues device-side additions only. ``flush`` starts a non-blocking copy of the
    sums into a ring of pinned host buffers, resets them, and returns the means of earlier
    flushes whose copies have finished, so on an accelerator the numbers arrive an interval
    late and the host never waits. ``drain`` waits for everything still in flight: for the end
    of a run or a checkpoint. Sums are float64; each name's mean is over the ``add`` calls
    that gave it (a name given in none is left out of that flush's means).
    """

    def __init__(
        self, names: Sequence[str], device: Device | torch.device | str = "auto", depth: int = 2
    ) -> None:
        self.names = tuple(names)
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

    def add(self, **values: torch.Tensor | float) -> None:
        """Accumulate one value per name given (any subset of ``names``): a 0-d or
        one-element tensor, on the device (device work only, never a sync) or the host, or a
        Python number."""
        unknown = set(values) - set(self.names)
        if unknown:
            raise ValueError(f"add() takes names from {self.names}, got {sorted(unknown)}")
        on_device = {}
        for name, value in values.items():
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
            self._host_sums[self._index[name]] += float(value)
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
        self._counts += n

    def flush(self, tag: int) -> list[tuple[int, dict[str, float]]]:
        """Start copying the means since the last flush (labelled ``tag``) to the host, and
        return ``(tag, means)`` for every earlier flush whose copy has completed.

        On the cpu the copy is synchronous, so the current means come back at once.
        """
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
        ready = self.flush(tag)
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


def host_snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors`` (contiguous, detached), all queued before a single wait."""
    out = {}
    device = None
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        if tensor.device.type == "cpu":
            out[name] = tensor.contiguous().clone()
            continue
        device = tensor.device
        host = torch.empty(
            tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type in ("cuda", "xpu")
        )
        host.copy_(tensor, non_blocking=True)
        out[name] = host
    if device is not None:
        Device.of(device).synchronize()
    return out


def host_copy_now(tensor: torch.Tensor) -> torch.Tensor:
    """A blocking host copy of a whole device tensor, into pageable memory: what a naive
    loop does to look at device data (kept for baselines; never in the hot path)."""
    return tensor.detach().to("cpu")


def read_now(tensor: torch.Tensor) -> list:
    """A blocking read of a small device tensor as a flat Python list: for evaluation and
    end-of-run results, never for the training step's hot path."""
    return tensor.detach().cpu().flatten().tolist()
