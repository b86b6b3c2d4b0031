"""Keyed random numbers and the device-side image augmentations on the cpu: each transform
against a reference built from torch's own padding, flipping and arithmetic at the offsets
the keys draw; determinism by key; Compose's key streams; the argument errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.augment import (
    Compose,
    Cutout,
    HorizontalFlip,
    Normalize,
    RandomCrop,
    Translate,
)
from gpuflow.data.resident.keyed import (
    MASK32,
    STREAMS,
    below,
    hash32,
    order_keys,
    sample_keys,
    stream_keys,
    uniform,
)

B = 64  # enough samples that every offset of a small window is drawn


def _keys(n: int = B, seed: int = 5, epoch: int = 2) -> torch.Tensor:
    return sample_keys(seed, epoch, torch.arange(n))


def _images(dtype: torch.dtype = torch.float32, n: int = B, c: int = 3, h: int = 7, w: int = 9):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.uint8:
        return torch.randint(1, 256, (n, c, h, w), generator=g, dtype=torch.uint8)
    return torch.rand(n, c, h, w, generator=g, dtype=torch.float32).to(dtype) + 0.5


# ---- keyed random numbers --------------------------------------------------------------------


def _unxorshift(y: int, shift: int) -> int:
    x = y
    for _ in range(32 // shift + 1):
        x = y ^ (x >> shift)
    return x & MASK32


def _unhash32(y: int) -> int:
    """The key whose hash32 is ``y`` (hash32 is a bijection of [0, 2**32))."""
    x = _unxorshift(y, 16)
    x = (x * pow(0x2C1B3C6D, -1, 1 << 32)) & MASK32
    x = _unxorshift(x, 15)
    x = (x * pow(0x7FEB352D, -1, 1 << 32)) & MASK32
    return _unxorshift(x, 16)


def _key_drawing(stream: int, value: int) -> torch.Tensor:
    """A (1,) key whose ``stream``-th draw is ``value``."""
    return torch.tensor([_unhash32(value) ^ ((STREAMS[1] * (stream + 1)) & MASK32)])


def test_hash32_stays_in_32_bits_and_mixes():
    x = torch.arange(1 << 14, dtype=torch.int64)
    h = hash32(x)
    assert h.min() >= 0 and h.max() <= MASK32
    assert h.unique().numel() == x.numel()  # a bijection: no collisions
    assert hash32(torch.tensor([MASK32])).item() <= MASK32


def test_keys_can_be_chosen_for_a_given_draw():
    for stream, value in [(2, 0), (2, 12345), (0, MASK32), (4, 1 << 31)]:
        assert stream_keys(_key_drawing(stream, value), stream).item() == value
    # A draw of 0 is below any p > 0: the sample flips even at a tiny p.
    image = torch.arange(4.0).reshape(1, 1, 1, 4)
    flipped = HorizontalFlip(1e-9)(image, _key_drawing(2, 0))
    assert flipped.flatten().tolist() == [3.0, 2.0, 1.0, 0.0]


def test_sample_keys_are_32_bit_and_take_a_tensor_epoch():
    positions = torch.arange(1000)
    keys = sample_keys(7, 3, positions)
    assert keys.dtype == torch.int64 and keys.shape == (1000,)
    assert keys.min() >= 0 and keys.max() <= MASK32
    assert torch.equal(keys, sample_keys(7, torch.tensor(3), positions))
    assert not torch.equal(keys, sample_keys(7, 4, positions))
    assert not torch.equal(keys, sample_keys(8, 3, positions))
    # A key depends on its own position only, not on the batch it is drawn in.
    assert torch.equal(sample_keys(7, 3, positions[500:510]), keys[500:510])


def test_below_and_uniform_stay_in_range_and_spread():
    keys = _keys(20000)
    drawn = below(keys, 1, 9)
    assert drawn.min() == 0 and drawn.max() == 8
    counts = torch.bincount(drawn, minlength=9)
    assert counts.min() > 20000 / 9 * 0.85  # roughly uniform
    u = uniform(keys, 2)
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.02
    assert not torch.equal(below(keys, 0, 9), below(keys, 1, 9))  # streams are independent


def test_uniform_is_below_one_for_the_largest_draws():
    key = _key_drawing(2, MASK32)
    assert uniform(key, 2).item() < 1.0
    image = torch.arange(4.0).reshape(1, 1, 1, 4)
    assert HorizontalFlip(1.0)(image, key).flatten().tolist() == [3.0, 2.0, 1.0, 0.0]


def test_order_keys_sort_to_a_permutation_that_depends_on_seed_and_epoch():
    n = 500
    order = torch.argsort(order_keys(1, 0, n, torch.device("cpu")), stable=True)
    assert sorted(order.tolist()) == list(range(n))
    assert not torch.equal(order, torch.arange(n))
    for seed, epoch in [(1, 1), (2, 0)]:
        other = torch.argsort(order_keys(seed, epoch, n, torch.device("cpu")), stable=True)
        assert not torch.equal(order, other)
    again = torch.argsort(order_keys(1, 0, n, torch.device("cpu")), stable=True)
    assert torch.equal(order, again)


# ---- RandomCrop and Translate ----------------------------------------------------------------


def _reference_crop(images, keys, size, padding, mode):
    H, W = images.shape[-2:]
    rows = below(keys, 0, H + 2 * padding - size + 1)
    cols = below(keys, 1, W + 2 * padding - size + 1)
    out = []
    for b in range(images.shape[0]):
        padded = F.pad(images[b], (padding,) * 4, mode=mode)
        r, c = int(rows[b]), int(cols[b])
        out.append(padded[:, r : r + size, c : c + size])
    return torch.stack(out), rows, cols


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
@pytest.mark.parametrize("fill,mode", [("reflect", "reflect"), ("zeros", "constant")])
def test_random_crop_is_a_window_of_the_padded_image(dtype, fill, mode):
    images, keys = _images(dtype), _keys()
    out = RandomCrop(6, padding=3, fill=fill)(images, keys)
    expected, rows, cols = _reference_crop(images, keys, 6, 3, mode)
    assert out.shape == (B, 3, 6, 6) and out.dtype == dtype
    assert torch.equal(out, expected)
    assert rows.unique().numel() > 3 and cols.unique().numel() > 3  # many offsets tried


def test_random_crop_without_padding_of_the_full_size_is_the_image():
    images = _images()
    assert torch.equal(RandomCrop(7, 0)(images[:, :, :, :7], _keys()), images[:, :, :, :7])


def test_random_crop_to_a_smaller_window_without_padding():
    images, keys = _images(), _keys()
    out = RandomCrop(4)(images, keys)
    expected, _, _ = _reference_crop(images, keys, 4, 0, "constant")
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_translate_is_a_zero_padded_shift(dtype):
    images, keys, p = _images(dtype), _keys(), 2
    out = Translate(p)(images, keys)
    assert out.shape == images.shape and out.dtype == dtype
    H, W = images.shape[-2:]
    dy, dx = below(keys, 0, 2 * p + 1), below(keys, 1, 2 * p + 1)
    for b in range(B):
        padded = F.pad(images[b], (p,) * 4)
        r, c = int(dy[b]), int(dx[b])
        assert torch.equal(out[b], padded[:, r : r + H, c : c + W])
    moved = (dy != p) | (dx != p)
    assert moved.any() and (out[moved] == 0).any()  # a moved image leaves zeros behind
    assert torch.equal(out[~moved], images[~moved])


@pytest.mark.parametrize(
    "transform",
    [RandomCrop(6, padding=3), RandomCrop(6, padding=3, fill="zeros"), Translate(2)],
    ids=["crop-reflect", "crop-zeros", "translate"],
)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_crops_come_back_contiguous_as_a_dataloaders_batches(transform, dtype):
    out = transform(_images(dtype), _keys())
    assert out.is_contiguous()
    assert out.view(B, -1).shape[1] == out[0].numel()  # flattens without a copy


def test_random_crop_takes_a_height_and_width_as_torchvision_does():
    images, keys = _images(), _keys()  # 7 x 9
    out = RandomCrop((4, 6), padding=1)(images, keys)
    assert out.shape == (B, 3, 4, 6)
    rows, cols = below(keys, 0, 7 + 2 - 4 + 1), below(keys, 1, 9 + 2 - 6 + 1)
    for b in range(B):
        padded = F.pad(images[b], (1,) * 4, mode="reflect")
        r, c = int(rows[b]), int(cols[b])
        assert torch.equal(out[b], padded[:, r : r + 4, c : c + 6])
    # A one-side sequence is a square, and [h, w] is taken as (h, w).
    assert torch.equal(RandomCrop([5])(images, keys), RandomCrop(5)(images, keys))
    assert torch.equal(RandomCrop([4, 6], 1)(images, keys), out)
    assert RandomCrop(5, padding=None)(images, keys).shape == (B, 3, 5, 5)  # torchvision's None


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: RandomCrop((4, 5, 6)), r"an int or \(height, width\), got \(4, 5, 6\)"),
        (lambda: RandomCrop((4.0, 5)), r"an int or \(height, width\), got \(4.0, 5\)"),
        (lambda: RandomCrop("4"), r"an int or \(height, width\), got '4'"),
        (lambda: RandomCrop((0, 4)), "at least 1 pixel"),
        (lambda: RandomCrop(4, padding=(1, 2)), r"one int of pixels, got padding=\(1, 2\)"),
    ],
)
def test_random_crop_refuses_other_sizes_and_paddings_in_one_line(make, match):
    with pytest.raises(GpuflowError, match=match) as caught:
        make()
    assert "\n" not in str(caught.value)


# ---- HorizontalFlip -------------------------------------------------------------------------


def test_horizontal_flip_flips_exactly_the_samples_drawn_below_p():
    images, keys = _images(), _keys()
    out = HorizontalFlip(0.3)(images, keys)
    flip = uniform(keys, 2) < 0.3
    assert 0 < flip.sum() < B
    assert torch.equal(out[flip], images[flip].flip(-1))
    assert torch.equal(out[~flip], images[~flip])


def test_horizontal_flip_extremes():
    images, keys = _images(torch.uint8), _keys()
    assert torch.equal(HorizontalFlip(0.0)(images, keys), images)
    assert torch.equal(HorizontalFlip(1.0)(images, keys), images.flip(-1))


# ---- Cutout ---------------------------------------------------------------------------------


def test_cutout_zeroes_one_square_clipped_at_the_edges():
    images, keys, size = _images(h=6, w=8), _keys(), 4
    out = Cutout(size)(images, keys)
    H, W = 6, 8
    tops = below(keys, 3, H) - size // 2
    lefts = below(keys, 4, W) - size // 2
    clipped = 0
    for b in range(B):
        top, left = int(tops[b]), int(lefts[b])
        r0, r1 = max(0, top), min(H, top + size)
        c0, c1 = max(0, left), min(W, left + size)
        hole = torch.zeros(H, W, dtype=torch.bool)
        hole[r0:r1, c0:c1] = True
        assert (out[b][:, hole] == 0).all()
        assert torch.equal(out[b][:, ~hole], images[b][:, ~hole])  # the rest untouched
        assert int((out[b] == 0).sum()) == 3 * (r1 - r0) * (c1 - c0)
        clipped += (r1 - r0) * (c1 - c0) < size * size
    assert 0 < clipped < B  # some squares reach past an edge, some don't


def test_cutout_keeps_the_dtype():
    images = _images(torch.uint8)
    out = Cutout(3)(images, _keys())
    assert out.dtype == torch.uint8 and out.shape == images.shape
    assert int((out == 0).sum()) > 0


# ---- Normalize ------------------------------------------------------------------------------

MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)


def _reference_normalize(images, scale):
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return ((images.double() * scale - mean.double()) / std.double()).float()


def test_normalize_uint8_scales_by_1_over_255():
    images = _images(torch.uint8)
    out = Normalize(MEAN, STD)(images, _keys())
    assert out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, _reference_normalize(images, 1 / 255))


def test_normalize_float_scale_defaults_to_one_and_takes_a_scale():
    images = _images()
    torch.testing.assert_close(
        Normalize(MEAN, STD)(images, _keys()), _reference_normalize(images, 1.0)
    )
    torch.testing.assert_close(
        Normalize(MEAN, STD, scale=2.0)(images, _keys()),
        _reference_normalize(images, 2.0),
    )
    # The same Normalize, uint8 after float: its scale is chosen per call.
    norm = Normalize(MEAN, STD)
    norm(images, _keys())
    small = _images(torch.uint8)
    torch.testing.assert_close(norm(small, _keys()), _reference_normalize(small, 1 / 255))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normalize_makes_the_asked_dtype_and_layout(dtype):
    images = _images(torch.uint8)
    out = Normalize(MEAN, STD, dtype=dtype, channels_last=True)(images, _keys())
    assert out.dtype == dtype and out.shape == images.shape
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    expected = _reference_normalize(images, 1 / 255).to(dtype)
    torch.testing.assert_close(out, expected)


# ---- Compose, determinism -------------------------------------------------------------------


def _pipeline():
    return [RandomCrop(6, 2), HorizontalFlip(), Cutout(3), Normalize(MEAN, STD)]


def test_compose_gives_each_transform_its_own_key_stream():
    images, keys = _images(torch.uint8), _keys()
    out = Compose(*_pipeline())(images, keys)
    expected = images
    for i, transform in enumerate(_pipeline()):
        expected = transform(expected, stream_keys(keys, 16 + i))
    assert torch.equal(out, expected)
    assert torch.equal(Compose(_pipeline())(images, keys), out)  # a list works too
    # Not the transforms applied with the raw keys.
    raw = images
    for transform in _pipeline():
        raw = transform(raw, keys)
    assert not torch.equal(out, raw)


def test_same_keys_give_the_same_images_whatever_the_global_rng():
    images, keys = _images(), _keys()
    augment = Compose(*_pipeline())
    torch.manual_seed(0)
    first = augment(images, keys)
    torch.manual_seed(123)
    torch.rand(10)
    assert torch.equal(augment(images, keys), first)
    # Each sample's result depends only on its own key and image.
    assert torch.equal(augment(images[10:20], keys[10:20]), first[10:20])
    other = augment(images, _keys(epoch=3))
    differs = (other != first).flatten(1).any(1)
    assert differs.sum() > B // 2


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: RandomCrop(4, 1, fill="edge"), "'reflect' or 'zeros'"),
        (lambda: RandomCrop(0), "at least 1 pixel"),
        (lambda: RandomCrop(4, -1), "padding >= 0"),
        (lambda: HorizontalFlip(1.5), "p in"),
        (lambda: Cutout(0), "size >= 1"),
        (lambda: Normalize((0.5, 0.5), (0.2,)), "one mean and one positive std"),
        (lambda: Normalize((0.5,), (0.0,)), "positive std"),
        (lambda: Normalize((0.5,), (0.2,), dtype=torch.int32), "makes floats"),
    ],
)
def test_bad_arguments_are_refused(make, match):
    with pytest.raises(GpuflowError, match=match):
        make()


def test_reflect_padding_must_be_below_the_image_side():
    images = _images(h=4, w=9)
    with pytest.raises(GpuflowError, match="reflect padding must be below"):
        RandomCrop(4, padding=4)(images, _keys())
    # Zeros pad any amount.
    assert RandomCrop(4, padding=4, fill="zeros")(images, _keys()).shape == (B, 3, 4, 4)
    with pytest.raises(GpuflowError, match="does not fit 4x9"):
        RandomCrop(7, padding=1)(images, _keys())


@pytest.mark.parametrize(
    "transform",
    [RandomCrop(2), Translate(1), HorizontalFlip(), Cutout(2), Normalize(MEAN, STD)],
    ids=lambda t: type(t).__name__,
)
def test_transforms_take_only_4d_images(transform):
    with pytest.raises(GpuflowError, match=r"\(B, C, H, W\) images, got shape \(3, 5, 5\)"):
        transform(torch.ones(3, 5, 5), _keys(3))


def test_normalize_refuses_another_channel_count():
    with pytest.raises(GpuflowError, match="3 channels' means, the images 1"):
        Normalize(MEAN, STD)(torch.ones(2, 1, 4, 4), _keys(2))


def test_translate_and_crop_refusals_name_what_was_given():
    for pixels in (-1, 1.5, True):
        with pytest.raises(GpuflowError, match=r"Translate moves by a whole number of pixels"):
            Translate(pixels)
    with pytest.raises(GpuflowError, match="at least 1 pixel, got 0"):
        RandomCrop(0)
    with pytest.raises(GpuflowError, match="padding >= 0, got -2"):
        RandomCrop(4, padding=-2)
