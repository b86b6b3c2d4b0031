"""``StateSnapshot``: named device tensors copied to the host in one piece, without a host wait.

    snapshots = StateSnapshot(device)
    snap = snapshots.capture({"model": weights, "optimizer": moments})   # no host wait
    ...                                   # more training steps
    snap.wait()                           # on the writer's thread
    write(snap.group_bytes("model")); snap.release()

One snapshot holds the host buffer at a time: the next ``capture`` waits for the release.
Why one packed copy, how it is ordered, and the layout: docs/architecture/crossings.md
(State snapshots).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device

_GROUP_ALIGN = 64  # bytes: each group's region starts on a cache line


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a group's region: ``start`` and ``nbytes`` in bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Where every tensor of every group lies in the flat buffer."""

    groups: dict[str, tuple[Slot, ...]]
    offsets: dict[str, int]  # each group's first byte in the buffer
    sizes: dict[str, int]  # each group's bytes (no padding at its end)

    @classmethod
    def of(cls, groups: Mapping[str, Mapping[str, torch.Tensor]]) -> Layout:
        slots: dict[str, tuple[Slot, ...]] = {}
        offsets, sizes = {}, {}
        position = 0
        _check_groups(groups)
        for group, tensors in groups.items():
            ordered = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
            start, placed = 0, []
            for name, tensor in ordered:
                nbytes = tensor.numel() * tensor.element_size()
                placed.append(Slot(name, tensor.dtype, tuple(tensor.shape), start, nbytes))
                start += nbytes
            position = -(-position // _GROUP_ALIGN) * _GROUP_ALIGN
            slots[group], offsets[group], sizes[group] = tuple(placed), position, start
            position += start
        return cls(slots, offsets, sizes)

    @property
    def nbytes(self) -> int:
        return max((self.offsets[g] + self.sizes[g] for g in self.groups), default=0)


def _check_groups(groups: Any) -> None:
    """Refuse, in one line, anything but {group: {name: tensor}}: a plain state dict, the
    usual slip, would otherwise fail deep inside with an AttributeError."""
    if not isinstance(groups, Mapping):
        raise GpuflowError(
            f"capture takes {{group: {{name: tensor}}}}, got {type(groups).__name__}"
        )
    for group, tensors in groups.items():
        if not isinstance(tensors, Mapping):
            raise GpuflowError(
                f"capture takes {{group: {{name: tensor}}}}; group {group!r} is a "
                f"{type(tensors).__name__}: pass a state dict in a group, as in "
                "capture({'model': model.state_dict()})"
            )
        kinds = {type(name).__name__ for name in tensors}
        if len(kinds) > 1:  # (the tensors are laid out in the order of their names)
            raise GpuflowError(
                f"capture takes names of one type in a group; group {group!r} mixes "
                f"{' and '.join(sorted(kinds))}"
            )
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise GpuflowError(
                    f"capture takes {{group: {{name: tensor}}}}; {group!r}/{name!r} is a "
                    f"{type(tensor).__name__}, not a tensor"
                )
            if tensor.layout != torch.strided:
                raise GpuflowError(
                    f"capture takes dense tensors; {group!r}/{name!r} is {tensor.layout}: "
                    "pass .to_dense() (or its values and indices as tensors of their own)"
                )


class Snapshot:
    """One capture: its layout and host bytes, valid until ``release``."""

    def __init__(
        self, owner: StateSnapshot, layout: Layout, host: torch.Tensor, done: Any, turn: int
    ) -> None:
        self.layout = layout
        self._owner = owner
        self._host = host  # (nbytes,) uint8, pinned where the device has pinned memory
        self._done = done  # event of the device->host copy; None when nothing was on a device
        self._turn = turn  # which hold of the owner's host buffer this is

    @property
    def released(self) -> bool:
        return not self._owner._holds(self._turn)

    def wait(self) -> None:
        """Block until the host bytes are complete (call from the thread that reads them)."""
        self._owner._held_by_this_thread(self._turn)
        if self._done is not None:
            self._done.synchronize()

    def group_bytes(self, group: str) -> memoryview:
        """The group's region of the host buffer, as bytes (after ``wait``)."""
        self._check_held()
        start = self.layout.offsets[group]
        return memoryview(self._host.numpy())[start : start + self.layout.sizes[group]]

    def tensors(self, group: str) -> dict[str, torch.Tensor]:
        """The group's tensors as views of the host buffer (after ``wait``; valid until
        ``release``)."""
        self._check_held()
        base = self.layout.offsets[group]
        return {
            s.name: self._host[base + s.start : base + s.start + s.nbytes]
            .view(s.dtype)
            .view(s.shape)
            for s in self.layout.groups[group]
        }

    def release(self) -> None:
        """The host bytes are no longer needed: the next capture may reuse them. Releasing
        again does nothing (and never frees a later snapshot's buffer)."""
        self._owner._release(self._turn)

    def _check_held(self) -> None:
        if not self._owner._held_by_this_thread(self._turn):
            raise RuntimeError(
                "this snapshot was released: its host bytes belong to the next capture(); "
                "read them before release()"
            )


class StateSnapshot:
    """See the module docstring. One snapshot is outstanding at a time."""

    def __init__(self, device: Device | str = "auto") -> None:
        self.device = Device.resolve(device)
        self._host: torch.Tensor | None = None  # (capacity,) uint8
        self._staging: torch.Tensor | None = None  # (capacity,) uint8 on the device
        self._copy_stream = self.device.new_stream()
        self._hold = threading.Condition()
        self._turn = 0  # captures so far
        self._holder: int | None = None  # the turn whose snapshot holds the host buffer
        self._readers: list[threading.Thread] = []  # threads that took or read it
        self._last_copy: Any = None  # the staging buffer is busy until this event

    def capture(self, groups: Mapping[str, Mapping[str, torch.Tensor]]) -> Snapshot:
        """Queue the copy of ``groups`` ({group: {name: tensor}}) and return at once (after
        the previous snapshot's release: see the module docstring). Host tensors are copied
        now; device tensors are read in stream order, as they are after the work queued so
        far."""
        turn = self._take_host_buffer()
        try:
            layout = Layout.of(groups)
            host = self._host_buffer(layout.nbytes)
            flat = [(g, s, groups[g][s.name]) for g, slots in layout.groups.items() for s in slots]
            on_device = [item for item in flat if item[2].device.type != "cpu"]
            for group, slot, tensor in flat:
                if tensor.device.type == "cpu":
                    begin = layout.offsets[group] + slot.start
                    host[begin : begin + slot.nbytes].view(slot.dtype).copy_(tensor.reshape(-1))
            done = self._copy_device_tensors(layout, on_device, host) if on_device else None
        except BaseException:
            self._release(turn)
            raise
        return Snapshot(self, layout, host, done, turn)

    def _take_host_buffer(self) -> int:
        """Wait for the outstanding snapshot's release while a live thread other than this
        one took or read it (it may still release); with none left, waiting would never end."""
        me = threading.current_thread()
        with self._hold:
            while self._holder is not None:
                if not any(t is not me and t.is_alive() for t in self._readers):
                    raise RuntimeError(
                        "capture() before the previous snapshot's release(): it still holds "
                        "the host buffer and no other live thread that took or read it can "
                        "release it; call release() on it first, or use a second "
                        "StateSnapshot to hold two snapshots at once"
                    )
                self._hold.wait(timeout=0.05)  # a release notifies; polls see dead readers
            self._turn += 1
            self._holder, self._readers = self._turn, [me]
            return self._turn

    def _holds(self, turn: int) -> bool:
        with self._hold:
            return self._holder == turn

    def _held_by_this_thread(self, turn: int) -> bool:
        """Whether snapshot ``turn`` still holds the buffer; if so, this thread may release it."""
        with self._hold:
            if self._holder != turn:
                return False
            me = threading.current_thread()
            if me not in self._readers:
                self._readers.append(me)
            return True

    def _release(self, turn: int) -> None:
        with self._hold:
            if self._holder == turn:
                self._holder, self._readers = None, []
                self._hold.notify_all()

    def _copy_device_tensors(self, layout: Layout, items: list, host: torch.Tensor) -> Any:
        """Pack the device tensors into the staging buffer (one ``cat`` per run of one type,
        on the current stream), then copy it to the host on the side stream: one copy, or
        one per span between host tensors, which were written into the host buffer already.
        Returns the last copy's event."""
        stream = self.device.current_stream()
        spans = _device_spans(layout, items)
        # The staging buffer holds the device spans only, packed (host tensors, such as
        # state gathered from other ranks, may be most of the layout).
        places, staged = _packed(spans)
        staging = self._staging_buffer(staged)
        if staging is None:  # no device memory to spare: copy each tensor, in stream order
            for group, slot, tensor in items:
                begin = layout.offsets[group] + slot.start
                target = host[begin : begin + slot.nbytes].view(slot.dtype)
                target.copy_(tensor.detach().reshape(-1), non_blocking=True)
            done = self.device.new_event()
            done.record(stream)
            return done
        if self._last_copy is not None:
            stream.wait_event(self._last_copy)  # the last copy has read the staging buffer
        span_begins = [begin for begin, _ in spans]
        for run in _runs(layout, items):
            begin, end, dtype = run[0][0], run[-1][0] + run[-1][1].nbytes, run[0][1].dtype
            span = bisect.bisect_right(span_begins, begin) - 1  # the span holding the run
            at = places[span] + begin - spans[span][0]
            pieces = [t.detach().reshape(-1) for _, _, t in run]
            torch.cat(pieces, out=staging[at : at + end - begin].view(dtype))
        packed = self.device.new_event()
        packed.record(stream)
        self._copy_stream.wait_event(packed)
        with self.device.use_stream(self._copy_stream):
            for (begin, end), at in zip(spans, places, strict=True):
                host[begin:end].copy_(staging[at : at + end - begin], non_blocking=True)
            done = self.device.new_event()
            done.record(self._copy_stream)
        self._last_copy = done
        return done

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self._host is None or self._host.numel() < nbytes:
            self._host = None  # let the old one go before pinning the new one
            self._host = self.device.pinned_empty(nbytes)
        return self._host

    def _staging_buffer(self, nbytes: int) -> torch.Tensor | None:
        """The device buffer the state is packed into (kept for the next capture), or None
        when the device has no room for it."""
        if self._staging is None or self._staging.numel() < nbytes:
            if self._last_copy is not None:
                self._last_copy.synchronize()  # the old buffer may still be read by a copy
            self._staging = None
            try:
                self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device.torch)
            except torch.OutOfMemoryError:
                return None
        return self._staging

    def close(self) -> None:
        """Wait for the copy in flight and let both buffers go."""
        if self._last_copy is not None:
            self._last_copy.synchronize()
        self._host = self._staging = self._last_copy = None


def _runs(layout: Layout, items: list) -> list[list[tuple[int, Slot, torch.Tensor]]]:
    """Device tensors grouped into runs that lie end to end in the buffer with one type."""
    runs: list[list[tuple[int, Slot, torch.Tensor]]] = []
    for group, slot, tensor in items:
        begin = layout.offsets[group] + slot.start
        if runs:
            prev_begin, prev_slot, _ = runs[-1][-1]
            if prev_slot.dtype == slot.dtype and prev_begin + prev_slot.nbytes == begin:
                runs[-1].append((begin, slot, tensor))
                continue
        runs.append([(begin, slot, tensor)])
    return runs


def _packed(spans: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Where each span lies in the staging buffer, end to end, each at the same place
    modulo ``_GROUP_ALIGN`` as in the layout (so every tensor keeps its alignment); and the
    buffer's size."""
    places, total = [], 0
    for begin, end in spans:
        total += (begin - total) % _GROUP_ALIGN
        places.append(total)
        total += end - begin
    return places, total


def _device_spans(layout: Layout, items: list) -> list[tuple[int, int]]:
    """Byte ranges that hold device tensors and no host tensor: each is one copy (padding
    between groups goes along rather than splitting the copy)."""
    device_names = {(g, s.name) for g, s, _ in items}
    spans: list[tuple[int, int]] = []
    entries = sorted(
        (layout.offsets[g] + s.start, s.nbytes, (g, s.name) in device_names)
        for g, slots in layout.groups.items()
        for s in slots
    )
    for begin, nbytes, on_device in entries:
        if not on_device:
            spans.append((-1, -1))  # a host tensor: the next device range starts a new span
        elif spans and spans[-1][0] >= 0:
            spans[-1] = (spans[-1][0], begin + nbytes)
        else:
            spans.append((begin, begin + nbytes))
    return [span for span in spans if span[0] >= 0]
