"""``ResidentLoader``: shuffled batches of a ``ResidentDataset``, drawn and augmented on the
device, resumable.

    loader = ResidentLoader(data, batch_size=512, drop_last=True, seed=0,
                            transform=Compose(RandomCrop(32, 4), HorizontalFlip()))
    for epoch in range(epochs):
        for images, labels in loader:        # each iter() is the next epoch, as with DataLoader
            ...

Each epoch's order, each rank's share and each sample's augmentation are pure functions of
(seed, epoch, place), so ``state_dict`` / ``load_state_dict`` resume the same batches (a
loop that starts at the saved ``state["epoch"]`` trains every epoch once);
``cursor()`` draws from a position held on the device, for a captured step; a dataset left on
the host streams through in chunks with the same batches. How: docs/architecture/data.md
(Resident datasets).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from gpuflow.accounting.tally import report_copy
from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.augment import Transform, check_transformed
from gpuflow.data.resident.dataset import ResidentDataset, gather_rows
from gpuflow.data.resident.keyed import check_seed, order_keys, sample_keys
from gpuflow.transfer.pinned import PinnedPool

Batch = tuple[torch.Tensor, ...]
_STATE_KEYS = ("samples", "batch_size", "world_size", "seed", "shuffle", "drop_last")


def _ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The given rank and world size, else torch.distributed's, else one process."""
    if rank is None and world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise GpuflowError("give both rank and world_size, or neither")
    if world_size < 1 or not 0 <= rank < world_size:
        raise GpuflowError(f"rank must be in [0, world_size), got {rank} of {world_size}")
    return rank, world_size


class ResidentLoader:
    """See the module docstring."""

    def __init__(
        self,
        dataset: ResidentDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        transform: Transform | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        chunk_bytes: int = 256 << 20,
        compile: bool | None = None,
    ) -> None:
        if not isinstance(dataset, ResidentDataset):
            raise GpuflowError(
                f"ResidentLoader takes a ResidentDataset, got {type(dataset).__name__}; "
                "wrap tensors with ResidentDataset(...) or a Dataset with "
                "ResidentDataset.from_dataset(...)"
            )
        if isinstance(batch_size, bool) or not hasattr(batch_size, "__index__") or batch_size < 1:
            raise GpuflowError(f"batch_size must be an integer of at least 1, got {batch_size!r}")
        batch_size = int(batch_size)  # (a NumPy integer too)
        seed = check_seed(seed)
        self.dataset, self.batch_size = dataset, batch_size
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.transform = transform
        self.rank, self.world_size = _ranks(rank, world_size)
        self.device = dataset.device
        # The draw (gather, widening, keys, transform) as a few fused kernels instead of
        # dozens of small ones (docs/decisions/036); by default where torch.compile makes
        # GPU kernels.
        if compile is None:
            compile = self.device.type == "cuda"
        self.compiled = bool(compile and transform is not None)
        self._traced = False
        # This rank's samples per epoch: every world_size-th place of the epoch's order.
        self.samples = len(dataset) // self.world_size if self.world_size > 1 else len(dataset)
        if self.samples == 0 or (drop_last and self.samples < batch_size):
            short = f"{self.samples}, no full batch of {batch_size}" if self.samples else "none"
            ways = ["a smaller batch", "drop_last=False"] if self.samples else []
            ways += ["fewer ranks"] if self.world_size > 1 else []
            raise GpuflowError(
                f"{len(dataset)} samples over {self.world_size} ranks give rank {self.rank} "
                f"{short}; use {' or '.join(ways)}"
            )
        self.chunk_steps = max(1, chunk_bytes // (batch_size * dataset.sample_bytes))
        self._rows = torch.arange(batch_size, device=self.device.torch)  # (B,)
        self._last_place = (self.samples - 1) * self.world_size + self.rank
        self._next = (0, 0)  # (epoch, step) the next iter() starts at
        self._position: tuple[int, int] | None = None  # after the last batch handed out
        self._reader: ThreadPoolExecutor | None = None  # streaming: gathers the next chunk
        self._pool: PinnedPool | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Batches per epoch (on this rank)."""
        if self.drop_last:
            return self.samples // self.batch_size
        return math.ceil(self.samples / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        # A position at an epoch's end gives that epoch's rest, no batches, and the epoch
        # after it comes next: the loop that resumes at the saved epoch trains each once.
        epoch, step = self._next
        self._next = (epoch + 1, 0)
        self._position = (epoch, step)  # a checkpoint before its first batch resumes here
        if self.dataset.resident:
            return _ResidentEpoch(self, epoch, step)
        return _StreamedEpoch(self, epoch, step)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` starts, from its first batch; or, after
        ``load_state_dict`` of a position in that epoch, from where it stopped: the usual
        ``set_epoch`` at the top of each epoch keeps a resumed position, and one taken after
        the epoch's last batch gives no batches, so the epoch is not trained again."""
        if self._next[0] != epoch:
            self._next = (epoch, 0)
        self._position = None

    # ---- position ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: after the last batch handed out (or where the next
        ``iter()`` starts, before any), with what it was made with."""
        epoch, step = self._position if self._position is not None else self._next
        return {"epoch": epoch, "step": step, **self._settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next ``iter()`` carries on after the batch ``state`` was taken at: the rest
        of epoch ``state["epoch"]`` (none, if it was taken after its last batch)."""
        self.check_state(state)
        self._next = (int(state["epoch"]), int(state["step"]))
        self._position = None

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a position taken with other settings: it would not continue the batches."""
        mine = self._settings()
        changed = [k for k in _STATE_KEYS if k in state and state[k] != mine[k]]
        if changed:
            saved = ", ".join(f"{k} {state[k]} (now {mine[k]})" for k in changed)
            raise GpuflowError(
                f"the saved loader position was taken with {saved}: it would not continue the "
                "same batches; make the loader as it was, or start its epochs afresh"
            )

    def _settings(self) -> dict[str, Any]:
        return {
            "samples": len(self.dataset),
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    # ---- drawing ----------------------------------------------------------------------------

    def order(self, epoch: int, device: torch.device | None = None) -> torch.Tensor:
        """Epoch ``epoch``'s order of all samples: (N,) int64, on ``device`` (the dataset's
        by default). The same on every device: a stable sort of integer keys."""
        device = device or self.device.torch
        n = len(self.dataset)
        if not self.shuffle:
            return torch.arange(n, device=device)
        return torch.argsort(order_keys(self.seed, epoch, n, device), stable=True)

    def places(self, step: int | torch.Tensor, size: int) -> torch.Tensor:
        """Places in the epoch's order of batch ``step``'s ``size`` samples on this rank."""
        rows = self._rows[:size]
        return batch_places(rows, step, self.batch_size, self.world_size, self.rank)

    def draw_next(self, order: torch.Tensor, step: torch.Tensor, epoch: torch.Tensor) -> Batch:
        """The full batch at position ``step`` (a 0-dim device tensor, moved on by one) of
        epoch ``epoch``'s ``order``: each field in its given type, the transform applied to
        the first. Places past this rank's last repeat it (the iterators draw the last
        partial batch with ``draw_rows`` instead). Device work only, fixed shapes: compiled
        on CUDA, safe in a CUDA graph."""
        args = (
            self.dataset.tensors, self.dataset.dtypes, order, step, epoch, self._rows,
            self.world_size, self.rank, self._last_place, self.transform, self.seed,
        )  # fmt: skip
        if not self.compiled:
            return draw_next(*args)
        if not self._traced:  # what transforms build at their first call, built eagerly
            first = self._rows[:1]
            draw_samples(self.dataset.tensors, self.dataset.dtypes, first, first, *args[-2:], epoch)
            self._traced = True
        return _compiled_draw_next()(*args)

    def draw_rows(self, order: torch.Tensor, step: int, size: int, epoch: torch.Tensor) -> Batch:
        """The first ``size`` samples of batch ``step`` of epoch ``epoch``'s ``order``, and
        no others: the last partial batch, drawn eagerly at its own size, so the transform
        sees only real samples (no second shape is compiled for one batch an epoch)."""
        places = self.places(step, size)
        return draw_samples(
            self.dataset.tensors, self.dataset.dtypes, order[places], places, self.transform,
            self.seed, epoch,
        )  # fmt: skip

    def device_scalar(self, value: int) -> torch.Tensor:
        """``value`` (an epoch, a step) as a 0-dim int64 device tensor, made by a fill (no
        copy, no wait)."""
        return torch.full((), value, dtype=torch.int64, device=self.device.torch)

    def cursor(self) -> BatchCursor:
        """Full batches from a position on the device, for a captured step."""
        return BatchCursor(self)

    # ---- streaming ----------------------------------------------------------------------------

    def _streaming_parts(self) -> tuple[ThreadPoolExecutor, PinnedPool]:
        with self._lock:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="gpuflow-chunks")
                chunk = self.chunk_steps * self.batch_size * self.dataset.sample_bytes
                fields = len(self.dataset.fields)
                self._pool = PinnedPool(self.device, max_bytes=max(1 << 20, 4 * fields * chunk))
            return self._reader, self._pool

    def close(self) -> None:
        """Stop the streaming thread and free its pinned buffers (a resident loader holds
        neither)."""
        with self._lock:
            reader, pool, self._reader, self._pool = self._reader, self._pool, None, None
        if reader is not None:
            reader.shutdown(wait=True)
        if pool is not None:
            self.device.synchronize()
            pool.close()

    def __enter__(self) -> ResidentLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- copies -------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """A pickled or copied loader has the dataset, the settings and the position; its
        streaming thread and pinned buffers are its own, made again when it streams."""
        state = self.__dict__.copy()
        state.update(_reader=None, _pool=None, _lock=None, _traced=False)
        if self._position is not None:  # mid-epoch: the copy has no epoch iterator of its
            # own, so its next iter() carries on from here, as load_state_dict(state_dict())
            state.update(_next=self._position, _position=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def draw_samples(
    stored: Batch, dtypes: tuple[torch.dtype, ...], rows: torch.Tensor, places: torch.Tensor,
    transform: Transform | None, seed: int, epoch: torch.Tensor,
) -> Batch:  # fmt: skip
    """``stored[rows]`` field by field, widened to ``dtypes``, the first through ``transform``
    with each sample's key from (seed, epoch, place)."""
    out = list(gather_rows(stored, dtypes, rows))
    if transform is not None:
        images = transform(out[0], sample_keys(seed, epoch, places))
        check_transformed(images, rows.numel(), transform)
        out[0] = images
    return tuple(out)


def batch_places(
    rows: torch.Tensor, step: int | torch.Tensor, batch_size: int, world_size: int, rank: int
) -> torch.Tensor:
    """Places in the epoch's order of rows ``rows`` (B,) of batch ``step`` on this rank:
    every ``world_size``-th place, from ``rank``."""
    positions = rows + step * batch_size  # (B,) this rank's positions
    return positions if world_size == 1 else positions * world_size + rank


def draw_next(
    stored: Batch, dtypes: tuple[torch.dtype, ...], order: torch.Tensor, step: torch.Tensor,
    epoch: torch.Tensor, rows: torch.Tensor, world_size: int, rank: int, last_place: int,
    transform: Transform | None, seed: int,
) -> Batch:  # fmt: skip
    """``ResidentLoader.draw_next``: the places of batch ``step`` (B,), then its samples."""
    places = batch_places(rows, step, rows.numel(), world_size, rank).clamp(max=last_place)
    step.add_(1)
    return draw_samples(stored, dtypes, order[places], places, transform, seed, epoch)


@functools.cache
def _compiled_draw_next() -> Any:
    """``draw_next`` compiled once per process (the position, the gathers, the widening and
    the transform fused into a few kernels); loaders made anew each epoch reuse the code
    compiled for a dataset and transform like theirs instead of compiling it again."""
    return torch.compile(draw_next, dynamic=False)


class _ResidentEpoch:
    """One epoch of a resident dataset from ``step`` on: device work only per batch."""

    def __init__(self, loader: ResidentLoader, epoch: int, step: int) -> None:
        self.loader, self.epoch, self.step = loader, epoch, step
        self.steps = len(loader)
        self._order = loader.order(epoch) if step < self.steps else None
        self._epoch = loader.device_scalar(epoch)
        self._step = loader.device_scalar(step)  # the device's copy of the position

    def __iter__(self) -> _ResidentEpoch:
        return self

    def __next__(self) -> Batch:
        loader = self.loader
        if self.step >= self.steps:
            raise StopIteration
        size = min(loader.batch_size, loader.samples - self.step * loader.batch_size)
        if size < loader.batch_size:  # the last partial batch: its real samples only
            batch = loader.draw_rows(self._order, self.step, size, self._epoch)
        else:
            batch = loader.draw_next(self._order, self._step, self._epoch)
        self.step += 1
        loader._position = (self.epoch, self.step)
        return batch


class _StreamedEpoch:
    """One epoch of a dataset held on the host: the samples of ``chunk_steps`` batches are
    gathered in the epoch's order into pinned memory on a helper thread and copied while
    the batches before them are used; batches are cut from the chunk on the device."""

    def __init__(self, loader: ResidentLoader, epoch: int, step: int) -> None:
        self.loader, self.epoch, self.step = loader, epoch, step
        self.steps = len(loader)
        self._epoch = loader.device_scalar(epoch)
        self._device = loader.device
        self._order = loader.order(epoch, torch.device("cpu")) if step < self.steps else None
        self._stream = self._device.new_stream()
        self._chunks: dict[int, Future] = {}
        self._current: tuple[int, Batch] | None = None  # (chunk index, its device fields)

    def __iter__(self) -> _StreamedEpoch:
        return self

    def _chunk_range(self, chunk: int) -> tuple[int, int]:
        first = chunk * self.loader.chunk_steps
        return first, min(self.steps, first + self.loader.chunk_steps)

    def _start(self, chunk: int) -> None:
        if chunk in self._chunks or self._chunk_range(chunk)[0] >= self.steps:
            return
        reader, pool = self.loader._streaming_parts()
        self._chunks[chunk] = reader.submit(self._load, chunk, pool)

    def _load(self, chunk: int, pool: PinnedPool) -> tuple[Batch, Any]:
        """(helper thread) The chunk's samples, in order, copied to fresh device tensors on
        the epoch's copy stream; returns them and the event of the last copy."""
        loader, data = self.loader, self.loader.dataset
        first, end = self._chunk_range(chunk)
        start = first * loader.batch_size
        count = min(loader.samples, end * loader.batch_size) - start
        places = torch.arange(start, start + count) * loader.world_size + loader.rank
        index = self._order[places]  # (count,) host
        out = []
        with self._device.use_stream(self._stream):
            for host, field in zip(data.tensors, data.fields, strict=True):
                buffer = pool.acquire(count * field.sample_bytes, timeout=None)
                staged = buffer.view(field.stored, (count, *field.shape))
                torch.index_select(host, 0, index, out=staged)  # (count, ...) pinned
                on_device = torch.empty_like(staged, device=self._device.torch)
                on_device.copy_(staged, non_blocking=True)
                copied = self._device.new_event()
                copied.record(self._stream)
                pool.release(buffer, after=copied)
                out.append(on_device)
            done = self._device.new_event()
            done.record(self._stream)
        return tuple(out), done

    def __next__(self) -> Batch:
        loader = self.loader
        if self.step >= self.steps:
            self._current = None
            raise StopIteration
        chunk = self.step // loader.chunk_steps
        if self._current is None or self._current[0] != chunk:
            self._start(chunk)
            fields, done = self._chunks.pop(chunk).result()
            for t in fields:  # copied on the helper thread: counted where they are used
                report_copy("h2d", t.nbytes, "ResidentLoader chunk", str(t.dtype)[6:], True)
            self._device.current_stream().wait_event(done)
            if self._device.type == "cuda":
                for t in fields:  # made on the copy stream, read on this one from here
                    t.record_stream(self._device.current_stream())
            self._current = (chunk, fields)
            self._start(chunk + 1)  # the next chunk is gathered and copied meanwhile
        first = self._chunk_range(chunk)[0]
        size = min(loader.batch_size, loader.samples - self.step * loader.batch_size)
        local = loader._rows[:size] + (self.step - first) * loader.batch_size  # (size,)
        places = loader.places(self.step, size)
        # Uncompiled: each chunk's fields are of their own length.
        batch = draw_samples(
            self._current[1], loader.dataset.dtypes, local, places, loader.transform, loader.seed,
            self._epoch,
        )  # fmt: skip
        self.step += 1
        loader._position = (self.epoch, self.step)
        return batch


class BatchCursor:
    """Full batches of a resident dataset at a position held on the device.

        cursor = loader.cursor()
        cursor.start_epoch(0)                     # host calls between epochs, no sync
        with torch.cuda.graph(graph):
            images, labels = cursor.draw()        # reads and advances the device position
            ...                                   # the step
        for epoch in range(epochs):
            cursor.start_epoch(epoch)
            for _ in range(len(cursor)):
                graph.replay()

    ``draw`` gives the batches ``iter(loader)`` gives for the same epoch and step.
    """

    def __init__(self, loader: ResidentLoader) -> None:
        if not loader.dataset.resident:
            raise GpuflowError(
                "this dataset is larger than the device budget and streams from the host; "
                "its batches cannot be drawn inside a captured step: iterate the loader"
            )
        self.loader = loader
        device = loader.device.torch
        self.order = torch.empty(len(loader.dataset), dtype=torch.int64, device=device)  # (N,)
        self.epoch_number = torch.zeros((), dtype=torch.int64, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.epoch: int | None = None

    def __len__(self) -> int:
        """Full batches per epoch: the last partial one is never drawn."""
        return self.loader.samples // self.loader.batch_size

    def start_epoch(self, epoch: int, step: int = 0) -> None:
        """Draw epoch ``epoch``'s order into the cursor's buffer and point it at ``step``.
        Device work only; outside any captured graph."""
        self.order.copy_(self.loader.order(epoch))
        self.epoch_number.fill_(epoch)
        self.step.fill_(step)
        self.epoch = epoch

    def draw(self) -> Batch:
        """The batch at the cursor's position, then the position moves on. Fixed shapes,
        device work only, no sync: safe inside a CUDA graph."""
        if self.epoch is None:
            raise GpuflowError("call cursor.start_epoch(epoch) before the first draw")
        return self.loader.draw_next(self.order, self.step, self.epoch_number)

    def state_dict(self) -> dict[str, Any]:
        """The position, read from the device (one wait: call it at checkpoints)."""
        if self.epoch is None:
            raise GpuflowError("the cursor has no position before start_epoch")
        from gpuflow.transfer.mirror import read_now

        return {"epoch": self.epoch, "step": read_now(self.step)[0], **self.loader._settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the cursor's or the loader's)."""
        self.loader.check_state(state)
        epoch, step = int(state["epoch"]), int(state["step"])
        if step >= len(self):
            epoch, step = epoch + 1, 0
        self.start_epoch(epoch, step)
