"""``gpuflow bench images``: an image classifier's training loop fed four ways, in one process.

- ``dataloader_cpu_aug``: ``DataLoader(num_workers, pin_memory=True)`` whose dataset crops and
  flips each image on the host, then ``.to(non_blocking=True)`` (the best worker count tried);
- ``dataloader_gpu_aug``: the same loader, the batch augmented on the device after the copy;
- ``resident``: ``ResidentLoader`` over the dataset in device memory, augmented there;
- ``data_free``: the same step on one fixed batch, the ceiling of any feed.

On CUDA also: the resident draw left uncompiled, and the step captured in one CUDA graph
with the cursor's draw and on the fixed batch. On every device the resident rows run again
inside a ``TransferLedger``. A small ResNet-style CIFAR net on CIFAR-shaped uint8 images made here;
paths alternate in rounds, the median round counts. What each row is and why:
docs/architecture/benches.md (gpuflow bench images).
"""

from __future__ import annotations

import dataclasses
import itertools
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuflow.bench.loop_timing import timed_steps
from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.augment import Compose, HorizontalFlip, Normalize, RandomCrop
from gpuflow.data.resident.dataset import ResidentDataset
from gpuflow.data.resident.loader import ResidentLoader
from gpuflow.device.accelerator import Device
from gpuflow.transfer.upload import place

MEAN, STD = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)  # CIFAR-10's, near enough
PATHS = ("dataloader_cpu_aug", "dataloader_gpu_aug", "resident", "data_free")
# CUDA only: the resident draw with its transform left uncompiled, and the captured steps
CUDA_PATHS = ("resident_uncompiled", "resident_graph", "data_free_graph")
# What counting costs a real step: the resident feeds again, inside a TransferLedger.
LEDGER_PATHS = ("resident_in_ledger", "resident_graph_in_ledger")


@dataclass(frozen=True)
class ImagesBenchConfig:
    sides: tuple[int, ...] = (32, 64)
    samples: int = 50_000  # CIFAR-10's training set
    batch_size: int = 512
    steps: int = 100  # timed steps per round and path
    warmup: int = 10  # untimed steps first (more for a DataLoader: its head start drained)
    rounds: int = 5
    workers: tuple[int, ...] = (4, 8, 12, 16)  # the baseline's worker counts tried
    prefetch_factor: int = 2  # DataLoader's default
    widths: tuple[int, int, int, int] = (32, 64, 128, 256)  # the net's channels per stage

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.steps < 1 or self.rounds < 1 or not self.sides:
            raise GpuflowError("the images bench needs a batch, steps, rounds and a side")
        if self.samples < self.batch_size:
            raise GpuflowError(f"{self.samples} samples hold no batch of {self.batch_size}")
        if any(side < 8 or side % 8 for side in self.sides):
            raise GpuflowError(f"image sides are multiples of 8 from 8, got {self.sides}")

    @classmethod
    def quick(cls) -> ImagesBenchConfig:
        return cls(
            sides=(16,),
            samples=96,
            batch_size=16,
            steps=2,
            warmup=1,
            rounds=1,
            workers=(0, 1),
            widths=(4, 8, 8, 8),
        )


def resnet_cifar(side: int, widths: tuple[int, int, int, int] = (32, 64, 128, 256)) -> nn.Module:
    """A ResNet-style CIFAR classifier: conv-BN-ReLU stages with max pooling and two
    residual blocks; ``side`` 64 pools once more at the start, so both cost alike per pixel."""

    def conv(c_in: int, c_out: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()
        )

    class Residual(nn.Module):
        def __init__(self, channels: int) -> None:
            super().__init__()
            self.body = nn.Sequential(conv(channels, channels), conv(channels, channels))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.body(x)

    a, b, c, d = widths
    stem = [conv(3, a)] + ([nn.MaxPool2d(2)] if side >= 64 else [])
    return nn.Sequential(
        *stem,
        conv(a, b), nn.MaxPool2d(2), Residual(b),
        conv(b, c), nn.MaxPool2d(2),
        conv(c, d), nn.MaxPool2d(2), Residual(d),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(d, 10),
    )  # fmt: skip


def synthetic_images(samples: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 3, side, side) uint8 images and (N,) int64 labels, the same on every run."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (samples, 3, side, side), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return images, labels


class HostAugmented(torch.utils.data.Dataset):
    """Each image cropped from its 4-pixel reflect padding and flipped at random, on the
    host, one sample at a time (what a torchvision ``RandomCrop`` + ``RandomHorizontalFlip``
    pipeline does in the workers)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool) -> None:
        self.images, self.labels, self.augment = images, labels, augment
        self.side = images.shape[-1]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]  # (3, S, S) uint8
        if self.augment:
            padded = F.pad(image[None].float(), (4, 4, 4, 4), mode="reflect")[0]
            top, left = (int(v) for v in torch.randint(0, 9, (2,)))
            image = padded[:, top : top + self.side, left : left + self.side].to(torch.uint8)
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return image, self.labels[i]


def _gpu_augment(device: Device, side: int) -> Compose:
    return Compose(RandomCrop(side, padding=4), HorizontalFlip(), _normalize(device))


def _normalize(device: Device) -> Normalize:
    """To the step's input type: bf16 where the step runs under bf16 autocast."""
    dtype = torch.bfloat16 if device.supports_bf16_autocast else torch.float32
    return Normalize(MEAN, STD, dtype=dtype, channels_last=True)


class _Trainer:
    """One model, its optimizer and its step, shared by every path of a side."""

    def __init__(self, device: Device, side: int, widths: tuple[int, int, int, int]) -> None:
        self.device = device
        torch.manual_seed(0)
        model = place(resnet_cifar(side, widths), device.torch)
        self.model = model.to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4
        )

    def step(self, images: torch.Tensor, labels: torch.Tensor, clear: bool = True) -> None:
        """``images`` normalized (B, 3, S, S): forward, backward, update; device work only.
        A captured step keeps its gradients (``clear=False``): each replay writes them anew."""
        with self.device.autocast(cache=False):  # no cache: the step may be captured
            loss = F.cross_entropy(self.model(images), labels)
        loss.backward()
        self.optimizer.step()
        if clear:
            self.optimizer.zero_grad(set_to_none=True)


def _endless(make: Callable[[], Any]) -> Iterator[Any]:
    """Batches of epoch after epoch (each ``make()`` one epoch's iterable)."""
    return itertools.chain.from_iterable(make() for _ in itertools.count())


class _Side:
    """Every path of one image side, ready to run a round."""

    def __init__(self, device: Device, cfg: ImagesBenchConfig, side: int) -> None:
        self.device, self.cfg, self.side = device, cfg, side
        images, labels = synthetic_images(cfg.samples, side)
        self.host = (images, labels)
        self.trainer = _Trainer(device, side, cfg.widths)
        self.resident = ResidentDataset(images, labels, device=device, show_progress=False)
        self.normalize = _normalize(device)
        self.gpu_augment = _gpu_augment(device, side)
        self.resident_loader = self._resident_loader()
        started = time.perf_counter()  # the first draw compiles the transform (on CUDA)
        next(iter(self.resident_loader))
        device.synchronize()
        self.first_draw_s = time.perf_counter() - started
        self.uncompiled_loader = self._resident_loader(compile=False)
        self.loaders: dict[tuple[int, bool], torch.utils.data.DataLoader] = {}
        self.fixed = self._fixed_batch()
        self.graphs: dict[str, Callable[[], None]] = {}

    def _fixed_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.resident.gather(torch.arange(self.cfg.batch_size, device=self.device.torch))
        keys = torch.zeros(len(y), dtype=torch.int64, device=self.device.torch)
        return self.normalize(x, keys), y

    def _resident_loader(self, compile: bool | None = None) -> ResidentLoader:
        return ResidentLoader(
            self.resident, self.cfg.batch_size, drop_last=True, transform=self.gpu_augment,
            compile=compile,
        )  # fmt: skip

    def dataloader(self, workers: int, augment: bool) -> torch.utils.data.DataLoader:
        """Workers that start with each round's first batch and end with the round, so that
        none is still making batches while another feed is timed."""
        key = (workers, augment)
        if key not in self.loaders:
            extra = {"prefetch_factor": self.cfg.prefetch_factor} if workers else {}
            self.loaders[key] = torch.utils.data.DataLoader(
                HostAugmented(*self.host, augment), batch_size=self.cfg.batch_size,
                shuffle=True, drop_last=True, num_workers=workers,
                pin_memory=self.device.supports_pinned_memory, **extra,
            )  # fmt: skip
        return self.loaders[key]

    def close(self) -> None:
        self.loaders.clear()
        self.resident_loader.close()

    # ---- one round of each path -------------------------------------------------------------

    def run(self, path: str, workers: int = 0) -> float:
        if path.endswith("_in_ledger"):
            from gpuflow.accounting.ledger import TransferLedger

            with TransferLedger(self.device):
                return self.run(path.removesuffix("_in_ledger"), workers)
        cfg, device, trainer = self.cfg, self.device, self.trainer
        target, B = device.torch, cfg.batch_size
        warmup = cfg.warmup + workers * cfg.prefetch_factor  # the loader's head start drained

        def moved(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return tuple(t.to(target, non_blocking=True) for t in batch)

        if path == "dataloader_cpu_aug":

            def step(batch: Any) -> int:
                x, y = moved(batch)
                trainer.step(self.normalize(x, y), y)  # the keys are unused by Normalize
                return len(y)

            batches = _endless(lambda: self.dataloader(workers, augment=True))
        elif path == "dataloader_gpu_aug":

            def step(batch: Any) -> int:
                x, y = moved(batch)
                keys = torch.randint(0, 2**32, (len(y),), device=target)
                trainer.step(self.gpu_augment(x, keys), y)
                return len(y)

            batches = _endless(lambda: self.dataloader(workers, augment=False))
        elif path in ("resident", "resident_uncompiled"):
            loader = self.resident_loader if path == "resident" else self.uncompiled_loader

            def step(batch: Any) -> int:
                trainer.step(*batch)
                return B

            batches = _endless(lambda: loader)
        elif path == "data_free":

            def step(batch: Any) -> int:
                trainer.step(*self.fixed)
                return B

            batches = itertools.repeat(None)
        else:  # the captured paths: one replay a step
            replay = self.graphs.get(path) or self._capture(path)

            def step(batch: Any) -> int:
                replay()
                return B

            batches = itertools.repeat(None)
        seconds, images = timed_steps(
            device, itertools.islice(batches, warmup + cfg.steps), step, warmup
        )
        return images / seconds

    def _capture(self, path: str) -> Callable[[], None]:
        """The step (with the resident cursor's draw, for ``resident_graph``) as one CUDA
        graph, warmed up on a side stream first; returns what runs one step."""
        trainer = self.trainer
        if path == "resident_graph":
            cursor = self.resident_loader.cursor()
            cursor.start_epoch(0)

            def body() -> None:
                trainer.step(*cursor.draw(), clear=False)
        else:
            cursor = None

            def body() -> None:
                trainer.step(*self.fixed, clear=False)

        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            for _ in range(3):
                trainer.optimizer.zero_grad(set_to_none=True)
                body()
        torch.cuda.current_stream().wait_stream(side_stream)
        graph = torch.cuda.CUDAGraph()
        trainer.optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            body()
        epoch = itertools.count(1)
        state = {"left": len(cursor) if cursor else 0}

        def replay() -> None:
            if cursor is not None:
                if state["left"] == 0:  # host work between epochs: a new order, no sync
                    cursor.start_epoch(next(epoch))
                    state["left"] = len(cursor)
                state["left"] -= 1
            graph.replay()

        if cursor is not None:
            cursor.start_epoch(0)
            state["left"] = len(cursor)
        self.graphs[path] = replay
        return replay


def _ledger_per_step(side: _Side, steps: int = 20) -> dict[str, float]:
    """H2D bytes and host syncs per steady step of the resident path, from the ledger."""
    from gpuflow.accounting.ledger import TransferLedger

    batches = _endless(lambda: side.resident_loader)
    for _ in range(3):
        side.trainer.step(*next(batches))
    side.device.synchronize()
    with TransferLedger(side.device) as ledger:
        for _ in range(steps):
            side.trainer.step(*next(batches))
    totals = ledger.summary().totals
    return {"h2d_bytes_per_step": totals.h2d_bytes / steps, "syncs_per_step": totals.syncs / steps}


def run_images_bench(device: Device, cfg: ImagesBenchConfig) -> dict[str, Any]:
    """Every path at every side; the baseline's worker count picked by one round each."""
    rows = []
    for image_side in cfg.sides:
        side = _Side(device, cfg, image_side)
        try:
            tried = {w: side.run("dataloader_cpu_aug", w) for w in cfg.workers}
            workers = max(tried, key=tried.get)
            paths = PATHS + (CUDA_PATHS if device.type == "cuda" else ())
            paths += tuple(p for p in LEDGER_PATHS if p.removesuffix("_in_ledger") in paths)
            rates: dict[str, list[float]] = {p: [] for p in paths}
            for _ in range(cfg.rounds):
                for path in paths:
                    rates[path].append(side.run(path, workers if "dataloader" in path else 0))
            row: dict[str, Any] = {
                "side": image_side,
                "batch_size": cfg.batch_size,
                "samples": cfg.samples,
                "baseline_workers": workers,
                "baseline_images_s_by_workers": {str(w): r for w, r in tried.items()},
                "dataset_device_bytes": side.resident.nbytes,
                # the process's peak so far: the images made on the host, the DataLoader's
                # pinned batches, torch's own (workers are processes of their own)
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "transform_compiled": side.resident_loader.compiled,
                "first_draw_s": side.first_draw_s,  # with the compile, where there is one
                "ledger_resident": _ledger_per_step(side),
            }
            for path, values in rates.items():
                row[f"{path}_images_s"] = statistics.median(values)
                row[f"{path}_images_s_per_round"] = values
            base = row["dataloader_cpu_aug_images_s"]
            row["resident_vs_dataloader_cpu_aug"] = row["resident_images_s"] / base
            row["resident_vs_data_free"] = row["resident_images_s"] / row["data_free_images_s"]
            for path in LEDGER_PATHS:
                if f"{path}_images_s" in row:  # the counted step's speed, as a fraction
                    plain = row[f"{path.removesuffix('_in_ledger')}_images_s"]
                    row[f"{path}_vs_uncounted"] = row[f"{path}_images_s"] / plain
            if device.type == "cuda":
                row["resident_graph_vs_data_free_graph"] = (
                    row["resident_graph_images_s"] / row["data_free_graph_images_s"]
                )
                row["peak_device_bytes"] = torch.cuda.max_memory_allocated(device.torch)
            rows.append(row)
        finally:
            side.close()
    return {"config": dataclasses.asdict(cfg), "rows": rows}


def print_images_table(results: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    for row in results["rows"]:
        out = table(
            "feed", "images/s", "vs DataLoader",
            title=(
                f"{row['side']}x{row['side']} images, batch {row['batch_size']}, "
                f"{row['samples']:,} samples; DataLoader with {row['baseline_workers']} workers"
            ),
        )  # fmt: skip
        base = row["dataloader_cpu_aug_images_s"]
        for path in (*PATHS, *CUDA_PATHS, *LEDGER_PATHS):
            if f"{path}_images_s" in row:
                rate = row[f"{path}_images_s"]
                out.add_row(path.replace("_", " "), f"{rate:,.0f}", f"{rate / base:.2f}x")
        out_console.print(out)
        ledger = row["ledger_resident"]
        out_console.print(
            f"resident: {row['resident_vs_data_free']:.1%} of the data-free step; per step "
            f"{ledger['h2d_bytes_per_step']:,.0f} bytes to the device, "
            f"{ledger['syncs_per_step']:g} host syncs"
        )
        counted = [
            f"{path.removesuffix('_in_ledger').replace('_', ' ')} at "
            f"{row[f'{path}_vs_uncounted']:.1%}"
            for path in LEDGER_PATHS
            if f"{path}_vs_uncounted" in row
        ]
        out_console.print("inside a TransferLedger: " + ", ".join(counted) + " of its speed")
