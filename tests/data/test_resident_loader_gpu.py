"""ResidentDataset and ResidentLoader on a cuda device: narrowed storage in device memory, the
same batches as on the cpu, a training step captured with its draw in a CUDA graph, no bus
crossing or host wait while drawing, and the streamed path against the resident one."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from gpuflow.accounting.ledger import TransferLedger
from gpuflow.data.resident.augment import Compose, Cutout, HorizontalFlip, Normalize, RandomCrop
from gpuflow.data.resident.dataset import ResidentDataset
from gpuflow.data.resident.loader import ResidentLoader

pytestmark = pytest.mark.gpu

N, B = 100, 16  # 6 full batches an epoch and a partial one of 4
MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)


@pytest.fixture
def cuda(accel):
    if accel.type != "cuda":
        pytest.skip("CUDA graphs and the cuda copy streams: cuda")
    return accel


def _fields() -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 3, 8, 8) uint8 images and int64 labels 0-9, on the host."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (N, 3, 8, 8), generator=g).to(torch.uint8)
    return images, torch.arange(N) % 10


def _dataset(device, budget_bytes=None) -> ResidentDataset:
    return ResidentDataset(
        *_fields(), device=device, budget_bytes=budget_bytes, show_progress=False
    )


def _pixels() -> Compose:
    """Augmentations that only move and zero pixels: exact on any device."""
    return Compose(RandomCrop(8, padding=2), HorizontalFlip(), Cutout(3))


def _augment() -> Compose:
    return Compose(RandomCrop(8, padding=2), HorizontalFlip(), Cutout(3), Normalize(MEAN, STD))


def _batches(iterator) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in batch) for batch in iterator]


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        for a, b in zip(g, w, strict=True):
            assert a.device == b.device and a.dtype == b.dtype
            assert torch.equal(a, b)


def test_a_dataset_on_the_device_is_stored_narrowed(cuda):
    images, labels = _fields()
    data = _dataset(cuda)
    assert data.resident and data.device.type == "cuda"
    stored_images, stored_labels = data.tensors
    assert stored_images.is_cuda and stored_images.dtype == torch.uint8
    assert stored_labels.is_cuda and stored_labels.dtype == torch.uint8  # 0-9: one byte
    assert data.nbytes == N * (3 * 8 * 8 + 1)
    index = torch.tensor([99, 0, 42, 42], device=cuda.torch)
    x, y = data.gather(index)
    assert x.dtype == torch.uint8 and y.dtype == torch.int64 and y.is_cuda
    assert torch.equal(x.cpu(), images[index.cpu()]) and torch.equal(y.cpu(), labels[index.cpu()])


def test_the_device_loader_gives_the_cpu_loaders_batches(cuda):
    on_cpu, on_device = _dataset("cpu"), _dataset(cuda)
    for transform in (None, _pixels()):
        a = ResidentLoader(on_cpu, B, seed=7, transform=transform)
        b = ResidentLoader(on_device, B, seed=7, transform=transform)
        for _ in range(2):  # two epochs
            want = [tuple(t.to(cuda.torch) for t in batch) for batch in _batches(a)]
            _assert_same(_batches(b), want)
    # Normalize's arithmetic may round differently on the two devices, by an ulp at most.
    a = ResidentLoader(on_cpu, B, seed=7, transform=_augment())
    b = ResidentLoader(on_device, B, seed=7, transform=_augment())
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(ya.to(cuda.torch), yb)
        torch.testing.assert_close(xb, xa.to(cuda.torch))


def test_the_compiled_transform_gives_the_eager_ones_batches(cuda):
    data = _dataset(cuda)
    compiled = ResidentLoader(data, B, seed=3, transform=_augment())
    assert compiled.compiled  # on cuda by default
    eager = ResidentLoader(data, B, seed=3, transform=_augment(), compile=False)
    for _ in range(2):  # two epochs, the partial last batch of each included
        for (xa, ya), (xb, yb) in zip(eager, compiled, strict=True):
            assert torch.equal(ya, yb)
            torch.testing.assert_close(xb, xa)  # fused arithmetic may round by an ulp
    pixels_only = ResidentLoader(data, B, seed=3, transform=_pixels())
    _assert_same(
        _batches(pixels_only),
        _batches(ResidentLoader(data, B, seed=3, transform=_pixels(), compile=False)),
    )


def _captured_step(loader: ResidentLoader, cuda):
    """A model, its optimizer and a graph whose replay draws a batch from ``loader``'s cursor,
    keeps a copy of it in static buffers and trains one step on it (torch.cuda.graphs'
    whole-network capture: three warm-up steps on a side stream first)."""
    torch.manual_seed(0)
    device = cuda.torch
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    cursor = loader.cursor()
    seen_x = torch.zeros(B, 3, 8, 8, device=device)
    seen_y = torch.zeros(B, dtype=torch.int64, device=device)

    def step() -> torch.Tensor:
        x, y = cursor.draw()
        seen_x.copy_(x)
        seen_y.copy_(y)
        loss = F.cross_entropy(model(x.float().flatten(1)), y)
        loss.backward()
        optimizer.step()
        return loss

    cursor.start_epoch(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    optimizer.zero_grad(set_to_none=True)  # backward in the graph writes fresh static grads
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    return model, cursor, graph, loss, seen_x, seen_y


def test_a_captured_step_draws_the_iterators_batches(cuda):
    data = _dataset(cuda)
    loader = ResidentLoader(data, B, seed=3, transform=_augment())
    want = {}
    for epoch in range(2):
        loader.set_epoch(epoch)
        want[epoch] = _batches(loader)
    model, cursor, graph, loss, seen_x, seen_y = _captured_step(loader, cuda)
    assert len(cursor) == N // B == 6
    weights = [p.detach().clone() for p in model.parameters()]
    losses = []
    for epoch in range(2):
        cursor.start_epoch(epoch)  # the warm-up's draws moved the cursor: back to step 0
        for step in range(len(cursor)):
            graph.replay()
            losses.append(loss.clone())
            if step < 3:
                x, y = want[epoch][step]
                assert torch.equal(seen_y, y)
                assert torch.equal(seen_x, x)
        state = cursor.state_dict()
        assert (state["epoch"], state["step"]) == (epoch, len(cursor))
    assert torch.isfinite(torch.stack(losses)).all()
    # The replays trained the model.
    assert any(not torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_replays_and_eager_draws_cross_no_bus_and_never_wait(cuda):
    data = _dataset(cuda)
    loader = ResidentLoader(data, B, seed=3, transform=_augment())
    _, cursor, graph, _, _, _ = _captured_step(loader, cuda)
    cursor.start_epoch(1)
    graph.replay()  # the first replay after capture uploads the graph
    torch.cuda.synchronize()
    with TransferLedger(cuda) as ledger:
        for _ in range(len(cursor) - 1):
            graph.replay()
            ledger.step()
    totals = ledger.summary().totals
    assert (totals.h2d_bytes, totals.d2h_bytes, totals.syncs) == (0, 0, 0), ledger.events
    assert all(s.h2d_bytes == 0 and s.syncs == 0 for s in ledger.summary().steps)

    loader.set_epoch(2)
    next(iter(loader))  # the transform's tables are made once, on the device
    torch.cuda.synchronize()
    with TransferLedger(cuda) as ledger:
        batches = 0
        for x, y in loader:  # epoch 3: the order drawn, then every batch gathered
            assert x.is_cuda and y.is_cuda
            batches += 1
    assert batches == len(loader) == 7
    totals = ledger.summary().totals
    assert (totals.h2d_bytes, totals.d2h_bytes, totals.syncs) == (0, 0, 0), ledger.events


def test_the_streamed_path_on_the_device_gives_the_resident_batches(cuda):
    resident = _dataset(cuda)
    streamed = _dataset(cuda, budget_bytes=1)
    assert resident.resident and not streamed.resident and streamed.nbytes == 0
    assert not streamed.tensors[0].is_cuda
    chunk = 2 * B * streamed.sample_bytes  # two batches a chunk: 4 chunks, the last partial
    a = ResidentLoader(resident, B, seed=5, transform=_augment())
    with ResidentLoader(streamed, B, seed=5, transform=_augment(), chunk_bytes=chunk) as b:
        assert b.chunk_steps == 2
        for _ in range(2):
            want, got = _batches(a), _batches(b)
            assert len(got[-1][1]) == N % B
            _assert_same(got, want)
        # An early break and a resume from its position.
        reference = _batches(a)
        head = _batches(itertools.islice(b, 3))
        state = b.state_dict()
    _assert_same(head, reference[:3])
    with ResidentLoader(streamed, B, seed=5, transform=_augment(), chunk_bytes=chunk) as c:
        c.load_state_dict(state)
        _assert_same(_batches(c), reference[3:])


def test_the_streamed_uploads_are_counted_by_the_ledger(cuda):
    streamed = _dataset(cuda, budget_bytes=1)
    chunk = 2 * B * streamed.sample_bytes
    with (
        ResidentLoader(streamed, B, seed=5, chunk_bytes=chunk) as loader,
        TransferLedger(cuda) as ledger,
    ):
        batches = sum(1 for _ in loader)
    assert batches == 7
    # Every sample crosses once an epoch, in its stored (narrowed) types.
    assert ledger.summary().totals.h2d_bytes == N * streamed.sample_bytes


def test_samples_larger_than_an_upload_piece_cross_whole(cuda):
    # Each sample 80 MiB, over the 64 MiB pieces the upload copies at a time.
    g = torch.Generator().manual_seed(1)
    volumes = torch.randint(0, 256, (2, 80 << 20), generator=g).to(torch.uint8)
    data = ResidentDataset(volumes, torch.tensor([3, 4]), device=cuda, show_progress=False)
    assert data.resident and data.tensors[0].device.type == "cuda"
    got, labels = data.gather(torch.tensor([1, 0], device=cuda.torch))
    assert torch.equal(got.cpu(), volumes.flip(0)) and labels.tolist() == [4, 3]


def test_compiled_draws_give_contiguous_crops_and_a_custom_transform_the_real_last_rows(cuda):
    seen: list[int] = []

    def centred(images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        seen.append(len(keys))  # at trace and eager calls: the sizes the transform was given
        x = images.float()
        return x - x.mean(0, keepdim=True)  # a batch statistic: padded rows would skew it

    data = _dataset(cuda)
    loader = ResidentLoader(data, B, seed=2, transform=Compose(RandomCrop(8, 2), centred))
    assert loader.compiled
    batches = _batches(loader)
    assert [len(x) for x, _ in batches] == [B] * 6 + [N % B]
    assert set(seen) <= {1, B, N % B} and N % B in seen
    eager = ResidentLoader(
        data, B, seed=2, compile=False, transform=Compose(RandomCrop(8, 2), centred)
    )
    for (x, y), (xe, ye) in zip(batches, eager, strict=True):
        assert x.is_contiguous() and torch.equal(y, ye)
        torch.testing.assert_close(x, xe)
    crops = ResidentLoader(data, B, seed=2, transform=RandomCrop((6, 8), 1))
    for x, _ in crops:
        assert x.shape[1:] == (3, 6, 8) and x.is_contiguous()
        assert x.view(len(x), -1).shape[1] == 3 * 6 * 8
