"""ResidentDataset on the cpu: the narrowed storage types and exact values back, its own copy,
the host fallback over budget, map-style datasets, PIL images and image folders, and the
errors a user meets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.dataset import ResidentDataset, narrowest

Image = pytest.importorskip("PIL.Image")


def _dataset(*tensors, **kwargs) -> ResidentDataset:
    return ResidentDataset(*tensors, device="cpu", show_progress=False, **kwargs)


def _all(data: ResidentDataset) -> tuple[torch.Tensor, ...]:
    return data.gather(torch.arange(len(data)))


# ---- narrowing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values,stored",
    [
        (torch.arange(10).repeat(3), torch.uint8),
        (torch.tensor([0, 255, 7]), torch.uint8),
        (torch.tensor([-3, 100, 0]), torch.int8),
        (torch.tensor([0, 256]), torch.int16),
        (torch.tensor([-129, 5]), torch.int16),
        (torch.tensor([70000, 1]), torch.int32),
        (torch.tensor([2**40, -1]), torch.int64),
        (torch.tensor([-(2**31), 2**31 - 1]), torch.int32),
        (torch.tensor([1, 2], dtype=torch.int32), torch.uint8),
    ],
)
def test_integer_fields_are_stored_in_the_smallest_type_and_come_back_exact(values, stored):
    data = _dataset(values)
    (field,) = data.fields
    assert field.stored == stored and field.dtype == values.dtype
    assert data.tensors[0].dtype == stored
    (back,) = _all(data)
    assert back.dtype == values.dtype and torch.equal(back, values)
    assert data.nbytes == values.numel() * stored.itemsize


@pytest.mark.parametrize(
    "values",
    [
        torch.tensor([0.0, 1.0, 2.0]),  # float holding small integers: kept float
        torch.tensor([0.5, -1.0], dtype=torch.float64),
        torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
    ],
)
def test_floats_and_bools_are_kept_as_they_are(values):
    data = _dataset(values)
    assert data.fields[0].stored == values.dtype == data.tensors[0].dtype
    assert torch.equal(_all(data)[0], values)


def test_a_read_only_array_is_taken_without_a_warning(recwarn):
    """What pandas' to_numpy() gives: it is read, never written."""
    values = np.arange(12.0).reshape(4, 3)
    values.flags.writeable = False
    data = ResidentDataset(values, device="cpu", show_progress=False)
    assert _all(data)[0].tolist() == values.tolist()
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def test_narrowest_of_an_empty_tensor_is_uint8():
    assert narrowest(torch.empty(0, dtype=torch.int64)) == torch.uint8


def test_gather_takes_any_index_and_keeps_every_field_aligned():
    images = torch.randint(0, 256, (20, 3, 4, 4), dtype=torch.uint8)
    labels = torch.arange(20) * 1000  # up to 19000: int16
    weights = torch.rand(20)
    data = _dataset(images, labels, weights)
    assert [f.stored for f in data.fields] == [torch.uint8, torch.int16, torch.float32]
    assert [f.shape for f in data.fields] == [(3, 4, 4), (), ()]
    assert data.sample_bytes == 48 + 2 + 4
    index = torch.tensor([19, 0, 7, 7, 3])
    x, y, w = data.gather(index)
    assert x.dtype == torch.uint8 and y.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(x, images[index]) and torch.equal(y, labels[index])
    assert torch.equal(w, weights[index])
    assert len(data) == 20 and data.resident and data.device.type == "cpu"


# ---- NumPy input -------------------------------------------------------------------------------


def test_numpy_arrays_uint16_included():
    images = np.arange(2 * 2 * 3, dtype=np.uint8).reshape(2, 2, 3)
    ids = np.array([60000, 5], dtype=np.uint16)
    small = np.array([3, 4], dtype=np.uint16)
    data = _dataset(images, ids, small)
    assert [f.stored for f in data.fields] == [torch.uint8, torch.int32, torch.uint8]
    x, i, s = _all(data)
    assert x.dtype == torch.uint8 and np.array_equal(x.numpy(), images)
    assert i.dtype == torch.int64 and i.tolist() == [60000, 5]  # widened to a type torch indexes
    assert s.tolist() == [3, 4]


def test_a_non_contiguous_numpy_array():
    base = np.arange(24, dtype=np.int64).reshape(4, 6)
    view = base[:, ::2]  # strided
    data = _dataset(view)
    assert np.array_equal(_all(data)[0].numpy(), view)


def test_a_uint64_array_too_large_for_int64_is_refused_not_wrapped():
    with pytest.raises(GpuflowError):
        _dataset(np.array([2**63, 5], dtype=np.uint64))


def test_a_torch_uint16_tensor_is_taken_like_the_numpy_array():
    ids = torch.from_numpy(np.array([60000, 5], dtype=np.uint16))
    data = _dataset(ids)
    assert _all(data)[0].tolist() == [60000, 5]


# ---- ownership and the host fallback -----------------------------------------------------------


def test_a_resident_dataset_owns_its_copy():
    images = torch.randint(0, 256, (6, 2, 2), dtype=torch.uint8)
    labels = torch.arange(6, dtype=torch.float32)
    data = _dataset(images, labels)
    before = [t.clone() for t in _all(data)]
    images.fill_(0)
    labels.fill_(-1)
    after = _all(data)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert after[0].max() > 0


def test_over_budget_the_dataset_stays_on_the_host():
    images = torch.randint(0, 256, (10, 3, 4, 4), dtype=torch.uint8)
    labels = torch.arange(10)
    data = _dataset(images, labels, budget_bytes=10 * (48 + 1) - 1)
    assert not data.resident and data.nbytes == 0
    assert data.budget_bytes == 10 * 49 - 1
    assert data.tensors[1].dtype == torch.uint8  # still narrowed on the host
    assert torch.equal(data.widen(data.tensors)[1], labels)
    exact = _dataset(images, labels, budget_bytes=10 * 49)
    assert exact.resident and exact.nbytes == 10 * 49


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensors,match",
    [
        ((), "at least one tensor"),
        ((torch.zeros(3), torch.zeros(4)), r"one first dimension, got \(3,\), \(4,\)"),
        ((torch.tensor(3),), "one first dimension"),
        ((torch.zeros(0, 2),), "empty"),
        (([1, 2, 3],), "field 0 is a list"),
        ((torch.zeros(2), "abc"), "field 1 is a str"),
        ((torch.zeros(2, device="meta"),), "field 0 is on meta"),
        ((torch.zeros(2), np.array(["cat", "dog"])), "field 1 holds <U3 values, not numbers"),
        ((np.array([{}, 1], dtype=object),), "field 0 holds object values"),
        ((np.array(["2026-11-28"] * 2, dtype="datetime64[D]"),), "holds datetime64"),
        ((torch.eye(4).to_sparse(),), "field 0 is a torch.sparse_coo tensor; pass .to_dense"),
    ],
    ids=[
        "none",
        "lengths",
        "scalar",
        "empty",
        "list",
        "str",
        "meta",
        "strings",
        "objects",
        "dates",
        "sparse",
    ],
)
def test_bad_tensors_are_refused(tensors, match):
    with pytest.raises(GpuflowError, match=match):
        _dataset(*tensors)


# ---- from_dataset -----------------------------------------------------------------------------


class _Items:
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_from_dataset_of_tensor_and_int_pairs():
    images = torch.rand(7, 2, 3)
    items = [(images[i], i % 3) for i in range(7)]
    data = ResidentDataset.from_dataset(_Items(items), device="cpu", show_progress=False)
    x, y = _all(data)
    assert torch.equal(x, images)
    assert y.dtype == torch.int64 and y.tolist() == [i % 3 for i in range(7)]
    assert data.fields[1].stored == torch.uint8


def test_from_dataset_of_numbers_arrays_and_bools():
    items = [
        (np.full((2,), i, dtype=np.int16), float(i) / 2, bool(i % 2), np.int64(i)) for i in range(5)
    ]
    data = ResidentDataset.from_dataset(_Items(items), device="cpu", show_progress=False)
    arrays, halves, odd, ints = _all(data)
    assert arrays.dtype == torch.int16 and arrays[:, 0].tolist() == list(range(5))
    assert halves.dtype == torch.float32 and halves.tolist() == [i / 2 for i in range(5)]
    assert odd.dtype == torch.bool and odd.tolist() == [bool(i % 2) for i in range(5)]
    assert ints.dtype == torch.int64 and ints.tolist() == list(range(5))


def test_numpy_floats_keep_their_precision_and_0d_arrays_are_numbers():
    """sklearn's features are float64: a target X[i, 2] was stored as float32."""
    targets = np.linspace(0.0, 1.0, 7) + 1e-9  # (not float32 values)
    items = [
        (np.float64(t), np.array(i), np.float16(i), np.array(t)) for i, t in enumerate(targets)
    ]
    data = ResidentDataset.from_dataset(_Items(items), device="cpu", show_progress=False)
    kept, labels, halves, arrays = _all(data)
    assert kept.dtype == torch.float64 and kept.tolist() == targets.tolist()
    assert labels.dtype == torch.int64 and labels.tolist() == list(range(7))
    assert halves.dtype == torch.float16 and arrays.dtype == torch.float64
    assert arrays.tolist() == targets.tolist()


@pytest.mark.parametrize(
    ("values", "dtype"),
    [([1, 1.5, 2.75], torch.float32), ([True, 5, 0], torch.int64),
     ([np.array([1], np.int8), np.array([300], np.int16), np.array([-3], np.int8)], torch.int16),
     ([torch.tensor(1, dtype=torch.uint8), torch.tensor(-3), 7], torch.int64),
     ([torch.tensor(1.0, dtype=torch.float16), 70000.0, 0.5], torch.float32)],
    ids=["int-then-float", "bool-then-int", "int8-then-300", "uint8-then-negative",
         "half-then-past-its-range"],
)  # fmt: skip
def test_a_field_whose_items_differ_in_dtype_takes_the_type_they_all_fit(values, dtype):
    """Each item was written into a field of item 0's dtype: 1.5 became 1, 300 in int8 44."""
    items = [(torch.zeros(2), v) for v in values]
    data = ResidentDataset.from_dataset(_Items(items), device="cpu", show_progress=False)
    got = _all(data)[1].reshape(len(values))
    assert got.dtype == dtype
    sent = [torch.as_tensor(v).reshape(-1)[0].item() for v in values]
    assert got.tolist() == [float(v) if dtype.is_floating_point else int(v) for v in sent]


def test_from_dataset_of_single_tensors():
    values = torch.arange(12.0).reshape(4, 3)
    data = ResidentDataset.from_dataset(_Items(list(values)), device="cpu", show_progress=False)
    assert len(data.fields) == 1 and torch.equal(_all(data)[0], values)


def test_from_dataset_of_pil_images():
    rng = np.random.default_rng(0)
    rgb = [rng.integers(0, 256, (5, 4, 3), dtype=np.uint8) for _ in range(3)]
    gray = [rng.integers(0, 256, (5, 4), dtype=np.uint8) for _ in range(3)]
    items = [
        (Image.fromarray(a), Image.fromarray(g), i)
        for i, (a, g) in enumerate(zip(rgb, gray, strict=True))
    ]
    data = ResidentDataset.from_dataset(_Items(items), device="cpu", show_progress=False)
    colour, grey, labels = _all(data)
    assert colour.shape == (3, 3, 5, 4) and colour.dtype == torch.uint8
    assert grey.shape == (3, 1, 5, 4) and grey.dtype == torch.uint8
    for i in range(3):
        assert np.array_equal(colour[i].numpy(), np.asarray(items[i][0]).transpose(2, 0, 1))
        assert np.array_equal(grey[i, 0].numpy(), gray[i])
    assert labels.tolist() == [0, 1, 2]


def test_from_dataset_names_the_item_of_another_shape():
    items = [(torch.zeros(2, 3), 0)] * 4 + [(torch.zeros(2, 4), 1)]
    with pytest.raises(GpuflowError, match=r"item 4 .* field 0 of shape \(2, 4\), item 0 \(2, 3\)"):
        ResidentDataset.from_dataset(_Items(items), device="cpu", show_progress=False)


def test_from_dataset_errors():
    with pytest.raises(GpuflowError, match="empty"):
        ResidentDataset.from_dataset(_Items([]), device="cpu", show_progress=False)
    with pytest.raises(GpuflowError, match="item 2 of the dataset has 1 fields, item 0 2"):
        ResidentDataset.from_dataset(
            _Items([(1, 2), (3, 4), (5,)]), device="cpu", show_progress=False
        )
    with pytest.raises(GpuflowError, match="field 1 of item 0 is a str"):
        ResidentDataset.from_dataset(_Items([(1, "cat")]), device="cpu", show_progress=False)


# ---- from_image_folder ------------------------------------------------------------------------


def _write(path, pixels):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def test_from_image_folder_reads_exact_pixels_and_labels_by_sorted_class(tmp_path):
    rng = np.random.default_rng(1)
    pictures = {
        ("zebra", "a.png"): rng.integers(0, 256, (6, 5, 3), dtype=np.uint8),
        ("zebra", "b.png"): rng.integers(0, 256, (6, 5, 3), dtype=np.uint8),
        ("apple", "x.png"): rng.integers(0, 256, (6, 5, 3), dtype=np.uint8),
        ("apple", "y.PNG"): rng.integers(0, 256, (6, 5), dtype=np.uint8),  # grey: made RGB
    }
    for (cls, name), pixels in pictures.items():
        _write(tmp_path / cls / name, pixels)
    (tmp_path / "zebra" / "notes.txt").write_text("not an image")
    data = ResidentDataset.from_image_folder(tmp_path, device="cpu", show_progress=False)
    assert data.classes == ["apple", "zebra"]
    images, labels = _all(data)
    assert images.shape == (4, 3, 6, 5) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and labels.tolist() == [0, 0, 1, 1]
    order = [("apple", "x.png"), ("apple", "y.PNG"), ("zebra", "a.png"), ("zebra", "b.png")]
    for i, key in enumerate(order):
        pixels = pictures[key]
        if pixels.ndim == 2:
            pixels = np.repeat(pixels[:, :, None], 3, axis=2)
        assert np.array_equal(images[i].numpy(), pixels.transpose(2, 0, 1)), key


def test_from_image_folder_resizes(tmp_path):
    colours = {"a": (10, 20, 30), "b": (200, 100, 0)}
    for cls, colour in colours.items():
        _write(tmp_path / cls / "one.png", np.full((9, 7, 3), colour, dtype=np.uint8))
        _write(tmp_path / cls / "two.png", np.full((4, 12, 3), colour, dtype=np.uint8))
    square = ResidentDataset.from_image_folder(tmp_path, 5, device="cpu", show_progress=False)
    images, labels = _all(square)
    assert images.shape == (4, 3, 5, 5) and labels.tolist() == [0, 0, 1, 1]
    for i, colour in enumerate([colours["a"]] * 2 + [colours["b"]] * 2):
        assert images[i].flatten(1).unique(dim=1).flatten().tolist() == list(colour)
    tall = ResidentDataset.from_image_folder(tmp_path, (6, 3), device="cpu", show_progress=False)
    assert _all(tall)[0].shape == (4, 3, 6, 3)  # (height, width)
    with pytest.raises(GpuflowError) as caught:
        ResidentDataset.from_image_folder(tmp_path, device="cpu", show_progress=False)
    assert str(caught.value) == (
        f"{tmp_path / 'a' / 'two.png'} is 12x4, {tmp_path / 'a' / 'one.png'} 7x9; pass size= "
        "to from_image_folder to resize every image to one size"
    )


def test_from_image_folder_errors(tmp_path):
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "readme.txt").write_text("no images here")
    with pytest.raises(GpuflowError, match="has no images in class folders"):
        ResidentDataset.from_image_folder(tmp_path, device="cpu", show_progress=False)
    with pytest.raises(GpuflowError, match="is not a folder of class folders"):
        ResidentDataset.from_image_folder(tmp_path / "missing", device="cpu")
    (tmp_path / "cats" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(GpuflowError, match=r"broken\.png: not an image Pillow can read"):
        ResidentDataset.from_image_folder(tmp_path, device="cpu", show_progress=False)


def test_from_image_folder_over_budget_stays_on_the_host(tmp_path):
    for cls in ("a", "b"):
        _write(tmp_path / cls / "p.png", np.zeros((4, 4, 3), dtype=np.uint8))
    data = ResidentDataset.from_image_folder(
        tmp_path, device="cpu", budget_bytes=16, show_progress=False
    )
    assert not data.resident and data.nbytes == 0 and data.classes == ["a", "b"]
    assert data.tensors[0].shape == (2, 3, 4, 4)
