"""A worker-fed source taken all the way to the device on a thread of its own.

``DeviceReader``'s thread runs the whole crossing of a ``DataLoader`` with workers on the
stream its loader keeps for its readers, through a ``Pipeline`` of its own, and queues
finished device batches (at most ``ahead``); the training thread takes one and makes its
stream wait for the copy, with no host wait. ``close()`` returns at once.

Why the whole crossing moves to the thread, how a batch is handed over, and how the thread
ends: docs/architecture/transfer-pipeline.md (The whole crossing on the reader's thread).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.packing import Planner, Ragged
from gpuflow.transfer.pipeline import Pipeline
from gpuflow.transfer.reader import queue_put, stop_reading
from gpuflow.transfer.staging import Epoch
from gpuflow.transfer.tally import report_copy

_END = object()


class DeviceReader:
    """Batches of ``source`` on ``device``, made on a thread: see the module docstring.
    ``owned``: what ``source`` yields is memory nothing writes again (else each batch is
    copied as it is read, as ``Epoch`` says); ``coalesce``: small batches may share a copy.
    ``counts`` are the thread's ``Pipeline``'s."""

    def __init__(
        self, source: Iterator[Any], device: Device, planner: Planner, ahead: int, owned: bool,
        coalesce: bool, stream: Any,
    ) -> None:  # fmt: skip
        self.device = device
        self.ended = False
        self._queue: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=max(1, ahead))
        self._stop = threading.Event()
        # One crossing read ahead of the one being copied, so small batches can share one
        # staging buffer and one copy, as on the training thread's pipeline.
        pipeline = Pipeline(
            device, 1, planner, None, timing=False, coalesce=coalesce, side_copies=False
        )
        self.counts = pipeline.counts
        self._thread = threading.Thread(
            target=self._run,
            args=(Epoch(source, owned), pipeline, stream, self._queue, self._stop),
            daemon=True, name="gpuflow-read",
        )  # fmt: skip
        self._thread.start()

    @staticmethod
    def _run(
        ep: Epoch, pipeline: Pipeline, stream: Any, out: queue.Queue, stop: threading.Event
    ) -> None:
        # A static method: the thread holds nothing of the DeviceReader, so that one dropped
        # without close() is still collected (and stops this thread).
        device = pipeline.device
        if device.type == "cuda":
            torch.cuda.set_device(device.index)
        pipeline.epochs.append(ep)
        counts = pipeline.counts
        try:
            with device.use_stream(stream):
                key = device.current_stream_key()
                while not stop.is_set():
                    pipeline.top_up(ep)
                    pipeline.issue_ready(ep, key)
                    before = counts["bytes_moved"]
                    taken = pipeline.take(ep, key)  # raises the source's error in its turn
                    if taken is None:
                        queue_put(out, (False, _END), stop)
                        return
                    ready = device.new_event()
                    ready.record(stream)
                    wire = counts["bytes_moved"] - before
                    if not queue_put(out, (True, (taken[0], ready, wire)), stop):
                        return
        except BaseException as exc:  # handed to the consumer, raised there
            queue_put(out, (False, exc), stop)
        finally:
            pipeline.release()  # the source closed, staging memory given back

    def take(self, stream: Any) -> Any:
        """The next batch, ordered after its copy on ``stream``, the consumer's current one;
        StopIteration at the end."""
        if self.ended:
            raise StopIteration
        ok, item = self._queue.get()
        if not ok:
            self.close()
            if item is _END:
                raise StopIteration
            raise item
        batch, ready, wire = item
        if self.device.has_streams:
            stream.wait_event(ready)
            for tensor in _device_tensors(batch):
                tensor.record_stream(stream)  # not reused before this stream's work on it
        report_copy("h2d", wire, "DeviceLoader batch", "uint8", True)
        return batch

    def close(self) -> None:
        """Stop reading; batches made ahead are dropped."""
        self.ended = True
        stop_reading(self._queue, self._stop)

    def __del__(self) -> None:
        self._stop.set()


def _device_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a batch the pipeline rebuilt (its containers, and ``Ragged``s)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Ragged):
        yield from (batch.values, batch.offsets)
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _device_tensors(value)
    elif isinstance(batch, list | tuple):
        for item in batch:
            yield from _device_tensors(item)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from _device_tensors(getattr(batch, field.name))
