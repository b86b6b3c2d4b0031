"""Device -> host traffic that the training loop needs: scalars and state snapshots.

``AsyncScalars`` keeps running sums of training scalars on the device and brings them
back every few steps through a pinned buffer, copied on the device's stream and read one
interval later, so the steady-state step never makes the host wait. ``host_snapshot`` takes
a consistent host copy of a state dict (for checkpoints), all copies queued before one wait.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gpuflow.device import Device


class AsyncScalars:
    """Sums of named scalars accumulated on ``device``, read back without stalling.

    ``add`` queues device-side additions only. ``flush`` starts a non-blocking copy of the
    sums into a ring of pinned host buffers, resets them, and returns the results of earlier
    flushes whose copies have finished, so on an accelerator the numbers arrive an interval
    late and the host never waits. ``drain`` waits for everything still in flight: for the end
    of a run or a checkpoint.
    """

    def __init__(self, names: Sequence[str], device: Device, depth: int = 2) -> None:
        self.names = tuple(names)
        self.device = device
        self._sums = torch.zeros(len(self.names), dtype=torch.float32, device=device.torch)
        self._count = 0
        pin = device.supports_pinned_memory
        # A small ring: slot k is rewritten only after the result it held has been read.
        self._host = [
            torch.zeros(len(self.names), dtype=torch.float32, pin_memory=pin)
            for _ in range(max(depth, 1))
        ]
        self._pending: list[tuple[int, int, object, int]] = []  # (slot, tag, event, count)
        self._next_slot = 0

    def add(self, **values: torch.Tensor) -> None:
        """Accumulate one 0-d device tensor per name; queues device work only, never syncs."""
        if set(values) != set(self.names):
            raise ValueError(f"add() takes exactly {self.names}, got {tuple(values)}")
        self._sums += torch.stack([values[name].detach().float() for name in self.names])
        self._count += 1

    def flush(self, tag: int) -> list[tuple[int, dict[str, float]]]:
        """Start copying the means since the last flush (labelled ``tag``) to the host, and
        return ``(tag, means)`` for every earlier flush whose copy has completed.

        On the cpu the copy is synchronous, so the current means come back at once.
        """
        ready = []
        if self._count:
            if len(self._pending) == len(self._host):
                ready = self._collect(wait_for=1)  # free the oldest slot; its copy is old
            slot = self._next_slot
            self._next_slot = (slot + 1) % len(self._host)
            self._host[slot].copy_(self._sums, non_blocking=self.device.is_accelerator)
            self._pending.append((slot, tag, self._record_event(), self._count))
            self._sums.zero_()  # stream-ordered after the copy's read
            self._count = 0
        return ready + self._collect(wait_for=0)

    def drain(self, tag: int) -> list[tuple[int, dict[str, float]]]:
        """Flush and wait for everything: all results not yet returned, in order."""
        ready = self.flush(tag)
        return ready + self._collect(wait_for=len(self._pending))

    def _record_event(self) -> object:
        if self.device.type in ("cuda", "xpu"):
            event = self.device.backend.Event()
            event.record()
            return event
        return None  # cpu copies are synchronous; mps copies complete on synchronize()

    def _collect(self, wait_for: int) -> list[tuple[int, dict[str, float]]]:
        """Read the oldest ``wait_for`` pending results (waiting if needed), plus any more
        whose copies have already finished."""
        out = []
        while self._pending:
            slot, tag, event, count = self._pending[0]
            must_wait = len(out) < wait_for
            if event is not None:
                if not must_wait and not event.query():
                    break
                event.synchronize()
            elif self.device.type == "mps":
                if not must_wait:
                    break
                self.device.synchronize()
            self._pending.pop(0)
            values = self._host[slot].tolist()
            out.append((tag, {n: v / count for n, v in zip(self.names, values, strict=True)}))
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
        Device(device.type, device.index or 0).synchronize()
    return out


def read_now(tensor: torch.Tensor) -> list:
    """A blocking read of a small device tensor as a flat Python list: for evaluation and
    end-of-run results, never for the training step's hot path."""
    return tensor.detach().cpu().flatten().tolist()
