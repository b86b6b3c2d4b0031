"""DeviceLoader over sources that write their batches again (one buffer refilled, a ring of
views): every batch arrives as it was yielded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflow.transfer.loader import DeviceLoader


def _refilled(values, make):
    """A hand-written loader's way: one buffer, refilled and yielded for every batch."""
    buffer = make()
    for value in values:
        buffer[...] = torch.as_tensor(value) if isinstance(buffer, torch.Tensor) else value
        yield buffer


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
@pytest.mark.parametrize(
    "make",
    [lambda: torch.empty(8, dtype=torch.int64), lambda: np.empty(8, dtype=np.int64),
     lambda: torch.empty(8, dtype=torch.float32)],
    ids=["tensor", "array", "floats"],
)  # fmt: skip
def test_a_source_that_refills_one_buffer_gets_every_batch_as_it_was_yielded(make, depth):
    loader = DeviceLoader(_refilled(range(10), make), "cpu", depth=depth)
    assert [batch.tolist() for batch in loader] == [[i] * 8 for i in range(10)]


def test_a_ring_of_views_into_one_tensor_arrives_as_yielded():
    ring = torch.zeros(4, 1000, dtype=torch.int64)

    def source():
        for i in range(40):
            slot = ring[i % 4]  # a view: the source writes it again four batches later
            slot.fill_(i)
            yield {"ids": slot, "step": i}

    got = [(batch["step"], batch["ids"].unique().tolist()) for batch in DeviceLoader(source())]
    assert got == [(i, [i]) for i in range(40)]


def test_values_that_narrow_differently_in_a_refilled_buffer_arrive_exact():
    rows = [[5, 70000, -3, 2**40], [1, 2, 3, 4], [70000, 1, 2, 3], [-(2**40), 0, 0, 0]] * 5
    source = _refilled(rows, lambda: torch.empty(4, dtype=torch.int64))
    loader = DeviceLoader(source, "cpu", narrow=True)
    assert [batch.tolist() for batch in loader] == rows


def test_a_large_refilled_buffer_written_by_the_writer_threads_arrives_as_yielded():
    # 4 MiB of int64 that narrow to uint16: staged on the writer threads
    source = _refilled(range(6), lambda: torch.empty(1 << 19, dtype=torch.int64))
    loader = DeviceLoader(source, "cpu", narrow=True)
    got = [(batch.dtype, batch.unique().tolist()) for batch in loader]
    assert got == [(torch.int64, [i]) for i in range(6)]


def test_two_epochs_of_a_source_refilling_one_buffer_each_get_their_own_batches():
    """Two epochs under way over a source whose iterators refill one shared buffer: one
    epoch's next read must wait until the other's writer threads have read that buffer."""

    class Refilled:
        def __init__(self) -> None:
            self.buffer = torch.empty(1 << 21, dtype=torch.int64)  # narrowed: writer threads

        def __iter__(self):
            for i in range(7):
                self.buffer.fill_(i)
                yield self.buffer

    for _ in range(3):
        with DeviceLoader(Refilled(), "cpu", narrow=True) as loader:
            first, second = iter(loader), iter(loader)
            ahead = [next(first)]  # the first epoch one batch ahead of the second
            pairs = list(zip(first, second, strict=False))  # the first ends a batch sooner
            got_first = [int(b.min()) for b in ahead] + [int(a.min()) for a, _ in pairs]
            assert [int(a.max()) for a, _ in pairs] == got_first[1:]
            assert got_first == list(range(7))
            assert [(int(b.min()), int(b.max())) for _, b in pairs] == [(i, i) for i in range(6)]


@pytest.mark.parametrize("size", [8, 1 << 25], ids=["small", "writer-threads"])
def test_two_loaders_over_one_source_refilling_one_buffer_each_get_their_own_batches(size):
    """One loader's read of the source refills the buffer another's writer threads may still
    be reading: a read waits for every loader's copies of memory a source may reuse."""

    class Refilled:
        def __init__(self) -> None:
            self.buffer = torch.empty(size, dtype=torch.float32)

        def __iter__(self):
            for i in range(5):
                self.buffer.fill_(i)
                yield self.buffer

    source = Refilled()
    for _ in range(3):
        with DeviceLoader(source, "cpu") as first, DeviceLoader(source, "cpu") as second:
            got = [(a.aminmax(), b.aminmax()) for a, b in zip(first, second, strict=True)]
        assert [(int(a.min), int(a.max), int(b.min), int(b.max)) for a, b in got] == [
            (i, i, i, i) for i in range(5)
        ]
