"""A DataLoader with workers is read on a thread of its own; that thread never outlives its
use, never hangs a close, and hands errors over in their turn."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.reader import ThreadedSource, reads_slowly


def _readers() -> int:
    return sum(t.name == "gpuflow-read" for t in threading.enumerate())


def _wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


class Squares(torch.utils.data.Dataset):
    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((3,), float(i * i)), "i": torch.tensor(i)}


def test_only_a_dataloader_with_workers_is_read_on_a_thread():
    data = Squares()
    assert reads_slowly(torch.utils.data.DataLoader(data, num_workers=1))
    assert not reads_slowly(torch.utils.data.DataLoader(data, num_workers=0))
    assert not reads_slowly([torch.ones(2)])


def test_two_epochs_over_a_dataloader_with_workers_give_the_same_batches():
    source = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2)
    before = _readers()
    with DeviceLoader(source, "cpu") as loader:
        epochs = [[(b["x"].clone(), b["i"].clone()) for b in loader] for _ in range(2)]
        assert len(loader) == 6
    assert [torch.cat([i for _, i in e]).tolist() for e in epochs] == [list(range(24))] * 2
    for x, i in epochs[1]:
        assert torch.equal(x[:, 0], (i * i).float())
    assert _wait_for(lambda: _readers() == before)


def test_an_error_comes_after_the_batches_before_it():
    def source():
        yield 1
        yield 2
        raise ValueError("bad record 3")

    reader = ThreadedSource(source(), ahead=4)
    assert next(reader) == 1 and next(reader) == 2
    with pytest.raises(ValueError, match="bad record 3"):
        next(reader)
    with pytest.raises(StopIteration):
        next(reader)


def test_close_returns_at_once_even_when_the_source_is_blocked():
    release = threading.Event()

    def blocked():
        yield 0
        release.wait(30)  # a worker that never answers
        yield 1

    before = _readers()
    reader = ThreadedSource(blocked(), ahead=2)
    assert next(reader) == 0
    started = time.perf_counter()
    reader.close()
    assert time.perf_counter() - started < 0.5
    with pytest.raises(StopIteration):
        next(reader)
    release.set()  # once the source answers, the thread sees the close and ends
    assert _wait_for(lambda: _readers() == before)


def test_a_reader_dropped_without_close_stops_its_thread():
    def endless():
        n = 0
        while True:
            n += 1
            yield n

    before = _readers()
    reader = ThreadedSource(endless(), ahead=2)
    assert next(reader) == 1
    del reader
    gc.collect()
    assert _wait_for(lambda: _readers() == before)


def test_a_loader_left_mid_epoch_stops_its_reader():
    # more batches than the loader reads ahead, so that the reader is still at work
    source = torch.utils.data.DataLoader(Squares(10_000), batch_size=2, num_workers=1)
    before = _readers()
    loader = DeviceLoader(source, "cpu")
    next(iter(loader))
    assert _readers() == before + 1
    del loader
    gc.collect()
    assert _wait_for(lambda: _readers() == before)


def test_a_closed_loader_refuses_a_new_epoch():
    source = torch.utils.data.DataLoader(Squares(), batch_size=2, num_workers=1)
    loader = DeviceLoader(source, "cpu")
    loader.close()
    with pytest.raises(GpuflowError, match="closed"):
        iter(loader)


def test_a_worker_fed_loader_counts_what_its_reader_moved_and_the_ledger_sees_it():
    from gpuflow.accounting.ledger import TransferLedger

    source = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2)
    with TransferLedger("cpu") as ledger, DeviceLoader(source, "cpu", narrow=True) as loader:
        got = [i for b in loader for i in b["i"].tolist()]
    assert got == list(range(24))
    stats = loader.stats
    # the same batches read on the loop's own thread move the same bytes in as many copies
    same = [{"x": b["x"].clone(), "i": b["i"].clone()} for b in source]
    with DeviceLoader(same, "cpu", narrow=True) as direct:
        list(direct)
    expected = direct.stats
    assert (stats.batches, stats.bytes_moved) == (6, expected.bytes_moved)
    assert stats.logical_bytes == expected.logical_bytes == 6 * (48 + 32)
    assert stats.bytes_moved < stats.logical_bytes  # the ids narrowed
    assert stats.copies == expected.copies < 6  # small batches share a copy
    copies = [e for e in ledger.events if e.kind == "h2d"]
    assert sum(e.nbytes for e in copies) == stats.bytes_moved and len(copies) == 6


def test_an_exception_in_the_consumer_stops_the_reader_and_a_new_epoch_starts_afresh():
    source = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=1)
    before = _readers()
    with DeviceLoader(source, "cpu") as loader:
        with pytest.raises(RuntimeError, match="mid-loop"):
            for n, _ in enumerate(loader):
                if n == 2:
                    raise RuntimeError("mid-loop")
        assert [b["i"][0].item() for b in loader] == [0, 4, 8, 12, 16, 20]
        pairs = [(a["i"][0].item(), b["i"][0].item()) for a, b in zip(loader, loader, strict=True)]
        assert pairs == [(i, i) for i in (0, 4, 8, 12, 16, 20)]
    assert _wait_for(lambda: _readers() == before)
