"""Device -> host traffic: cached host views of device tensors, and the reads that wait.

``HostMirror`` keeps a host copy of a device tensor. It serves reads from that copy only
while it can vouch that the device copy has not changed: by default it cannot (PyTorch does
not signal every write), so every whole read fetches again; with ``writes="tracked"`` the
user vouches that every write is one PyTorch signals, and the mirror fetches only after one.
Reading never invalidates the device copy, and reading one element of a stale mirror
fetches that element, not the tensor. ``host_snapshot`` takes a host copy of a state dict
with one wait; ``read_now`` and ``host_copy_now`` are the other reads that wait, named so at
their call sites. Snapshots that do not wait (a checkpoint's) are
``gpuflow.transfer.snapshot``'s, training scalars ``gpuflow.transfer.scalars``'.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device

Writes = Literal["unknown", "tracked"]
_WRITES = ("unknown", "tracked")


@dataclass(frozen=True)
class MirrorStats:
    hits: int  # reads served from the host copy
    misses: int  # reads that had to fetch (whole or partial)
    bytes_fetched: int  # device -> host bytes, prefetches included


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def _numpy_only(index: Any) -> bool:
    """Whether ``index`` holds a slice with a negative step, which numpy takes and torch
    refuses."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, slice) and p.step is not None and p.step < 0 for p in parts)


def _host_numpy(tensor: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16, float8 or complex32: those widen to float32 and complex64."""
    if tensor.dtype == torch.complex32:
        tensor = tensor.to(torch.complex64)
    elif tensor.is_floating_point() and tensor.dtype not in _NUMPY_FLOATS:
        tensor = tensor.float()
    return tensor.numpy()


class _OptimizerSteps:
    """Every ``torch.optim`` step in the process, seen by one global post-step hook: fused
    kernels (``AdamW(fused=True)``) write parameters without bumping their version counters,
    so a step is the only signal that they changed. The hook does O(1) host work per step
    (no device work, no sync); mirrors scan an optimizer's parameters only when read."""

    def __init__(self) -> None:
        self.clock = 0  # steps so far, all optimizers
        # By optimizer: a box holding the clock at its last step (shared with its finalizer).
        self._last: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[int]] = (
            weakref.WeakKeyDictionary()
        )
        # An optimizer dropped after stepping leaves its last step against its parameters'
        # storages, or a mirror read later would not know they were written.
        self._retired: dict[int, int] = {}
        self._handle: Any = None

    def watch(self) -> None:
        if self._handle is None:
            self._handle = register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.clock += 1
        box = self._last.get(optimizer)
        if box is None:
            box = self._last[optimizer] = [self.clock]
            # The group list, not the optimizer: it keeps nothing alive the optimizer does not.
            weakref.finalize(optimizer, self._retire, optimizer.param_groups, box)
        box[0] = self.clock

    def _retire(self, param_groups: list[dict[str, Any]], box: list[int]) -> None:
        for group in param_groups:
            for p in group["params"]:
                storage = p.untyped_storage()._cdata
                self._retired[storage] = max(self._retired.get(storage, 0), box[0])

    def touched(self, storage_id: int, since: int) -> bool:
        """Whether an optimizer holding a tensor on storage ``storage_id`` stepped after
        ``since`` (one dropped since included)."""
        if self._retired.get(storage_id, 0) > since:
            return True
        for optimizer, box in list(self._last.items()):
            if box[0] > since and any(
                p.untyped_storage()._cdata == storage_id
                for group in optimizer.param_groups
                for p in group["params"]
            ):
                return True
        return False


_STEPS = _OptimizerSteps()


@dataclass(slots=True)
class _Stamp:
    """What PyTorch tells about a tensor at one moment: a later moment with the same stamp
    has had no write that PyTorch signals."""

    key: tuple | None  # version, storage, place and layout; None: PyTorch tells nothing
    storage: StorageWeakRef | None  # keeps the storage's address from reuse while compared
    clock: int  # optimizer steps checked up to

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Stamp:
        key = _key(tensor)
        storage = None if key is None else StorageWeakRef(tensor.untyped_storage())
        return cls(key, storage, _STEPS.clock)

    def holds_for(self, tensor: torch.Tensor) -> bool:
        """Whether no signalled write reached ``tensor`` since this stamp was taken."""
        if self.key is None or _key(tensor) != self.key:
            return False
        now = _STEPS.clock
        if now != self.clock:
            if _STEPS.touched(self.key[1], self.clock):
                return False
            self.clock = now  # none of those steps held it: do not scan them again
        return True


def _key(tensor: torch.Tensor) -> tuple | None:
    """Everything PyTorch tells about a tensor's contents without reading them; None for a
    tensor with no version counter (inference mode) or no single storage (sparse)."""
    if tensor.is_inference() or tensor.layout != torch.strided:
        return None
    storage = tensor.untyped_storage()
    return (
        tensor._version,  # in-place ops through the tensor, its views and .detach()
        storage._cdata,  # `p.data = t`, `p.set_(t)`: another storage
        storage.data_ptr(),  # `p.data.resize_(n)`: new memory in the same storage
        storage.nbytes(),
        tensor.storage_offset(),
        tuple(tensor.shape),  # resize_
        tensor.stride(),
        tensor.dtype,
        tensor.device,
    )


class HostMirror:
    """A cached, read-only host copy of a device tensor.

        mirror = HostMirror(weights)
        mirror.numpy()        # fetches the tensor
        mirror[3]             # fetches only row 3 (or reads it from a copy known fresh)
        mirror.refresh_async(); ...; mirror.numpy()   # the copy ran while the host worked

    A mirror claims to be fresh (``is_fresh``) only when it can vouch that the tensor has
    not changed since its copy. ``writes`` says what it may rely on:

    - ``"unknown"`` (default): nothing. Writes through ``.data`` or other aliases, fused
      kernels and CUDA graph replays change memory without any signal PyTorch gives, so the
      mirror never claims to be fresh and every whole read fetches again.
    - ``"tracked"``: the user vouches that every write to the tensor is one PyTorch signals,
      or is followed by ``mark_dirty()``. Signalled are in-place ops on the tensor, its views
      or ``.detach()`` (version counter), the step of any ``torch.optim`` optimizer holding
      it, fused or not (a step hook), and a new or resized storage behind the same tensor
      (``p.data = t``, ``p.set_(t)``, ``resize_``). Not signalled, so ``mark_dirty()`` after
      them: writes through ``p.data`` or another alias, CUDA graph replays, optimizer steps
      inside a replayed graph, kernels writing through ``data_ptr``.

    ``numpy()`` after ``refresh_async()`` returns the tensor as it was at the refresh
    (stream order), unless a signalled write came since. Views handed out are read-only
    numpy arrays, so reading can never stand for writing. An array from ``numpy()`` shares
    the mirror's buffer: it stays valid until the next ``refresh_async`` or stale read. One
    from indexing (``mirror[i]``, ``mirror[a:b]``) is its own, the values as they were read.
    """

    def __init__(self, tensor: torch.Tensor, *, writes: Writes = "unknown") -> None:
        if writes not in _WRITES:
            raise ValueError(f"HostMirror(writes=...) takes one of {_WRITES}, got {writes!r}")
        self.writes = writes
        # The object itself, not a view of its memory now: `p.data = t` and `p.set_(t)`
        # change what it holds, and the mirror follows.
        self._source = tensor
        self.device = Device.of(tensor.device)
        self._host: torch.Tensor | None = None
        self._copied: _Stamp | None = None  # the tensor as _host holds it
        self._staged: tuple[Any, _Stamp] | None = None  # (event, stamp) of a refresh in flight
        self._counts = {"hits": 0, "misses": 0, "bytes_fetched": 0}
        if writes == "tracked":
            _STEPS.watch()

    def __reduce__(self) -> Any:
        raise GpuflowError(
            "a HostMirror cannot be copied or pickled: it vouches for one tensor in this "
            "process; make a new HostMirror over the tensor (or copy mirror.numpy())"
        )

    @property
    def tensor(self) -> torch.Tensor:
        """The mirrored tensor as it is now, detached: same memory, outside autograd."""
        return self._source.detach()

    @property
    def stats(self) -> MirrorStats:
        return MirrorStats(**self._counts)

    def is_fresh(self) -> bool:
        """Whether the host copy is known to equal the tensor (never guessed: always False
        with ``writes="unknown"``)."""
        return (
            self.writes == "tracked"
            and self._copied is not None
            and self._copied.holds_for(self._source)
        )

    def mark_dirty(self) -> None:
        """The device copy changed in a way PyTorch does not signal."""
        self._copied = None
        self._staged = None

    def refresh_async(self) -> None:
        """Queue a copy of the whole tensor into pinned memory and return at once.

        The copy is queued on the current stream, after the work that writes the tensor and
        before any later write to it; the next read waits only for this copy's event.
        """
        if self.is_fresh():
            return
        self._staged = self._queue_copy()

    def numpy(self) -> np.ndarray:
        """The whole tensor on the host, read-only."""
        self._ensure_whole()
        return _read_only(_host_numpy(self._host))

    def tolist(self) -> list:
        return self.numpy().tolist()

    def __getitem__(self, index: Any) -> Any:
        """An element or slice, as it is now, in an array of its own (a later write or
        refresh does not change it): from the host copy when fresh, else fetching just those
        bytes (one small copy, no caching of the rest)."""
        if self._adopt_staged() or self.is_fresh():
            self._counts["hits"] += 1
            part = _host_numpy(self._host)[index].copy()  # the host copy is refreshed in place
        elif _numpy_only(index):  # (a negative step): torch cannot cut those bytes alone
            self._ensure_whole()
            part = _host_numpy(self._host)[index].copy()
        else:
            piece = self.tensor[index]
            self._counts["misses"] += 1
            self._counts["bytes_fetched"] += piece.nbytes
            # .to() copies even where the tensor is on the cpu already (.cpu() would alias it)
            part = _host_numpy(piece.detach().to("cpu", copy=True))
        return part.item() if part.ndim == 0 else _read_only(part)

    def _queue_copy(self) -> tuple[Any, _Stamp]:
        tensor = self.tensor
        stamp = _Stamp.of(self._source)  # before the copy: a write after it moves the stamp
        if tensor.device != self.device.torch:  # `p.data = t` may move it
            self.device = Device.of(tensor.device)
        pin = self.device.supports_pinned_memory
        host = self._host
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        self._copied = None  # the buffer is being overwritten
        host.copy_(tensor, non_blocking=self.device.is_accelerator)
        event = self.device.new_event()
        event.record()
        self._counts["bytes_fetched"] += tensor.nbytes
        return event, stamp

    def _adopt_staged(self) -> bool:
        """Make a finished (or finishing) refresh the host copy, if no signalled write came
        after it was queued."""
        if self._staged is None:
            return False
        event, stamp = self._staged
        self._staged = None
        if not stamp.holds_for(self._source):
            return False  # the tensor changed after the refresh was queued
        event.synchronize()
        self._copied = stamp
        return True

    def _ensure_whole(self) -> None:
        if self.is_fresh():
            self._counts["hits"] += 1
            return
        if self._adopt_staged():
            self._counts["hits"] += 1  # fetched by the refresh, counted there
            return
        event, stamp = self._queue_copy()
        event.synchronize()
        self._copied = stamp
        self._counts["misses"] += 1


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
