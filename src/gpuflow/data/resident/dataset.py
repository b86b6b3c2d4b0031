"""``ResidentDataset``: a dataset of same-length tensors kept in device memory, narrowed.

    data = ResidentDataset(images, labels, device="cuda")      # tensors or NumPy arrays
    data = ResidentDataset.from_dataset(torchvision_cifar10)    # any map-style Dataset
    data = ResidentDataset.from_image_folder("photos/", size=64)

Integer fields are stored in the smallest type that holds their values (labels 0-9 as
uint8) and come back in the type they were given, except that unsigned types wider than
uint8, which torch cannot index, come back as int64; floats and bools are kept as they are.
The fields cross the bus once, in 64 MiB copies from two reused pinned buffers. A dataset
larger than ``budget_bytes`` (default: half the device's free memory) stays on the host and
``ResidentLoader`` streams it through in chunks. Batches and augmentation:
``data/resident/loader.py``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import DownloadColumn
from torch.utils.data import Dataset

from gpuflow.common.console import progress_bar
from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.tokens import default_budget
from gpuflow.device.accelerator import Device
from gpuflow.transfer.packing.plan import check_numeric_array
from gpuflow.transfer.pinned import PinnedPool, size_class

UPLOAD_BYTES = 64 << 20  # per copy: large enough to run at the link's full speed
_PROGRESS_BYTES = 256 << 20  # smaller datasets upload too fast for a bar to help
_PROGRESS_ITEMS = 2_000  # reading a Dataset item by item: a bar from this many
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
# Integer types tried smallest first; uint16 and friends lack indexing kernels in torch.
_NARROW_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class Field:
    """One tensor of the dataset: its type as given, as stored, and one sample's shape."""

    dtype: torch.dtype
    stored: torch.dtype
    shape: tuple[int, ...]

    @property
    def sample_bytes(self) -> int:
        return math.prod(self.shape) * self.stored.itemsize


def narrowest(values: torch.Tensor) -> torch.dtype:
    """The smallest integer type that holds every value of ``values``; other types as they
    are. One pass over the host tensor."""
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        return values.dtype
    if values.numel() == 0:
        return torch.uint8
    low, high = (int(v) for v in torch.aminmax(values))
    for dtype in _NARROW_INTS:
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    return values.dtype


_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def gather_rows(
    stored: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], rows: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``stored[rows]`` field by field, each in its type of ``dtypes`` (fresh tensors)."""
    return tuple(t[rows].to(d) for t, d in zip(stored, dtypes, strict=True))


def _host_tensor(value: Any, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise GpuflowError(f"{what} is on {value.device}; give the dataset host tensors")
        if value.layout != torch.strided:
            raise GpuflowError(f"{what} is a {value.layout} tensor; pass .to_dense()")
        if value.dtype not in _WIDE_UNSIGNED:
            return value
        value = value.numpy()  # torch finds no min or max of these: through NumPy
    if isinstance(value, np.ndarray):
        if value.ndim == 0:  # (ascontiguousarray would make it one sample, silently)
            raise GpuflowError(f"{what} is a single value; give an array with one first dimension")
        check_numeric_array(value, what)
        if value.dtype.kind == "u" and value.itemsize > 1:
            # torch indexes no unsigned type but uint8: held as int64, which must hold them
            if value.size and value.max() > np.iinfo(np.int64).max:
                raise GpuflowError(
                    f"{what} holds unsigned values from 2**63 up, which no signed type holds"
                )
            value = value.astype(np.int64)
        with warnings.catch_warnings():  # read only, never written: torch's warning is noise
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return torch.from_numpy(np.ascontiguousarray(value))
    raise GpuflowError(f"{what} is a {type(value).__name__}; give tensors or NumPy arrays")


class ResidentDataset(Dataset):
    """See the module docstring. ``len(data)`` samples; ``data[i]`` sample i, a tuple of its
    fields as ``TensorDataset`` gives it (where the dataset lives, in the types given), so it
    serves a ``DataLoader`` too; ``data.fields`` their layouts; ``data.resident`` whether they
    live on the device."""

    def __init__(
        self,
        *tensors: torch.Tensor | np.ndarray,
        device: Device | str | int | torch.device = "auto",
        budget_bytes: int | None = None,
        show_progress: bool = True,
    ) -> None:
        if not tensors:
            raise GpuflowError("ResidentDataset needs at least one tensor")
        host = [_host_tensor(t, f"field {i}") for i, t in enumerate(tensors)]
        lengths = {t.shape[0] if t.dim() else None for t in host}
        if None in lengths or len(lengths) != 1:
            shapes = ", ".join(str(tuple(t.shape)) for t in host)
            raise GpuflowError(f"the dataset's tensors need one first dimension, got {shapes}")
        self.length = lengths.pop()
        if self.length == 0:
            raise GpuflowError("the dataset is empty")
        self.device = Device.resolve(device)
        self.fields = tuple(Field(t.dtype, narrowest(t), tuple(t.shape[1:])) for t in host)
        self.dtypes = tuple(f.dtype for f in self.fields)  # as given: what batches come back in
        total = self.length * sum(f.sample_bytes for f in self.fields)
        self.budget_bytes = default_budget(self.device) if budget_bytes is None else budget_bytes
        self.resident = total <= self.budget_bytes
        if self.resident:
            self.tensors = self._upload(host, show_progress and total >= _PROGRESS_BYTES)
        else:
            # Kept on the host, narrowed where that saves bytes; a field already in its
            # stored type is read where it is (the caller's tensor: don't write it meanwhile).
            self.tensors = tuple(
                t if t.dtype == f.stored and t.is_contiguous() else t.to(f.stored).contiguous()
                for t, f in zip(host, self.fields, strict=True)
            )

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, ...]:
        return tuple(t[index].to(d) for t, d in zip(self.tensors, self.dtypes, strict=True))

    @property
    def sample_bytes(self) -> int:
        """Bytes of one sample as stored (all fields)."""
        return sum(f.sample_bytes for f in self.fields)

    @property
    def nbytes(self) -> int:
        """Device memory the dataset holds (0 while it stays on the host)."""
        return sum(t.nbytes for t in self.tensors) if self.resident else 0

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The samples at ``index`` (B,) int64 on the device, each field in its given type:
        fresh tensors, device work only. Only for a resident dataset."""
        return gather_rows(self.tensors, self.dtypes, index)

    def widen(self, stored: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Fields in their stored types back to the types they were given."""
        return tuple(t.to(d) for t, d in zip(stored, self.dtypes, strict=True))

    def _upload(self, host: list[torch.Tensor], show: bool) -> tuple[torch.Tensor, ...]:
        """Each field narrowed into a pinned buffer and copied from there, 64 MiB at a time,
        while the other buffer fills."""
        target = self.device.torch
        if self.device.type == "cpu":  # a copy of our own: the caller may write theirs
            return tuple(
                t.to(f.stored, copy=True).contiguous()
                for t, f in zip(host, self.fields, strict=True)
            )
        out = []
        total = self.length * self.sample_bytes
        bar = progress_bar(counter=DownloadColumn()) if show else None
        task = bar.add_task("uploading the dataset", total=total) if bar else None
        stream = self.device.current_stream()
        # Two buffers of 64 MiB, or of one sample where a sample is larger.
        largest = max(UPLOAD_BYTES, *(size_class(f.sample_bytes) for f in self.fields))
        with PinnedPool(self.device, max_bytes=2 * largest) as pool:
            if bar:
                bar.start()
            try:
                for t, f in zip(host, self.fields, strict=True):
                    shape = (self.length, *f.shape)
                    device_field = torch.empty(shape, dtype=f.stored, device=target)
                    rows = max(1, UPLOAD_BYTES // max(1, f.sample_bytes))
                    for a in range(0, self.length, rows):
                        b = min(self.length, a + rows)
                        buffer = pool.acquire((b - a) * f.sample_bytes, timeout=None)
                        staged = buffer.view(f.stored, (b - a, *f.shape))  # pinned
                        staged.copy_(t[a:b])  # narrowed as it is copied
                        device_field[a:b].copy_(staged, non_blocking=True)
                        copied = self.device.new_event()
                        copied.record(stream)
                        pool.release(buffer, after=copied)
                        if bar:
                            bar.update(task, advance=staged.nbytes)
                    out.append(device_field)
                self.device.synchronize()  # the pool's buffers are unpinned as it closes
            finally:
                if bar:
                    bar.stop()
        return tuple(out)

    # ---- other sources ----------------------------------------------------------------------

    @classmethod
    def from_dataset(
        cls,
        dataset: Any,
        device: Device | str | int | torch.device = "auto",
        budget_bytes: int | None = None,
        show_progress: bool = True,
    ) -> ResidentDataset:
        """Read a map-style dataset once (``dataset[i]`` for every i, with a progress bar):
        each item a tensor, array, number or PIL image, or a tuple of them. A field whose
        items differ in dtype takes the type they all promote to, as ``torch.stack`` gives."""
        n = len(dataset)
        if n == 0:
            raise GpuflowError("the dataset is empty")
        first = _sample_fields(dataset[0], 0)
        host = [torch.empty((n, *v.shape), dtype=v.dtype) for v in first]
        bar = progress_bar() if show_progress and n >= _PROGRESS_ITEMS else None
        task = bar.add_task("reading the dataset", total=n) if bar else None
        if bar:
            bar.start()
        try:
            for i in range(n):
                values = first if i == 0 else _sample_fields(dataset[i], i)
                if len(values) != len(host):
                    raise GpuflowError(
                        f"item {i} of the dataset has {len(values)} fields, item 0 {len(host)}"
                    )
                for field, (out, value) in enumerate(zip(host, values, strict=True)):
                    if value.shape != out.shape[1:]:
                        raise GpuflowError(
                            f"item {i} of the dataset has field {field} of shape "
                            f"{tuple(value.shape)}, item 0 {tuple(out.shape[1:])}; give "
                            "samples of one shape (resize images first)"
                        )
                    if value.dtype != out.dtype:  # (1 then 1.5): the type both fit, as stack
                        wider = torch.promote_types(out.dtype, value.dtype)
                        if wider != out.dtype:
                            out = host[field] = out.to(wider)
                    out[i] = value
                if bar and (i % 256 == 0 or i == n - 1):
                    bar.update(task, completed=i + 1)
        finally:
            if bar:
                bar.stop()
        return cls(*host, device=device, budget_bytes=budget_bytes, show_progress=show_progress)

    @classmethod
    def from_image_folder(
        cls,
        root: str | Path,
        size: int | tuple[int, int] | None = None,
        device: Device | str | int | torch.device = "auto",
        budget_bytes: int | None = None,
        show_progress: bool = True,
    ) -> ResidentDataset:
        """Images under ``root/<class>/`` as (N, 3, H, W) uint8 RGB, with int64 labels in
        the order of the sorted class names (``data.classes``). ``size`` resizes each image
        (an int for square); without it all images must share one size. Needs Pillow
        (``pip install 'gpuflow[images]'``)."""
        folder = ImageFolder(root, size)
        data = cls.from_dataset(folder, device, budget_bytes, show_progress)
        data.classes = folder.classes
        return data


def _sample_fields(item: Any, index: int) -> list[torch.Tensor]:
    """One item of a map-style dataset as a list of host tensors (one per field). Integers
    become int64 (labels as losses take them), NumPy floats keep their dtype, Python floats
    take torch's default (float32), as ``torch.tensor`` makes them; a 0-d array is a
    scalar."""
    values = list(item) if isinstance(item, (tuple, list)) else [item]
    out = []
    for field, value in enumerate(values):
        what = f"field {field} of item {index}"
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]  # one value, as a NumPy scalar is
        if isinstance(value, torch.Tensor):
            out.append(value.detach().cpu())
        elif isinstance(value, np.ndarray):
            out.append(_host_tensor(value, what))
        elif isinstance(value, np.floating):
            out.append(torch.from_numpy(np.array(value)))
        elif isinstance(value, (bool, np.bool_)):
            out.append(torch.tensor(bool(value)))
        elif isinstance(value, (int, np.integer)):
            out.append(torch.tensor(int(value), dtype=torch.int64))
        elif isinstance(value, float):
            out.append(torch.tensor(value, dtype=torch.get_default_dtype()))
        elif hasattr(value, "getbands"):  # a PIL image: (H, W[, C]) -> (C, H, W) uint8
            pixels = np.asarray(value)
            pixels = pixels[:, :, None] if pixels.ndim == 2 else pixels
            out.append(torch.from_numpy(pixels.transpose(2, 0, 1).copy()))  # writable
        else:
            raise GpuflowError(
                f"{what} is a {type(value).__name__}; a resident dataset holds tensors, "
                "arrays, numbers and PIL images"
            )
    return out


class ImageFolder:
    """``root/<class>/<image>`` as a map-style dataset of (PIL RGB image, class index)."""

    def __init__(self, root: str | Path, size: int | tuple[int, int] | None = None) -> None:
        try:
            from PIL import Image
        except ImportError:
            raise GpuflowError(
                "reading images needs Pillow: pip install 'gpuflow[images]'"
            ) from None
        self._image = Image
        root = Path(root)
        if not root.is_dir():
            raise GpuflowError(f"{root} is not a folder of class folders")
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((root / name).iterdir())
            if path.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not self.items:
            raise GpuflowError(f"{root} has no images in class folders ({root}/<class>/<image>)")
        self.size = (size, size) if isinstance(size, int) else size
        self._first_size: tuple[tuple[int, int], Path] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, label = self.items[i]
        try:
            with self._image.open(path) as image:
                image = image.convert("RGB")
        except OSError as e:
            raise GpuflowError(f"{path}: not an image Pillow can read ({e})") from None
        if self.size is not None:
            image = image.resize((self.size[1], self.size[0]))  # PIL takes (width, height)
        elif self._first_size is None:
            self._first_size = (image.size, path)
        elif image.size != self._first_size[0]:
            (w, h), first = self._first_size
            raise GpuflowError(
                f"{path} is {image.size[0]}x{image.size[1]}, {first} {w}x{h}; pass size= "
                "to from_image_folder to resize every image to one size"
            )
        return image, label
