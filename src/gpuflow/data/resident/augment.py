"""Image augmentation on the device, per sample, from each sample's key.

    augment = Compose(RandomCrop(32, padding=4), HorizontalFlip(), Cutout(8),
                      Normalize(CIFAR_MEAN, CIFAR_STD, dtype=torch.bfloat16, channels_last=True))
    x = augment(images, keys)       # images (B, C, H, W), keys (B,) from ``data/resident/keyed.py``

Each transform draws what it needs from the keys (``ResidentLoader`` derives them from
(seed, epoch, position)), so a sample gets the same augmentation on every run and after a
resume. Fixed shapes, device work only, no host sync: a draw, its augmentation and the
training step can be captured in one CUDA graph. Any dtype goes in; ``Normalize`` makes floats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.keyed import below, stream_keys, uniform


class Transform(Protocol):
    def __call__(self, images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``images`` (B, C, H, W) with one key per sample (B,) int64 -> (B, C, H', W')."""
        ...


def _check_images(images: torch.Tensor, what: str) -> None:
    if images.dim() != 4:
        raise GpuflowError(f"{what} takes (B, C, H, W) images, got shape {tuple(images.shape)}")


def check_transformed(images: Any, rows: int, transform: Any) -> None:
    """Refuse what a transform gave unless it is the batch's images: one tensor, a row per
    sample. A torchvision transform takes (images, keys) for two inputs and gives both back."""
    if isinstance(images, torch.Tensor) and images.dim() > 0 and images.shape[0] == rows:
        return
    got = (
        f"a tensor of shape {tuple(images.shape)}"
        if isinstance(images, torch.Tensor)
        else f"a {type(images).__name__}"
    )
    name = getattr(transform, "__name__", type(transform).__name__)
    raise GpuflowError(
        f"transform= is called as transform(images, keys) and must return the images, one "
        f"tensor with a row per sample ({rows} here); {name} returned {got}. A torchvision "
        "transform takes images alone: use gpuflow.data.resident.augment's transforms (a draw per "
        "sample), or pass transform=lambda images, keys: t(images) (one draw for the batch)"
    )


def _crop_size(size: Any) -> tuple[int, int] | None:
    """``size`` as (height, width): an int is a square, a sequence of one or two ints (as
    torchvision takes) is (side, side) or (height, width); None stays None."""
    if size is None:
        return None
    sides = tuple(size) if isinstance(size, (tuple, list)) else (size,)
    if len(sides) == 1:
        sides *= 2
    if len(sides) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in sides):
        raise GpuflowError(f"RandomCrop's size is an int or (height, width), got {size!r}")
    return sides


class RandomCrop:
    """A ``size`` window (an int for a square, or (height, width); ``None``: the image's own
    height and width) at a random place in the image padded by ``padding`` on each side; the
    padding reflects the image (``fill="reflect"``) or is zeros."""

    def __init__(
        self, size: int | Sequence[int] | None, padding: int | None = 0, fill: str = "reflect"
    ) -> None:
        padding = 0 if padding is None else padding
        if not isinstance(padding, int) or isinstance(padding, bool):
            raise GpuflowError(
                f"RandomCrop pads every side by one int of pixels, got padding={padding!r}"
            )
        self.window = _crop_size(size)
        if self.window is not None and min(self.window) < 1:
            raise GpuflowError(f"RandomCrop needs a size of at least 1 pixel, got {size!r}")
        if padding < 0:
            raise GpuflowError(f"RandomCrop needs padding >= 0, got {padding}")
        if fill not in ("reflect", "zeros"):
            raise GpuflowError(f"RandomCrop fills with 'reflect' or 'zeros', got {fill!r}")
        self.size, self.padding, self.fill = size, padding, fill
        self.name = "RandomCrop"

    def __call__(self, images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        _check_images(images, self.name)
        _, _, H, W = images.shape
        p = self.padding
        h, w = (H, W) if self.window is None else self.window
        if h > H + 2 * p or w > W + 2 * p:
            raise GpuflowError(f"RandomCrop({self.size}, padding={p}) does not fit {H}x{W} images")
        if self.fill == "reflect" and p >= min(H, W):
            raise GpuflowError(f"reflect padding must be below the image side, got {p}")
        rows = below(keys, 0, H + 2 * p - h + 1)[:, None] + torch.arange(h, device=images.device)
        cols = below(keys, 1, W + 2 * p - w + 1)[:, None] + torch.arange(w, device=images.device)
        return _gather_window(images, rows - p, cols - p, self.fill)  # (B, h) and (B, w)


class Translate(RandomCrop):
    """The image moved by up to ``pixels`` in each direction; what it leaves is zeros: a crop
    of the image's own size from its zero padding."""

    def __init__(self, pixels: int) -> None:
        if not isinstance(pixels, int) or isinstance(pixels, bool) or pixels < 0:
            raise GpuflowError(f"Translate moves by a whole number of pixels >= 0, got {pixels!r}")
        super().__init__(size=None, padding=pixels, fill="zeros")
        self.name = "Translate"


def _gather_window(
    images: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, fill: str
) -> torch.Tensor:
    """``images[b, :, rows[b], cols[b]]`` for each b, with rows and cols outside the image
    reflected back into it or read as zeros: (B, C, len(rows), len(cols)), contiguous (as a
    DataLoader's batches are, so ``x.view(B, -1)`` works)."""
    B, C, H, W = images.shape
    if fill == "reflect":
        rows = _reflect(rows, H)
        cols = _reflect(cols, W)
        inside = None
    else:
        inside = ((rows >= 0) & (rows < H))[:, :, None] & ((cols >= 0) & (cols < W))[:, None, :]
        rows, cols = rows.clamp(0, H - 1), cols.clamp(0, W - 1)
    # One index per output dimension, so the gather writes (B, C, h, w) in order.
    batch = torch.arange(B, device=images.device)[:, None, None, None]  # (B, 1, 1, 1)
    channel = torch.arange(C, device=images.device)[None, :, None, None]  # (1, C, 1, 1)
    out = images[batch, channel, rows[:, None, :, None], cols[:, None, None, :]]
    if inside is not None:
        out = out * inside[:, None].to(out.dtype)  # (B, 1, h, w)
    return out


def _reflect(index: torch.Tensor, n: int) -> torch.Tensor:
    """Indices outside [0, n) mirrored back in, the edge not repeated (``F.pad``'s reflect)."""
    index = index.abs()
    return torch.where(index >= n, 2 * (n - 1) - index, index)


class HorizontalFlip:
    """Each image mirrored left to right with probability ``p``."""

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise GpuflowError(f"HorizontalFlip needs p in [0, 1], got {p}")
        self.p = p

    def __call__(self, images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        _check_images(images, "HorizontalFlip")
        flip = (uniform(keys, 2) < self.p)[:, None, None, None]  # (B, 1, 1, 1)
        return torch.where(flip, images.flip(-1), images)


class Cutout:
    """A ``size`` x ``size`` square of each image set to zero, centred anywhere in it (the
    square may reach past the edge)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise GpuflowError(f"Cutout needs size >= 1, got {size}")
        self.size = size

    def __call__(self, images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        _check_images(images, "Cutout")
        _, _, H, W = images.shape
        top = below(keys, 3, H)[:, None] - self.size // 2  # (B, 1)
        left = below(keys, 4, W)[:, None] - self.size // 2
        rows = torch.arange(H, device=images.device)  # (H,)
        cols = torch.arange(W, device=images.device)
        in_rows = (rows >= top) & (rows < top + self.size)  # (B, H)
        in_cols = (cols >= left) & (cols < left + self.size)  # (B, W)
        hole = (in_rows[:, :, None] & in_cols[:, None, :])[:, None]  # (B, 1, H, W)
        return images.masked_fill(hole, 0)


class Normalize:
    """``(images * scale - mean) / std`` per channel, as ``dtype``; ``scale`` defaults to
    1/255 for uint8 images (pixels to [0, 1]) and 1 otherwise. ``channels_last`` sets the
    memory layout that convolutions on the GPU prefer."""

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
        channels_last: bool = False,
    ) -> None:
        if len(mean) != len(std) or any(s <= 0 for s in std):
            raise GpuflowError("Normalize needs one mean and one positive std per channel")
        if not dtype.is_floating_point:
            raise GpuflowError(f"Normalize makes floats, got dtype {dtype}")
        self.mean, self.std, self.dtype, self.scale = tuple(mean), tuple(std), dtype, scale
        self.channels_last = channels_last
        self._tables: dict[tuple[torch.device, float], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        _check_images(images, "Normalize")
        if images.shape[1] != len(self.mean):
            raise GpuflowError(
                f"Normalize has {len(self.mean)} channels' means, the images {images.shape[1]}"
            )
        scale = self.scale
        if scale is None:
            scale = 1 / 255 if images.dtype == torch.uint8 else 1.0
        mul, add = self._affine(images.device, scale)
        out = torch.addcmul(add, images.to(torch.float32), mul)  # (B, C, H, W) float32
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        return out.to(self.dtype, memory_format=layout)

    def _affine(self, device: torch.device, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(C, 1, 1) factor and offset: x * scale / std - mean / std, made once per device and
        scale, by fills (no copy from the host, so a first call inside a capture is safe)."""
        key = (device, scale)
        if key not in self._tables:
            mul = torch.empty(len(self.std), 1, 1, device=device)  # (C, 1, 1)
            add = torch.empty_like(mul)
            for c, (m, s) in enumerate(zip(self.mean, self.std, strict=True)):
                mul[c].fill_(scale / s)
                add[c].fill_(-m / s)
            self._tables[key] = (mul, add)
        return self._tables[key]


class Compose:
    """Transforms applied in order, each with keys of its own."""

    def __init__(self, *transforms: Transform) -> None:
        if len(transforms) == 1 and isinstance(transforms[0], (list, tuple)):
            transforms = tuple(transforms[0])
        self.transforms = transforms

    def __call__(self, images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        for i, transform in enumerate(self.transforms):
            images = transform(images, stream_keys(keys, 16 + i))
        return images
