"""ResidentLoader and BatchCursor on the cpu: epoch orders, partial batches, consecutive and
independent iterators, resume at any batch, ranks, the streamed path against the resident one,
and the cursor against the iterator."""

from __future__ import annotations

import itertools

import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.augment import Compose, Cutout, HorizontalFlip, Normalize, RandomCrop
from gpuflow.data.resident.dataset import ResidentDataset
from gpuflow.data.resident.keyed import order_keys, sample_keys
from gpuflow.data.resident.loader import ResidentLoader

N = 50  # samples of the small image dataset


def _ids(n: int = N) -> ResidentDataset:
    """A dataset whose only field is each sample's index."""
    return ResidentDataset(torch.arange(n), device="cpu", show_progress=False)


def _images(n: int = N, budget_bytes: int | None = None) -> ResidentDataset:
    """(n, 3, 8, 8) uint8 images and labels: the sample's index (so batches name samples)."""
    images = torch.randint(0, 256, (n, 3, 8, 8), generator=torch.Generator().manual_seed(0))
    return ResidentDataset(
        images.to(torch.uint8),
        torch.arange(n),
        device="cpu",
        budget_bytes=budget_bytes,
        show_progress=False,
    )


def _augment() -> Compose:
    return Compose(
        RandomCrop(8, padding=2), HorizontalFlip(), Cutout(3), Normalize((0.5,) * 3, (0.25,) * 3)
    )


def _epoch(loader: ResidentLoader) -> list[int]:
    """The sample ids of one epoch of an ids-dataset loader, in order."""
    return [i for (batch,) in loader for i in batch.tolist()]


def _batches(iterator) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in batch) for batch in iterator]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


# ---- lengths and orders ----------------------------------------------------------------------


def test_length_and_the_partial_last_batch():
    data = _ids(50)
    loader = ResidentLoader(data, 8, shuffle=False)
    assert len(loader) == 7
    sizes = [len(batch) for (batch,) in loader]
    assert sizes == [8] * 6 + [2]
    dropping = ResidentLoader(data, 8, shuffle=False, drop_last=True)
    assert len(dropping) == 6
    assert [len(batch) for (batch,) in dropping] == [8] * 6
    assert len(ResidentLoader(_ids(48), 8)) == len(ResidentLoader(_ids(48), 8, drop_last=True))


def test_without_shuffle_an_epoch_is_every_sample_in_order():
    loader = ResidentLoader(_ids(), 7, shuffle=False)
    assert _epoch(loader) == list(range(N))
    assert _epoch(loader) == list(range(N))  # every epoch


def test_with_shuffle_each_epoch_is_a_different_permutation():
    loader = ResidentLoader(_ids(), 8, seed=3)
    epochs = [_epoch(loader) for _ in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(N))  # every sample once
        assert order != list(range(N))
    assert len({tuple(order) for order in epochs}) == 4
    # Epoch e is the stable argsort of order_keys(seed, e, N).
    for e, order in enumerate(epochs):
        keys = order_keys(3, e, N, torch.device("cpu"))
        assert order == torch.argsort(keys, stable=True).tolist()
        assert order == loader.order(e).tolist()


def test_the_order_depends_on_the_seed_only():
    first = [_epoch(ResidentLoader(_ids(), 8, seed=1)) for _ in range(2)]
    again = [_epoch(ResidentLoader(_ids(), 8, seed=1)) for _ in range(2)]
    assert first == again
    assert _epoch(ResidentLoader(_ids(), 8, seed=2)) != first[0]
    # Nor on the batch size: the same permutation cut differently.
    assert _epoch(ResidentLoader(_ids(), 13, seed=1)) == first[0]


def test_iterating_twice_gives_consecutive_epochs_and_set_epoch_jumps():
    loader = ResidentLoader(_ids(), 8, seed=0)
    first, second = _epoch(loader), _epoch(loader)
    assert first == loader.order(0).tolist() and second == loader.order(1).tolist()
    loader.set_epoch(7)
    assert _epoch(loader) == loader.order(7).tolist()
    assert _epoch(loader) == loader.order(8).tolist()
    loader.set_epoch(0)
    assert _epoch(loader) == first


def test_two_iterators_at_once_are_independent_epochs():
    loader = ResidentLoader(_ids(), 8, seed=4)
    pairs = list(zip(loader, loader, strict=True))
    assert len(pairs) == len(loader)
    assert [i for (a,), _ in pairs for i in a.tolist()] == loader.order(0).tolist()
    assert [i for _, (b,) in pairs for i in b.tolist()] == loader.order(1).tolist()
    assert _epoch(loader) == loader.order(2).tolist()


def test_an_early_break_then_the_next_iter_starts_the_next_epoch():
    loader = ResidentLoader(_ids(), 8, seed=0)
    for step, _ in enumerate(loader):
        if step == 2:
            break
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["step"] == 3
    assert _epoch(loader) == loader.order(1).tolist()


def test_the_transform_is_keyed_by_seed_epoch_and_place():
    data = _images()
    augment = _augment()
    loader = ResidentLoader(data, 16, seed=9, transform=augment)
    plain = ResidentLoader(data, 16, seed=9)
    for epoch in range(2):
        for step, ((x, y), (raw, raw_y)) in enumerate(zip(loader, plain, strict=True)):
            assert torch.equal(y, raw_y)
            places = torch.arange(step * 16, step * 16 + len(y))
            assert torch.equal(x, augment(raw, sample_keys(9, epoch, places)))
            assert x.dtype == torch.float32 and x.shape == (len(y), 3, 8, 8)


# ---- resume -----------------------------------------------------------------------------------


@pytest.mark.parametrize("taken", [0, 1, 3, 4, 7])  # 4 batches an epoch: 4 is an epoch's end
def test_a_resumed_loader_continues_with_the_remaining_batches(taken):
    data = _images(30)

    def make():
        return ResidentLoader(data, 8, seed=5, transform=_augment())

    whole = make()
    reference = _batches(itertools.chain(whole, whole))  # two uninterrupted epochs
    first = make()
    stream = itertools.chain.from_iterable(iter(first) for _ in range(2))
    done = _batches(itertools.islice(stream, taken))
    assert _same(done, reference[:taken])
    state = first.state_dict()
    expected = (0, 0) if taken == 0 else ((taken - 1) // 4, (taken - 1) % 4 + 1)
    assert (state["epoch"], state["step"]) == expected  # after the last batch handed out
    resumed = make()
    resumed.load_state_dict(state)
    rest = _batches(itertools.chain(resumed, resumed))
    assert _same(rest[: len(reference) - taken], reference[taken:])
    # Then the epochs after: at an epoch's end the resumed loader goes on with the next one.
    assert _same(rest[len(reference) - taken :], _batches(whole)[: len(rest) + taken - 8])


def test_the_state_dict_names_the_settings_and_refuses_others():
    loader = ResidentLoader(_ids(), 8, seed=1)
    next(iter(loader))
    state = loader.state_dict()
    assert state == {
        "epoch": 0,
        "step": 1,
        "samples": N,
        "batch_size": 8,
        "world_size": 1,
        "seed": 1,
        "shuffle": True,
        "drop_last": False,
    }
    for changed in (
        ResidentLoader(_ids(), 10, seed=1),
        ResidentLoader(_ids(), 8, seed=2),
        ResidentLoader(_ids(), 8, seed=1, shuffle=False),
        ResidentLoader(_ids(), 8, seed=1, drop_last=True),
        ResidentLoader(_ids(60), 8, seed=1),
    ):
        with pytest.raises(GpuflowError, match="saved loader position was taken with"):
            changed.load_state_dict(state)
    with pytest.raises(GpuflowError, match=r"batch_size 8 \(now 10\)"):
        ResidentLoader(_ids(), 10, seed=1).load_state_dict(state)
    # A bare position is taken as is.
    bare = ResidentLoader(_ids(), 8, seed=1)
    bare.load_state_dict({"epoch": 2, "step": 3})
    assert bare.state_dict()["epoch"] == 2 and bare.state_dict()["step"] == 3
    assert _epoch(bare) == loader.order(2).tolist()[24:]


# ---- ranks ------------------------------------------------------------------------------------


def test_ranks_take_disjoint_shares_of_each_epoch():
    data = _ids(1000)
    loaders = [ResidentLoader(data, 64, seed=2, rank=r, world_size=3) for r in range(3)]
    for epoch in range(2):
        shares = [_epoch(loader) for loader in loaders]
        assert [len(s) for s in shares] == [333] * 3
        assert len(set().union(*shares)) == 999
        order = loaders[0].order(epoch).tolist()
        for r, share in enumerate(shares):
            assert share == order[r:999:3]  # every third place


def test_rank_and_world_size_go_together():
    with pytest.raises(GpuflowError, match="both rank and world_size"):
        ResidentLoader(_ids(), 8, rank=1)
    with pytest.raises(GpuflowError, match="both rank and world_size"):
        ResidentLoader(_ids(), 8, world_size=2)
    with pytest.raises(GpuflowError, match=r"rank must be in \[0, world_size\)"):
        ResidentLoader(_ids(), 8, rank=2, world_size=2)


def test_bad_loader_arguments():
    with pytest.raises(GpuflowError, match="takes a ResidentDataset, got Tensor"):
        ResidentLoader(torch.arange(10), 4)
    with pytest.raises(GpuflowError, match="batch_size must be an integer of at least 1"):
        ResidentLoader(_ids(), 0)
    with pytest.raises(GpuflowError) as error:
        ResidentLoader(_ids(), 64, drop_last=True)
    assert str(error.value).endswith("no full batch of 64; use a smaller batch or drop_last=False")
    assert len(ResidentLoader(_ids(), 64)) == 1  # without drop_last: one partial batch
    with pytest.raises(GpuflowError) as error:
        ResidentLoader(_ids(3), 2, rank=1, world_size=4)
    assert str(error.value).endswith("3 samples over 4 ranks give rank 1 none; use fewer ranks")


# ---- the streamed path -------------------------------------------------------------------------


def _streamed_pair(rank=None, world_size=None, drop_last=False, n=N):
    resident = _images(n)
    streamed = _images(n, budget_bytes=1)
    assert resident.resident and not streamed.resident
    kw = dict(seed=11, transform=_augment(), rank=rank, world_size=world_size, drop_last=drop_last)
    a = ResidentLoader(resident, 8, **kw)
    # Two batches a chunk: 7 batches an epoch make 4 chunks, the last one partial.
    b = ResidentLoader(streamed, 8, chunk_bytes=2 * 8 * streamed.sample_bytes + 5, **kw)
    assert b.chunk_steps == 2
    return a, b


def test_the_streamed_loader_gives_the_resident_batches():
    resident, streamed = _streamed_pair()
    assert len(streamed) == 7
    with streamed:
        for _ in range(2):
            want, got = _batches(resident), _batches(streamed)
            assert len(got) == 7 and len(got[-1][1]) == 2  # the partial last batch
            assert _same(got, want)


def test_the_streamed_loader_for_ranks_and_drop_last():
    for rank in range(2):
        resident, streamed = _streamed_pair(rank, 2, drop_last=True, n=41)
        with streamed:
            assert len(streamed) == 2
            assert _same(_batches(streamed), _batches(resident))


def test_the_streamed_loader_resumes_after_an_early_break():
    resident, streamed = _streamed_pair()
    reference = _batches(itertools.chain(resident, resident))
    with streamed:
        got = _batches(itertools.islice(streamed, 3))  # breaks inside the second chunk
        assert _same(got, reference[:3])
        state = streamed.state_dict()
    _, resumed = _streamed_pair()
    resumed.load_state_dict(state)
    with resumed:
        rest = _batches(itertools.chain(resumed, resumed))
    assert _same(rest[:11], reference[3:])
    # The early-broken loader's next iter() is epoch 1, whole.
    with streamed:
        assert _same(_batches(streamed), reference[7:])


def test_a_closed_loader_streams_again():
    resident, streamed = _streamed_pair()
    want = _batches(resident)
    first = _batches(streamed)
    streamed.close()
    assert streamed._reader is None and streamed._pool is None
    assert _same(first, want)
    assert _same(_batches(streamed), _batches(resident))  # epoch 1, on a new thread
    streamed.close()
    streamed.close()  # twice is harmless
    # Closed in the middle of an epoch, the same iterator carries on.
    iterator = iter(streamed)
    head = _batches(itertools.islice(iterator, 3))
    streamed.close()
    tail = _batches(iterator)
    streamed.close()
    assert _same(head + tail, _batches(resident))


# ---- the cursor -------------------------------------------------------------------------------


def test_cursor_draws_the_full_batches_the_iterator_gives():
    data = _images()
    loader = ResidentLoader(data, 8, seed=6, transform=_augment())
    cursor = loader.cursor()
    assert len(cursor) == 6 and len(loader) == 7  # the partial batch is never drawn
    for epoch in (0, 1, 5):
        loader.set_epoch(epoch)
        want = _batches(loader)[:6]
        cursor.start_epoch(epoch)
        got = [tuple(t.clone() for t in cursor.draw()) for _ in range(len(cursor))]
        assert _same(got, want)
        assert cursor.state_dict()["step"] == 6 and cursor.state_dict()["epoch"] == epoch


def test_cursor_state_and_resume():
    data = _images()

    def make():
        return ResidentLoader(data, 8, seed=6, transform=_augment())

    reference = make().cursor()
    reference.start_epoch(0)
    want = [reference.draw() for _ in range(6)]
    reference.start_epoch(1)
    want += [reference.draw() for _ in range(6)]

    cursor = make().cursor()
    cursor.start_epoch(0)
    for _ in range(3):
        cursor.draw()
    state = cursor.state_dict()
    assert (state["epoch"], state["step"], state["batch_size"], state["seed"]) == (0, 3, 8, 6)
    resumed = make().cursor()
    resumed.load_state_dict(state)
    assert _same([resumed.draw() for _ in range(3)], want[3:6])
    # Saved at the epoch's end: the next epoch.
    at_end = make().cursor()
    at_end.load_state_dict({**state, "step": 6})
    assert at_end.epoch == 1
    assert _same([at_end.draw() for _ in range(6)], want[6:])
    # A loader's position, taken by the iterator, resumes a cursor too.
    loader = make()
    next(iter(loader))
    from_loader = make().cursor()
    from_loader.load_state_dict(loader.state_dict())
    assert _same([from_loader.draw()], want[1:2])
    with pytest.raises(GpuflowError, match="saved loader position"):
        ResidentLoader(data, 4, seed=6).cursor().load_state_dict(state)


def test_cursor_refuses_a_streamed_dataset_and_a_draw_before_an_epoch():
    with pytest.raises(GpuflowError, match="streams from the host"):
        ResidentLoader(_images(budget_bytes=1), 8).cursor()
    cursor = ResidentLoader(_images(), 8).cursor()
    with pytest.raises(GpuflowError, match="start_epoch"):
        cursor.draw()
    with pytest.raises(GpuflowError, match="start_epoch"):
        cursor.state_dict()


def test_a_checkpoint_before_an_epochs_first_batch_resumes_that_epoch():
    loader = ResidentLoader(_ids(), 10, seed=3)
    list(loader)  # epoch 0
    iterator = iter(loader)  # epoch 1 begun, nothing drawn yet
    state = loader.state_dict()
    assert (state["epoch"], state["step"]) == (1, 0)
    resumed = ResidentLoader(_ids(), 10, seed=3)
    resumed.load_state_dict(state)
    assert _same(_batches(resumed), _batches(iterator))


def test_set_epoch_keeps_a_resumed_position_in_that_epoch_and_moves_the_state():
    loader = ResidentLoader(_ids(), 10, seed=3)
    loader.load_state_dict({"epoch": 2, "step": 3})
    loader.set_epoch(2)  # the usual call at the top of each epoch: the resumed step stays
    reference = ResidentLoader(_ids(), 10, seed=3)
    reference.set_epoch(2)
    assert _same(_batches(loader), _batches(reference)[3:])
    loader.set_epoch(5)
    assert (loader.state_dict()["epoch"], loader.state_dict()["step"]) == (5, 0)
    loader.set_epoch(5)
    first = next(iter(loader))
    reference.set_epoch(5)
    assert torch.equal(first[0], next(iter(reference))[0])


def test_loading_a_cursor_leaves_the_loaders_own_position_alone():
    data = _images(30)
    loader = ResidentLoader(data, 4, seed=6, drop_last=True)
    list(loader)
    before = loader.state_dict()
    cursor = loader.cursor()
    cursor.load_state_dict({**before, "epoch": 4, "step": 2})
    assert loader.state_dict() == before
    assert cursor.state_dict()["epoch"] == 4 and cursor.state_dict()["step"] == 2


def test_under_a_process_group_each_rank_takes_its_own_share(monkeypatch):
    import torch.distributed as dist

    taken = []
    for rank in range(2):  # each rank of a group of two, as torch.distributed reports it
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        loader = ResidentLoader(_ids(), 10, seed=4)  # no rank given: torch.distributed's
        assert (loader.rank, loader.world_size) == (rank, 2)
        taken.append(torch.cat([ids for (ids,) in loader]))
        monkeypatch.undo()
    assert len(taken[0]) == len(taken[1]) == N // 2
    assert sorted(torch.cat(taken).tolist()) == list(range(N))
    for rank in range(2):
        alone = ResidentLoader(_ids(), 10, seed=4, rank=rank, world_size=2)
        assert torch.equal(taken[rank], torch.cat([ids for (ids,) in alone]))
    assert (ResidentLoader(_ids(), 10).rank, ResidentLoader(_ids(), 10).world_size) == (0, 1)
