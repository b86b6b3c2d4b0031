"""DeviceReader on the cpu: a source taken across on a thread of its own, in order, its error
raised in its turn, each batch counted once when it is taken, and a close that never waits."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
import torch

from gpuflow.accounting.ledger import TransferLedger
from gpuflow.device.accelerator import Device
from gpuflow.transfer.device_reader import DeviceReader
from gpuflow.transfer.packing import Planner

CPU = Device("cpu")


def _reader(source, ahead: int = 2) -> DeviceReader:
    return DeviceReader(
        iter(source), CPU, Planner(True, None), ahead, owned=False, coalesce=False,
        stream=CPU.new_stream(),
    )  # fmt: skip


def _all(reader: DeviceReader) -> list:
    taken = []
    while True:
        try:
            taken.append(reader.take(None))
        except StopIteration:
            return taken


def test_batches_arrive_in_order_with_their_structure_and_values():
    source = [
        {"ids": np.arange(i, i + 12, dtype=np.int64).reshape(3, 4), "weight": np.float32(i)}
        for i in range(5)
    ]
    reader = _reader(source)
    taken = _all(reader)
    assert len(taken) == 5
    for i, batch in enumerate(taken):
        assert batch["ids"].dtype == torch.int64 and batch["ids"].shape == (3, 4)
        assert torch.equal(batch["ids"], torch.arange(i, i + 12).reshape(3, 4))
        assert float(batch["weight"]) == i
    assert reader.counts["batches"] == 5
    # ids below 256 cross as one byte each: fewer bytes moved than the batches hold
    assert reader.counts["bytes_moved"] < reader.counts["logical_bytes"]
    with pytest.raises(StopIteration):
        reader.take(None)  # ended stays ended


def test_each_batch_is_counted_once_on_the_taking_thread_with_the_bytes_moved():
    reader = _reader([np.ones((4, 8), dtype=np.float32) for _ in range(3)])
    with TransferLedger("cpu") as ledger:
        _all(reader)
    events = [(e.kind, e.op) for e in ledger.events]
    assert events == [("h2d", "DeviceLoader batch")] * 3
    assert sum(e.nbytes for e in ledger.events) == reader.counts["bytes_moved"]


def test_the_sources_error_is_raised_in_its_turn_and_ends_the_reader():
    def failing():
        yield np.zeros(3)
        yield np.ones(3)
        raise ValueError("the source broke")

    reader = _reader(failing())
    assert torch.equal(reader.take(None), torch.zeros(3, dtype=torch.float64))
    assert torch.equal(reader.take(None), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="the source broke"):
        reader.take(None)
    assert reader.ended
    with pytest.raises(StopIteration):
        reader.take(None)


def test_close_returns_at_once_while_the_source_blocks():
    never: queue.Queue = queue.Queue()

    def blocked():
        yield np.zeros(3)
        yield np.ones(3)
        yield never.get()  # blocks for good: the reader's thread cannot finish

    reader = _reader(blocked())
    assert torch.equal(reader.take(None), torch.zeros(3, dtype=torch.float64))
    started = time.monotonic()
    reader.close()
    assert time.monotonic() - started < 1.0
    with pytest.raises(StopIteration):
        reader.take(None)  # batches made ahead are dropped
    readers = [t for t in threading.enumerate() if t.name == "gpuflow-read"]
    assert readers and all(t.daemon for t in readers)  # a blocked one never holds up the exit
    never.put(np.zeros(3))  # lets the thread go


def test_every_device_tensor_of_a_batch_is_found_for_the_consumers_stream():
    """Each tensor the reader hands over is marked as used on the consumer's stream: in
    dicts, lists, tuples, namedtuples, dataclasses and ``Ragged``s alike."""
    import dataclasses
    from collections import namedtuple

    from gpuflow.transfer.device_reader import _device_tensors
    from gpuflow.transfer.packing import Ragged

    @dataclasses.dataclass
    class Example:
        image: torch.Tensor
        extra: dict

    Pair = namedtuple("Pair", "a b")
    tensors = [torch.full((2,), float(i)) for i in range(5)]
    ragged = Ragged.from_sequences([[1, 2], [3]])
    batch = {
        "x": Example(tensors[0], {"y": [tensors[1], (tensors[2],)]}),
        "p": Pair(tensors[3], 7),
        "r": ragged,
        "t": tensors[4],
    }
    found = list(_device_tensors(batch))
    expected = [*tensors[:4], ragged.values, ragged.offsets, tensors[4]]
    assert len(found) == len(expected)
    assert all(f is e for f, e in zip(found, expected, strict=True))
