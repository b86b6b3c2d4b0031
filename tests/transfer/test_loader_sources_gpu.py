"""DeviceLoader on a device, fed by sources that write their batches again (one pinned or
pageable buffer refilled, a ring of views), with the consumer's stream kept busy so that
every copy read ahead runs late: each batch must arrive as the source yielded it."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from gpuflow.transfer import issuing
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.staging import Stager

pytestmark = pytest.mark.gpu


def _busy(ms: float) -> None:
    torch.cuda._sleep(int(ms * 2e6))  # cycles: at least ms at clocks up to 2 GHz


def _refilled(n: int, numel: int, pinned: bool, dtype: torch.dtype):
    buffer = torch.empty(numel, dtype=dtype, pin_memory=pinned)
    for i in range(n):
        buffer.fill_(i)
        yield buffer


@pytest.fixture
def cuda(accel):
    if accel.type != "cuda":
        pytest.skip("copies that run after the host moves on: cuda")
    return accel


@pytest.mark.parametrize(
    "numel,pinned,dtype",
    [
        (8, True, torch.int64),  # staged, narrowed, coalesced
        (8, False, torch.float32),
        (1 << 15, True, torch.float32),  # 128 KiB pinned: copied from where it lies
        (1 << 16, False, torch.float32),  # 256 KiB pageable: pinned by pin_memory()
        (1 << 20, True, torch.int64),  # 8 MiB narrowed: staged on the writer threads
        (1 << 21, True, torch.float32),  # 8 MiB pinned: direct
    ],
    ids=["small-pinned", "small", "direct-pinned", "pageable", "writers", "large-pinned"],
)
def test_a_refilled_buffer_arrives_as_yielded_while_the_device_is_behind(
    cuda, numel, pinned, dtype
):
    got = []
    with DeviceLoader(_refilled(24, numel, pinned, dtype), cuda, narrow=True) as loader:
        for batch in loader:
            _busy(0.3)  # the copies read ahead queue behind this
            got.append(torch.stack([batch.min(), batch.max()]).double())
    values = torch.stack(got).cpu().tolist()
    assert values == [[float(i)] * 2 for i in range(24)]


def test_a_ring_of_pinned_views_arrives_as_yielded(cuda):
    ring = torch.zeros(3, 1 << 16, dtype=torch.float32).pin_memory()

    def source():
        for i in range(30):
            slot = ring[i % 3]
            slot.fill_(float(i))
            yield slot

    got = []
    with DeviceLoader(source(), cuda) as loader:
        for batch in loader:
            _busy(0.3)
            got.append(torch.stack([batch.min(), batch.max()]))
    assert torch.stack(got).cpu().tolist() == [[float(i)] * 2 for i in range(30)]


def test_fresh_batches_and_a_default_dataloader_are_read_where_they_lie(cuda, monkeypatch):
    copies = []  # made as batches were read, straight to the device
    real = issuing.Issuer.cross_early
    monkeypatch.setattr(
        issuing.Issuer, "cross_early", lambda self, t: copies.append(1) or real(self, t)
    )

    def fresh():
        for i in range(6):
            yield torch.full((1 << 16,), float(i)).pin_memory()

    with DeviceLoader(fresh(), cuda, fresh_batches=True) as loader:
        assert [b[0].item() for b in loader] == [float(i) for i in range(6)]
    assert copies == []
    rows = torch.arange(64 * 4096, dtype=torch.float32).reshape(64, 4096)
    batches = DataLoader(rows, batch_size=16, pin_memory=True)
    with DeviceLoader(batches, cuda) as loader:
        assert torch.equal(torch.cat(list(loader)).cpu(), rows)
    assert copies == []  # default collate: fresh batches, pinned by the DataLoader
    with DeviceLoader(fresh(), cuda) as loader:  # not known to be fresh: copied when read
        assert [b[0].item() for b in loader] == [float(i) for i in range(6)]
    assert len(copies) == 6


def test_a_device_given_as_an_int_is_that_cuda_device(cuda):
    loader = DeviceLoader([torch.arange(4)], 0)
    assert loader.device.torch == torch.device("cuda", 0)
    assert next(iter(loader)).device == torch.device("cuda", 0)


class _Filled(torch.utils.data.Dataset):
    """Item ``i``: 64 KiB of float ``i`` (batches of 16 are 1 MiB, copied directly) and the
    label ``i`` (copied where it lies too: the one small tensor of a batch the loader owns)."""

    def __len__(self) -> int:
        return 24 * 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | int]:
        return {"x": torch.full((1 << 14,), float(i)), "y": i}


def test_a_worker_fed_batch_pinned_by_the_dataloaders_thread_is_complete_and_kept_until_used(
    cuda, monkeypatch
):  # fmt: skip
    """A DataLoader with workers and no pin-memory thread is read through one of its own
    (every batch pinned there), and the user's DataLoader is left as it was. The copies run
    late, and the consumer's stream is slow to read each batch it has already let go of: the
    consumer must wait for each copy, and no batch's memory may be handed to a later batch
    before the consumer read it."""
    import torch.utils.data._utils.pin_memory as dataloader_pinning

    pinned = []
    real_pin = dataloader_pinning.pin_memory

    def counted_pin(data, *args, **kwargs):
        if isinstance(data, dict):  # a whole batch (its tensors are pinned by calls of their own)
            pinned.append(1)
        return real_pin(data, *args, **kwargs)

    monkeypatch.setattr(dataloader_pinning, "pin_memory", counted_pin)
    real = issuing.Issuer._copy

    def late(self, crossing, stream):
        _busy(5.0)
        return real(self, crossing, stream)

    monkeypatch.setattr(issuing.Issuer, "_copy", late)
    real_at_once = issuing.Issuer.hand_out_at_once

    def late_at_once(self, plan):
        _busy(5.0)
        return real_at_once(self, plan)

    monkeypatch.setattr(issuing.Issuer, "hand_out_at_once", late_at_once)
    source = DataLoader(_Filled(), batch_size=16, num_workers=2)
    sums, labels = [], []
    with DeviceLoader(source, cuda) as loader:
        for batch in loader:
            _busy(3.0)  # the batch is read after this, long after the loop let go of it
            sums.append(batch["x"].sum(dim=1))
            labels.append(batch["y"])
            del batch
    got = torch.cat(sums).cpu()
    expected = torch.arange(24 * 16, dtype=torch.float32) * (1 << 14)
    assert torch.equal(got, expected)
    assert torch.cat(labels).cpu().tolist() == list(range(24 * 16))
    assert loader.stats.batches == 24
    assert len(pinned) == 24 and source.pin_memory is False


def _collate_filled(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    xs, ys = [it["x"] for it in items], [it["y"] for it in items]
    return {"x": torch.stack(xs), "y": torch.tensor(ys)}


def test_batches_a_dataloaders_pin_thread_made_are_read_where_they_lie(cuda, monkeypatch):
    """Whatever its collate_fn, a DataLoader with workers hands over batches that its
    pin-memory thread copied out of shared memory: pinned memory made for that batch, which
    the loader copies from where it lies, with no copy of its own as it reads, and no staging
    for a lone small tensor beside the large one."""
    early = []
    real = issuing.Issuer.cross_early

    def counted(self, source):
        early.append(source.nbytes)
        return real(self, source)

    monkeypatch.setattr(issuing.Issuer, "cross_early", counted)
    source = DataLoader(_Filled(), batch_size=16, num_workers=2, collate_fn=_collate_filled)
    with DeviceLoader(source, cuda) as loader:
        batches = [(batch["x"].sum(dim=1), batch["y"]) for batch in loader]
        staging = loader.pool_stats.high_water_bytes
    expected = torch.arange(24 * 16, dtype=torch.float32) * (1 << 14)
    assert torch.equal(torch.cat([x for x, _ in batches]).cpu(), expected)
    assert torch.cat([y for _, y in batches]).cpu().tolist() == list(range(24 * 16))
    assert early == []
    assert staging == 0  # the labels, the one small tensor, crossed where they lie too


def test_a_worker_fed_batch_copied_where_it_lies_is_read_only_when_asked_for(cuda, monkeypatch):
    """Such a batch (1 MiB and its labels, both crossing where they lie) is read, copied and
    handed out when the loop asks for it: the loader reads nothing ahead of it."""
    reads = []
    real = Stager.next_plan

    def counted(self, ep):
        reads.append(1)
        return real(self, ep)

    monkeypatch.setattr(Stager, "next_plan", counted)
    source = DataLoader(_Filled(), batch_size=16, num_workers=2)
    seen, sums = [], []
    with DeviceLoader(source, cuda) as loader:
        for batch in loader:
            seen.append(len(reads))
            _busy(1.0)  # the next batch's copies queue behind this
            sums.append(batch["x"].sum(dim=1))
    assert seen == list(range(1, 25))
    expected = torch.arange(24 * 16, dtype=torch.float32) * (1 << 14)
    assert torch.equal(torch.cat(sums).cpu(), expected)
    stats = loader.stats
    assert stats.batches == 24 and stats.copies == 48 and loader.pool_stats.misses == 0


class _BrokenAt(_Filled):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor | int]:
        if i == 100:
            raise ValueError("item 100 is corrupt")
        return super().__getitem__(i)


def test_a_worker_fed_error_reaches_the_loop_after_the_batches_before_it(cuda):
    source = DataLoader(_BrokenAt(), batch_size=16, num_workers=2)
    firsts = []
    with DeviceLoader(source, cuda) as loader:
        with pytest.raises(ValueError, match="item 100 is corrupt"):
            for batch in loader:
                firsts.append(int(batch["y"][0]))
        again = [int(b["y"][0]) for b in itertools.islice(loader, 3)]
        assert again == [0, 16, 32]  # a new epoch reads from the start
    assert firsts == [16 * i for i in range(6)]  # batch 6 holds item 100


def _staged_every_third(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Batches copied where they lie, but every third one with a strided small tensor that
    is staged (so that batch goes through the crossings, read ahead)."""
    batch = _collate_filled(items)
    first = int(batch["y"][0])
    if first // 16 % 3 == 2:
        batch["strided"] = batch["y"].repeat_interleave(2)[::2]
    return batch


def test_batches_handed_out_at_once_and_batches_staged_keep_their_order(cuda):
    """Worker-fed batches copied where they lie between batches that are staged: each
    arrives whole and in order, in two epochs side by side (``zip(loader, loader)``), after
    an early break, and in the epoch after it."""
    source = DataLoader(_Filled(), batch_size=16, num_workers=2, collate_fn=_staged_every_third)

    def check(batch, i):
        assert batch["y"].tolist() == list(range(16 * i, 16 * i + 16))
        assert torch.equal(batch["x"][:, 0].cpu(), batch["y"].cpu().float())
        assert ("strided" in batch) == (i % 3 == 2)
        if i % 3 == 2:
            assert torch.equal(batch["strided"], batch["y"])

    with DeviceLoader(source, cuda) as loader:
        for i, (a, b) in enumerate(zip(loader, loader, strict=True)):
            _busy(0.5)
            check(a, i)
            check(b, i)
        for i, batch in enumerate(loader):
            check(batch, i)
            if i == 7:
                break
        for i, batch in enumerate(loader):
            check(batch, i)
        assert i == 23


@dataclasses.dataclass
class _Fields:
    x: torch.Tensor
    y: torch.Tensor


_Named = collections.namedtuple("_Named", "x y")


def _xs_ys(items: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([it["x"] for it in items]), torch.tensor([it["y"] for it in items])


def _as_tuple(items):
    return _xs_ys(items)


def _as_namedtuple(items):
    return _Named(*_xs_ys(items))


def _as_dataclass(items):  # DataLoader's pin thread leaves a dataclass's tensors as they are
    return _Fields(*_xs_ys(items))


def _with_empty_and_strided(items):  # three small tensors: staged together
    x, y = _xs_ys(items)
    return {"x": x, "none": torch.empty(0, dtype=torch.int64), "y": y.repeat_interleave(2)[::2]}


def _with_strided_labels(items):  # the one small tensor not contiguous: staged
    x, y = _xs_ys(items)
    return {"x": x, "y": y.repeat_interleave(2)[::2]}


@pytest.mark.parametrize(
    "collate,narrow",
    [(_as_tuple, False), (_as_namedtuple, False), (_as_dataclass, False),
     (_with_empty_and_strided, False), (_with_strided_labels, False), (_as_tuple, True)],
    ids=["tuple", "namedtuple", "dataclass", "empty-and-strided", "strided-labels", "narrowed"],
)  # fmt: skip
def test_worker_fed_batches_of_any_shape_arrive_exact_in_every_epoch(cuda, collate, narrow):
    """Batches from DataLoader's pin thread, whatever their container and small tensors
    (laid out without asking each tensor whether it is pinned, the labels copied where they
    lie when they are the one small tensor), arrive as the workers made them, epoch after
    epoch."""
    source = DataLoader(_Filled(), batch_size=16, num_workers=2, collate_fn=collate)
    expected_x = torch.arange(24 * 16, dtype=torch.float32) * (1 << 14)
    with DeviceLoader(source, cuda, narrow=narrow) as loader:
        for _ in range(2):
            xs, ys = [], []
            for batch in loader:
                if isinstance(batch, dict):
                    x, y = batch["x"], batch["y"]
                    assert batch.get("none", torch.empty(0)).numel() == 0
                else:
                    x, y = (batch.x, batch.y) if hasattr(batch, "x") else batch
                assert x.is_cuda and y.is_cuda and y.dtype == torch.int64
                xs.append(x.sum(dim=1))
                ys.append(y)
            assert torch.equal(torch.cat(xs).cpu(), expected_x)
            assert torch.cat(ys).cpu().tolist() == list(range(24 * 16))
    assert type(batch) is type(collate([{"x": torch.zeros(1), "y": 0}]))


def test_batches_copied_as_read_hold_bounded_device_memory_when_the_host_runs_ahead(cuda):
    """The consumer's stream kept far behind (2 ms a batch), the host free to run ahead:
    the device memory that batches copied as they were read hold stays within a few
    batches, not one block per batch the host got ahead."""
    nbytes = 8 << 20
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    total = torch.zeros((), device=cuda.torch)
    with DeviceLoader(_refilled(40, nbytes // 4, True, torch.float32), cuda) as loader:
        for batch in loader:
            _busy(2.0)
            total += batch[0]
    torch.cuda.synchronize()
    assert total.item() == sum(range(40))
    held = torch.cuda.max_memory_allocated() - base
    assert held <= (issuing.EARLY_AHEAD + loader.depth + 4) * nbytes, held / nbytes


def test_timed_batches_copied_as_read_report_their_copy_time(cuda):
    with DeviceLoader(_refilled(8, 1 << 20, True, torch.float32), cuda, timing=True) as loader:
        for batch in loader:
            batch.sum()
    stats = loader.stats
    assert stats.batches == 8 and stats.transfer_ms > 0
