"""A source read on a thread of its own, a few batches ahead, its large tensors pinned there:
what ``DataLoader``'s pin-memory thread does for its own loop.

``DeviceLoader`` reads only ``DataLoader``s with workers (and without a pin-memory thread of
their own) on a thread: through ``gpuflow.transfer.device_reader``, which also stages and
copies there, or with ``timing=True`` through ``ThreadedSource`` here, the rest staying on
the training thread. Tensors of ``PIN_MIN_BYTES`` or more are pinned on the thread too.

Why a thread, and for which sources: docs/architecture/transfer-pipeline.md (Reading a
worker-fed source on a thread).
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.packing import PIN_MIN_BYTES
from gpuflow.transfer.pinned import pinned_copy

_END = object()
_PUT_POLL_S = 0.05  # how often a reader blocked on a full queue checks for close()


def reads_slowly(source: object) -> bool:
    """Whether taking a batch from ``source`` is worth a thread: a ``DataLoader`` with
    worker processes and no pin-memory thread of its own."""
    return (
        isinstance(source, torch.utils.data.DataLoader)
        and source.num_workers > 0
        and not source.pin_memory
    )


def pin_large(batch: Any) -> Any:
    """``batch`` with every host tensor of ``PIN_MIN_BYTES`` or more in its dicts, lists and
    tuples replaced by a pinned copy; anything else as it is."""
    kind = type(batch)
    if kind is torch.Tensor:
        large = batch.nbytes >= PIN_MIN_BYTES and batch.is_cpu and batch.is_contiguous()
        return batch.pin_memory() if large and not batch.is_pinned() else batch
    if kind is dict:
        return {key: pin_large(value) for key, value in batch.items()}
    if kind is list or kind is tuple:
        return kind(pin_large(item) for item in batch)
    return batch


def copied(batch: Any) -> Any:
    """``batch`` with every host tensor and array in its dicts, lists and tuples replaced by a
    copy of its own (large pageable tensors pinned by ``pin_memory()``, pinned ones into
    pinned memory): what was read, kept as it was when read."""
    if isinstance(batch, np.ndarray):
        return batch.copy()
    if isinstance(batch, torch.Tensor):
        if not batch.is_cpu:
            return batch
        if batch.is_pinned():
            return pinned_copy(batch)
        if batch.nbytes >= PIN_MIN_BYTES and batch.is_contiguous():
            return batch.pin_memory()
        return batch.clone()
    if isinstance(batch, Mapping):
        items = {key: copied(value) for key, value in batch.items()}
        try:
            rebuilt = copy.copy(batch)  # keeps its type (a defaultdict's factory too)
            rebuilt.update(items)
            return rebuilt
        except Exception:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(copied(item) for item in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(copied(item) for item in batch)
    return batch


def queue_put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` in ``out``, waiting while it is full; False if ``stop`` is set first."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_PUT_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def stop_reading(out: queue.Queue, stop: threading.Event) -> None:
    """Tell a reading thread to stop, and drop what it queued: a thread blocked on the full
    queue is freed at once, and the batches it held go."""
    stop.set()
    while True:
        try:
            out.get_nowait()
        except queue.Empty:
            break


class ThreadedSource:
    """``source``'s batches, read up to ``ahead`` batches ahead on a daemon thread; with
    ``pin_for`` (a device with pinned memory), their large tensors pinned there; with
    ``copy``, every tensor copied there as it is read (for a source that may write its
    batches again).

    Errors the source raises come out of ``next`` in their turn. ``close()`` returns at once
    (the thread stops after the batch it is reading, even if that never comes) and the thread
    holds nothing of the consumer's.
    """

    def __init__(
        self, source: Iterator[Any], ahead: int, pin_for: Device | None = None, copy: bool = False
    ) -> None:
        self._queue: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=max(1, ahead))
        self._stop = threading.Event()
        self._done = False
        pin = pin_for is not None and pin_for.supports_pinned_memory
        self._thread = threading.Thread(
            target=self._run,
            args=(source, self._queue, self._stop, pin_for if pin else None, copy),
            daemon=True, name="gpuflow-read",
        )  # fmt: skip
        self._thread.start()

    @staticmethod
    def _run(
        source: Iterator[Any], out: queue.Queue, stop: threading.Event, pin_for: Device | None,
        copy: bool,
    ) -> None:  # fmt: skip
        # A static method: the thread keeps no reference to the ThreadedSource, so that one
        # dropped without close() is still collected.
        if pin_for is not None and pin_for.type == "cuda":
            torch.cuda.set_device(pin_for.index)  # pinned for (and near) this device

        def put(item: tuple[bool, Any]) -> bool:
            return queue_put(out, item, stop)

        try:
            for batch in source:
                if copy:
                    batch = copied(batch)
                elif pin_for is not None:
                    batch = pin_large(batch)
                if not put((True, batch)):
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            put((False, exc))
            return
        put((False, _END))

    def __iter__(self) -> ThreadedSource:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        ok, item = self._queue.get()
        if ok:
            return item
        self._done = True
        if item is _END:
            raise StopIteration
        raise item

    def close(self) -> None:
        """Stop reading; batches read ahead are dropped."""
        self._done = True
        stop_reading(self._queue, self._stop)

    def __del__(self) -> None:
        self._stop.set()
