"""A DataLoader with workers as a DeviceLoader's source: read on the training thread (its
workers and, where the device has pinned memory, its own pin-memory thread read ahead), its
workers never outlive the loader's use of them, and errors come in their turn."""

from __future__ import annotations

import gc
import multiprocessing
import time

import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.transfer.loader import DeviceLoader


def _workers() -> int:
    return len(multiprocessing.active_children())


def _wait_for(condition, seconds: float = 10.0) -> bool:
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


def test_two_epochs_over_a_dataloader_with_workers_give_the_same_batches():
    source = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2)
    with DeviceLoader(source, "cpu") as loader:
        epochs = [[(b["x"].clone(), b["i"].clone()) for b in loader] for _ in range(2)]
        assert len(loader) == 6
    assert [torch.cat([i for _, i in e]).tolist() for e in epochs] == [list(range(24))] * 2
    for x, i in epochs[1]:
        assert torch.equal(x[:, 0], (i * i).float())
    assert not source.pin_memory  # the user's DataLoader as it was given
    assert _wait_for(lambda: _workers() == 0)


def test_a_loader_left_mid_epoch_stops_the_workers():
    # more batches than the loader reads ahead, so that the workers are still at work
    source = torch.utils.data.DataLoader(Squares(10_000), batch_size=2, num_workers=2)
    loader = DeviceLoader(source, "cpu")
    epoch = iter(loader)
    next(epoch)
    assert _workers() == 2
    del loader, epoch
    gc.collect()
    assert _wait_for(lambda: _workers() == 0)


def test_an_error_in_a_worker_comes_after_the_batches_before_it():
    class Broken(Squares):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            if i == 9:
                raise ValueError("bad record 9")
            return super().__getitem__(i)

    source = torch.utils.data.DataLoader(Broken(), batch_size=4, num_workers=1)
    got = []
    with DeviceLoader(source, "cpu") as loader, pytest.raises(ValueError, match="bad record 9"):
        for batch in loader:
            got += batch["i"].tolist()
    assert got == list(range(8))
    gc.collect()  # (the error's traceback held the DataLoader's iterator)
    assert _wait_for(lambda: _workers() == 0)


def test_a_closed_loader_refuses_a_new_epoch():
    source = torch.utils.data.DataLoader(Squares(), batch_size=2, num_workers=1)
    loader = DeviceLoader(source, "cpu")
    loader.close()
    with pytest.raises(GpuflowError, match="closed"):
        iter(loader)


def test_a_worker_fed_loader_counts_what_it_moved_and_the_ledger_sees_it():
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


def test_an_exception_in_the_consumer_ends_the_epoch_and_a_new_one_starts_afresh():
    source = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=1)
    with DeviceLoader(source, "cpu") as loader:
        with pytest.raises(RuntimeError, match="mid-loop"):
            for n, _ in enumerate(loader):
                if n == 2:
                    raise RuntimeError("mid-loop")
        assert [b["i"][0].item() for b in loader] == [0, 4, 8, 12, 16, 20]
        pairs = [(a["i"][0].item(), b["i"][0].item()) for a, b in zip(loader, loader, strict=True)]
        assert pairs == [(i, i) for i in (0, 4, 8, 12, 16, 20)]
    assert _wait_for(lambda: _workers() == 0)


def test_a_dataloader_with_persistent_workers_serves_one_epoch_at_a_time():
    source = torch.utils.data.DataLoader(
        Squares(), batch_size=4, num_workers=2, persistent_workers=True
    )
    with DeviceLoader(source, "cpu") as loader:
        assert [[b["i"][0].item() for b in loader] for _ in range(2)] == [[0, 4, 8, 12, 16, 20]] * 2
        for n, _ in enumerate(loader):
            if n == 1:
                break  # the epoch left behind lets the next one start
        with pytest.raises(RuntimeError, match="mid-loop"):
            for _ in loader:
                raise RuntimeError("mid-loop")
        assert [b["i"][0].item() for b in loader] == [0, 4, 8, 12, 16, 20]
        with pytest.raises(GpuflowError, match="persistent_workers=True"):
            list(zip(loader, loader, strict=True))
        assert [b["i"][0].item() for b in loader] == [0, 4, 8, 12, 16, 20]
    del loader, source
    gc.collect()
    assert _wait_for(lambda: _workers() == 0)
