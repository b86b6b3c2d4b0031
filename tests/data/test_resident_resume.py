"""ResidentLoader resumed as a training loop resumes it: the loop that starts at the saved
epoch, with or without ``set_epoch`` at the top of each epoch, trains every epoch exactly
once whether the checkpoint was taken mid-epoch, right after an epoch's last batch or after
its loop ended, on the resident and the streamed path; and seeds of all 64 bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.augment import Compose, HorizontalFlip, RandomCrop
from gpuflow.data.resident.dataset import ResidentDataset
from gpuflow.data.resident.keyed import STREAMS, hash32, sample_keys
from gpuflow.data.resident.loader import ResidentLoader

N, B, EPOCHS = 30, 8, 3  # 4 batches an epoch, the last of 6 samples: 12 batches in all
PER_EPOCH = 4


def _dataset(streamed: bool) -> ResidentDataset:
    """(N, 3, 6, 6) uint8 images and each sample's index as its label."""
    images = torch.randint(0, 256, (N, 3, 6, 6), generator=torch.Generator().manual_seed(0))
    return ResidentDataset(
        images.to(torch.uint8),
        torch.arange(N),
        device="cpu",
        budget_bytes=1 if streamed else None,
        show_progress=False,
    )


def _loader(data: ResidentDataset) -> ResidentLoader:
    # One batch a chunk on the streamed path, so a resume lands on every chunk boundary.
    transform = Compose(RandomCrop(6, padding=1), HorizontalFlip())
    return ResidentLoader(data, B, seed=7, transform=transform, chunk_bytes=1)


def _train(loader, start, set_epoch, stop=None):
    """The documented loop from epoch ``start``: each batch as (epoch, images, labels).
    ``stop`` is (batches, where): the loop is left right after that many batches ("batch"),
    or at the end of the epoch loop that holds the last of them ("epoch"), and the
    loader's state is taken there, as a checkpoint would."""
    seen = []
    for epoch in range(start, EPOCHS):
        if set_epoch:
            loader.set_epoch(epoch)
        for images, labels in loader:
            seen.append((epoch, images.clone(), labels.clone()))
            if stop is not None and stop == (len(seen), "batch"):
                return seen, loader.state_dict()
        if stop is not None and stop[1] == "epoch" and len(seen) >= stop[0]:
            return seen, loader.state_dict()
    return seen, loader.state_dict()


def _same(got, want) -> bool:
    return len(got) == len(want) and all(
        e == f and torch.equal(x, y) and torch.equal(a, b)
        for (e, x, a), (f, y, b) in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("set_epoch", [True, False], ids=["set_epoch", "no_set_epoch"])
def test_a_resume_from_any_batch_trains_every_epoch_once(streamed, set_epoch):
    data = _dataset(streamed)
    with _loader(data) as whole:
        reference, _ = _train(whole, 0, set_epoch)
    assert len(reference) == EPOCHS * PER_EPOCH
    assert [e for e, _, _ in reference] == [e for e in range(EPOCHS) for _ in range(PER_EPOCH)]
    # Every epoch end (after batches 4, 8 and 12) and every batch between, and before any.
    for taken in range(EPOCHS * PER_EPOCH + 1):
        with _loader(data) as first:
            if taken:
                head, state = _train(first, 0, set_epoch, stop=(taken, "batch"))
            else:  # saved before the first batch
                head, state = [], first.state_dict()
        expected = (0, 0) if taken == 0 else ((taken - 1) // PER_EPOCH, (taken - 1) % 4 + 1)
        assert (state["epoch"], state["step"]) == expected
        with _loader(data) as resumed:
            resumed.load_state_dict(state)
            tail, _ = _train(resumed, state["epoch"], set_epoch)
        assert len(head) + len(tail) == len(reference), (taken, len(tail))
        assert _same(head + tail, reference), taken


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("set_epoch", [True, False], ids=["set_epoch", "no_set_epoch"])
def test_a_checkpoint_after_an_epochs_loop_resumes_with_the_next_epoch(streamed, set_epoch):
    data = _dataset(streamed)
    with _loader(data) as whole:
        reference, _ = _train(whole, 0, set_epoch)
    for ended in range(1, EPOCHS + 1):  # the loops of epochs 0, 1 and 2 have run
        with _loader(data) as first:
            head, state = _train(first, 0, set_epoch, stop=(ended * PER_EPOCH, "epoch"))
        assert (state["epoch"], state["step"]) == (ended - 1, PER_EPOCH)
        with _loader(data) as resumed:
            resumed.load_state_dict(state)
            tail, _ = _train(resumed, state["epoch"], set_epoch)
        assert _same(head + tail, reference), ended


def test_at_an_epochs_end_iter_gives_that_epochs_rest_then_the_next_epoch():
    data = _dataset(False)
    loader = _loader(data)
    loader.load_state_dict({"epoch": 1, "step": PER_EPOCH})
    loader.set_epoch(1)  # the epoch the checkpoint was taken in: kept, and it is done
    assert list(loader) == []
    assert (loader.state_dict()["epoch"], loader.state_dict()["step"]) == (1, PER_EPOCH)
    loader.set_epoch(2)  # the next one: whole
    reference = _loader(data)
    reference.set_epoch(2)
    labels = [y.tolist() for _, y in loader]
    assert labels == [y.tolist() for _, y in reference]
    assert sorted(i for batch in labels for i in batch) == list(range(N))


# ---- seeds ------------------------------------------------------------------------------------


def _order(seed: int) -> list[int]:
    return ResidentLoader(_dataset(False), B, seed=seed).order(0).tolist()


def test_every_bit_of_a_64_bit_seed_changes_the_order_and_the_keys():
    positions = torch.arange(1000)
    orders = {seed: _order(seed) for seed in (0, 1 << 32, (1 << 32) + 1, 1 << 63, (1 << 64) - 1)}
    assert len({tuple(o) for o in orders.values()}) == len(orders)  # all different
    for seed in orders:
        assert sorted(orders[seed]) == list(range(N))
    keys = {s: sample_keys(s, 0, positions) for s in (0, 1 << 32, 1 << 40, 1 << 63)}
    for a in keys:
        for b in keys:
            if a != b:  # seeds that share their low half differ at every place
                assert not (keys[a] == keys[b]).any(), (a, b)
        assert keys[a].min() >= 0 and keys[a].max() < 1 << 32
    # A negative seed is its two's complement, as torch.manual_seed reads it.
    assert _order(-1) == orders[(1 << 64) - 1]

    # Seeds below 2**32 keep the keys (so the orders and augmentations) they always had:
    # three rounds of the hash over the seed, the epoch and the place.
    for seed in (0, 5, (1 << 32) - 1):
        base = hash32(torch.full_like(positions, seed) ^ STREAMS[0])
        assert torch.equal(sample_keys(seed, 3, positions), hash32(hash32(base ^ 3) ^ positions))


def test_the_augmentation_of_a_sample_follows_the_whole_seed():
    data = _dataset(False)
    flips = []
    for seed in (0, 1 << 32):
        loader = ResidentLoader(data, N, seed=seed, shuffle=False, transform=HorizontalFlip())
        flips.append(next(iter(loader))[0])
    assert not torch.equal(flips[0], flips[1])


@pytest.mark.parametrize("seed", [1 << 64, -(1 << 63) - 1, 1.5, "0", True, None])
def test_seeds_torch_would_refuse_are_refused_in_one_line(seed):
    with pytest.raises(GpuflowError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"):
        ResidentLoader(_dataset(False), B, seed=seed)


def test_a_numpy_integer_seed_is_taken_as_the_int():
    loader = ResidentLoader(_dataset(False), B, seed=np.int64(3))
    assert loader.seed == 3 and type(loader.seed) is int
    assert loader.order(0).tolist() == _order(3)
