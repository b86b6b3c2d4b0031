"""ResidentDataset and ResidentLoader where torch's own pieces would be: what a transform
must give back (a torchvision transform is refused in one line), the real rows of the last
partial batch given to a custom transform, indexing and a DataLoader over the dataset, and a
loader that pickles and copies."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.augment import Compose, HorizontalFlip, RandomCrop
from gpuflow.data.resident.dataset import ResidentDataset
from gpuflow.data.resident.keyed import sample_keys
from gpuflow.data.resident.loader import ResidentLoader

N, B = 20, 8  # batches of 8, 8 and 4


def _data(budget_bytes: int | None = None) -> ResidentDataset:
    images = torch.randint(0, 256, (N, 3, 5, 5), generator=torch.Generator().manual_seed(1))
    return ResidentDataset(
        images.to(torch.uint8),
        torch.arange(N) * 10,
        device="cpu",
        budget_bytes=budget_bytes,
        show_progress=False,
    )


# ---- what a transform gives back ---------------------------------------------------------------


class _LikeTorchvisionV2:
    """Takes its arguments as torchvision's v2 transforms do: several inputs come back as a
    tuple, each transformed with one draw."""

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...] | torch.Tensor:
        return inputs if len(inputs) > 1 else inputs[0]


@pytest.mark.parametrize("budget_bytes", [None, 1], ids=["resident", "streamed"])
def test_a_transform_that_returns_a_tuple_is_refused_in_one_line(budget_bytes):
    loader = ResidentLoader(_data(budget_bytes), B, transform=_LikeTorchvisionV2())
    with pytest.raises(GpuflowError) as caught, loader:
        next(iter(loader))
    message = str(caught.value)
    assert "\n" not in message
    assert "transform(images, keys) and must return the images" in message
    assert "_LikeTorchvisionV2 returned a tuple" in message
    assert "lambda images, keys: t(images)" in message


@pytest.mark.parametrize(
    "transform,got",
    [
        (lambda images, keys: images[:1], r"a tensor of shape \(1, 3, 5, 5\)"),
        (lambda images, keys: images.sum(), r"a tensor of shape \(\)"),
        (lambda images, keys: [images], "a list"),
    ],
)
def test_a_transform_must_return_one_tensor_with_the_batchs_rows(transform, got):
    with pytest.raises(
        GpuflowError, match=rf"a row per sample \(8 here\); <lambda> returned {got}"
    ):
        next(iter(ResidentLoader(_data(), B, transform=transform)))


def test_a_wrapped_images_only_transform_is_taken():
    flip = ResidentLoader(_data(), B, shuffle=False, transform=lambda x, keys: x.flip(-1))
    plain = ResidentLoader(_data(), B, shuffle=False)
    for (x, _), (raw, _) in zip(flip, plain, strict=True):
        assert torch.equal(x, raw.flip(-1))


def test_a_torchvision_v2_transform_is_refused_and_works_wrapped():
    v2 = pytest.importorskip("torchvision.transforms.v2")
    with pytest.raises(GpuflowError, match="RandomHorizontalFlip returned a tuple"):
        next(iter(ResidentLoader(_data(), B, transform=v2.RandomHorizontalFlip())))
    flip = v2.RandomHorizontalFlip(p=1.0)
    loader = ResidentLoader(_data(), B, shuffle=False, transform=lambda x, keys: flip(x))
    x, _ = next(iter(loader))
    assert torch.equal(x, _data().tensors[0][:B].flip(-1))


# ---- the last partial batch ---------------------------------------------------------------------


class _Recording:
    """A batch-level transform (as MixUp is): it records the rows it was given."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        self.seen.append(keys.clone())
        return images - images.float().mean(0, keepdim=True).to(images.dtype)


@pytest.mark.parametrize("budget_bytes", [None, 1], ids=["resident", "streamed"])
def test_a_custom_transform_sees_the_real_rows_of_the_last_partial_batch(budget_bytes):
    transform = _Recording()
    with ResidentLoader(_data(budget_bytes), B, seed=2, transform=transform) as loader:
        batches = list(loader)
    assert [len(keys) for keys in transform.seen] == [8, 8, 4]  # not 8, 8, 8
    assert [len(x) for x, _ in batches] == [8, 8, 4]
    # The keys are those of the batch's own places: the last one holds places 16-19 alone.
    assert torch.equal(transform.seen[2], sample_keys(2, 0, torch.arange(16, 20)))
    # Its statistics are of its own four samples, with none repeated.
    data, order = _data(), loader.order(0)
    raw = data.tensors[0][order[16:]]
    assert torch.equal(batches[2][0], raw - raw.float().mean(0, keepdim=True).to(raw.dtype))
    assert torch.equal(batches[2][1], order[16:] * 10)


def test_per_sample_transforms_give_the_last_batch_the_rows_a_full_draw_would():
    augment = Compose(RandomCrop(5, padding=1), HorizontalFlip())
    loader = ResidentLoader(_data(), B, seed=4, transform=augment)
    *_, (x, y) = list(loader)
    places = torch.arange(16, 20)
    raw = _data().tensors[0][loader.order(0)[places]]
    assert torch.equal(x, augment(raw, sample_keys(4, 0, places)))
    assert torch.equal(y, loader.order(0)[places] * 10)


# ---- a drop-in Dataset ---------------------------------------------------------------------------


def test_the_dataset_indexes_as_tensor_dataset_does():
    data = _data()
    images, labels = data.tensors[0], torch.arange(N) * 10
    assert isinstance(data, Dataset) and len(data) == N
    x, y = data[3]
    assert torch.equal(x, images[3]) and y.dtype == torch.int64 and int(y) == 30
    assert torch.equal(data[-1][1], labels[-1])
    assert torch.equal(data[2:5][1], labels[2:5])
    with pytest.raises(IndexError):
        data[N]
    assert len(list(data)) == N  # iterable, ending where the samples do
    # A streamed dataset (kept on the host, narrowed) gives the types it was given too.
    streamed = _data(budget_bytes=1)
    assert not streamed.resident and streamed.tensors[1].dtype == torch.uint8
    assert streamed[7][1].dtype == torch.int64 and int(streamed[7][1]) == 70


def test_a_dataloader_over_the_dataset_gives_its_samples():
    data = _data()
    batches = list(DataLoader(data, batch_size=B, shuffle=False))
    assert [len(y) for _, y in batches] == [8, 8, 4]
    assert torch.equal(torch.cat([y for _, y in batches]), torch.arange(N) * 10)
    assert torch.equal(torch.cat([x for x, _ in batches]), data.tensors[0])


# ---- pickle and copies ---------------------------------------------------------------------------


def _clone(batches) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in batch) for batch in batches]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(s, t) for s, t in zip(x, y, strict=True)) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("budget_bytes", [None, 1], ids=["resident", "streamed"])
@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy"])
def test_a_loader_pickles_and_copies_with_its_position(budget_bytes, how):
    augment = Compose(RandomCrop(5, padding=1), HorizontalFlip())
    loader = ResidentLoader(_data(budget_bytes), B, seed=3, transform=augment, chunk_bytes=1)
    with loader:
        batches = iter(loader)
        next(batches)  # on the streamed path, its thread and pinned buffers now exist
        saved = loader.state_dict()
        twin = {
            "pickle": lambda: pickle.loads(pickle.dumps(loader)),
            "deepcopy": lambda: copy.deepcopy(loader),
            "copy": lambda: copy.copy(loader),
        }[how]()
        checkpointed = pickle.dumps(loader)  # as torch.save would keep it, mid-epoch
        rest, after = _clone(batches), _clone(loader)  # epoch 0's rest, then epoch 1
    assert twin.state_dict() == saved and (twin.dataset is loader.dataset) == (how == "copy")
    with twin:
        assert twin._reader is None and twin._pool is None
        # The copy holds no epoch iterator: its next iter() carries on with the rest of the
        # epoch (saved in a checkpoint mid-epoch, no batch is skipped), then the next one.
        assert len(rest) == 2 and _same(_clone(twin), rest)
        assert _same(_clone(twin), after)
        twin.load_state_dict(saved)
        assert _same(_clone(twin), rest)
    with pickle.loads(checkpointed) as resumed:
        resumed.set_epoch(saved["epoch"])  # the documented resume loop keeps the position
        assert _same(_clone(resumed), rest)


def test_a_single_value_and_a_fractional_batch_size_are_refused():
    with pytest.raises(GpuflowError, match="is a single value"):
        ResidentDataset(np.array(3), device="cpu")
    data = ResidentDataset(torch.arange(20), device="cpu")
    with pytest.raises(
        GpuflowError, match=r"batch_size must be an integer of at least 1, got 8\.0"
    ):
        ResidentLoader(data, 8.0)
    assert len(ResidentLoader(data, np.int64(8))) == 3
