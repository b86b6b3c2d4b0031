"""``DeviceLoader`` against the PyTorch idioms it replaces, in one process: the loaders
sections of ``gpuflow bench transfer``.

- ``sweep``: batch sizes from pageable and pinned memory, through three idioms and two ways
  of using ``DeviceLoader``;
- ``cases``: batches where the idiom is worse by its structure (many column tensors,
  narrowable token ids, fp32 features read in bf16);
- ``image_loop``: an image-classification loop fed by a ``DataLoader`` with workers;
- ``text_loop``: a small language model trained on 8 KiB batches of token ids cut from a
  token array on the host, as a hand-written loop does.

Paths run in alternating rounds and the median round counts (for the training loops, the
median ratio of rounds run side by side, and each loop's feeds also timed alone, with no
model: what the loader adds to a step, apart from the rounds' spread); how they are timed:
``gpuflow.bench.loop_timing``; the loops' models and data: ``gpuflow.bench.workloads``. What
each part compares, and why the rounds alternate: docs/architecture/benches.md (The loaders
section).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpuflow.bench.loop_timing import consume, feed_cost, feed_figures, paired_rounds, timed_reads
from gpuflow.bench.results import gb_per_s
from gpuflow.bench.transfer_tables import KB, MB
from gpuflow.bench.workloads import (
    VOCAB,
    SmallLM,
    SyntheticImages,
    small_cnn,
    token_batches,
    train_images,
    train_text,
)
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

IDIOMS = ("dataloader", "pin_to", "to")
PATHS = (*IDIOMS, "deviceloader", "deviceloader_fresh")


@dataclass(frozen=True)
class LoaderBenchConfig:
    sizes: tuple[int, ...] = (8 * KB, 256 * KB, MB, 4 * MB, 16 * MB, 64 * MB)
    bytes_per_round: int = 2048 * MB  # each path moves this much per round (within limits)
    rounds: int = 3
    image_batch_sizes: tuple[int, ...] = (256, 2048)  # 3x64x64 uint8: 3.1 MB and 25 MB
    image_side: int = 64
    # Short runs move a lot from round to round (worker start-up, the host's drift;
    # docs/decisions/019): longer runs and more rounds, so that the median compares the
    # feeds, not the noise
    image_steps: int = 240
    image_rounds: int = 8
    image_workers: int = 6
    image_feed_batches: int = 600  # the image feeds alone, as text_feed_batches
    case_batches: int = 400  # per round, per path
    # The text loop: (text_batch, text_context) int64 inputs and targets, 8 KiB a step
    text_batch: int = 4
    text_context: int = 128
    text_width: int = 256
    text_steps: int = 200
    text_rounds: int = 12
    # The text feeds alone, no model: host time per batch, measured apart from the loop's
    # round-to-round spread
    text_feed_batches: int = 2000

    @classmethod
    def quick(cls) -> LoaderBenchConfig:
        return cls(
            sizes=(8 * KB, MB),
            bytes_per_round=16 * MB,
            rounds=1,
            image_batch_sizes=(32,),
            image_side=32,
            image_steps=6,
            image_rounds=1,
            image_workers=2,
            image_feed_batches=8,
            case_batches=16,
            text_batch=2,
            text_context=32,
            text_width=32,
            text_steps=6,
            text_rounds=1,
            text_feed_batches=8,
        )


def _batches_per_round(cfg: LoaderBenchConfig, nbytes: int) -> int:
    return max(32, min(2000, cfg.bytes_per_round // nbytes))


# ---- the sweep -----------------------------------------------------------------------------------


def _paths(device: Device) -> dict[str, Callable[[list[torch.Tensor]], Iterable[torch.Tensor]]]:
    target = device.torch
    pinned = device.supports_pinned_memory

    def dataloader(batches: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        loader = torch.utils.data.DataLoader(batches, batch_size=None, pin_memory=pinned)
        return (b.to(target, non_blocking=True) for b in loader)

    def pin_to(batches: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        if not pinned:
            return (b.to(target) for b in batches)
        return (b.pin_memory().to(target, non_blocking=True) for b in batches)

    def to(batches: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        return (b.to(target) for b in batches)

    def deviceloader(batches: list[torch.Tensor]) -> DeviceLoader:
        return DeviceLoader(batches, device)

    def deviceloader_fresh(batches: list[torch.Tensor]) -> DeviceLoader:
        # the sweep's batches are never written again: pinned ones may be read in place
        return DeviceLoader(batches, device, fresh_batches=True)

    return {
        "dataloader": dataloader, "pin_to": pin_to, "to": to, "deviceloader": deviceloader,
        "deviceloader_fresh": deviceloader_fresh,
    }  # fmt: skip


def sweep(device: Device, cfg: LoaderBenchConfig) -> list[dict[str, Any]]:
    """One row per (size, source kind): each path's GB/s and microseconds per batch."""
    paths = _paths(device)
    kinds = ("pageable", "pinned") if device.supports_pinned_memory else ("pageable",)
    rows = []
    for nbytes in cfg.sizes:
        n = _batches_per_round(cfg, nbytes)
        distinct = [torch.randn(nbytes // 4) for _ in range(4)]
        for kind in kinds:
            tensors = [t.pin_memory() for t in distinct] if kind == "pinned" else distinct
            batches = list(itertools.islice(itertools.cycle(tensors), n))
            for make in paths.values():  # untimed: kernels, allocator and threads warmed up
                consume(device, make(batches[: min(n, 16)]))
            seconds: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(cfg.rounds):
                for name, make in paths.items():
                    seconds[name].append(consume(device, make(batches)))
            row: dict[str, Any] = {"batch_bytes": nbytes, "source": kind, "batches": n}
            for name, runs in seconds.items():
                s = statistics.median(runs)
                row[f"{name}_gb_s"] = gb_per_s(nbytes * n, s * 1e3)
                row[f"{name}_us_per_batch"] = s / n * 1e6
            fastest = max(IDIOMS, key=lambda name: row[f"{name}_gb_s"])
            row["fastest_idiom"] = fastest
            row["vs_fastest_idiom"] = row["deviceloader_gb_s"] / row[f"{fastest}_gb_s"]
            row["vs_dataloader"] = row["deviceloader_gb_s"] / row["dataloader_gb_s"]
            row["fresh_vs_fastest_idiom"] = row["deviceloader_fresh_gb_s"] / row[f"{fastest}_gb_s"]
            no_compute = [consume(device, DeviceLoader(batches, device), compute=False)]
            row["deviceloader_host_us_per_batch"] = min(no_compute) / n * 1e6
            rows.append(row)
    return rows


# ---- where the idiom is worse by its structure ---------------------------------------------------


@dataclass(frozen=True)
class _Case:
    name: str
    make: Callable[[torch.Generator], Any]  # one host batch
    loader_options: dict[str, Any]


def _columns(n: int, rows: int = 4096) -> Callable[[torch.Generator], dict[str, torch.Tensor]]:
    return lambda g: {f"c{i}": torch.randn(rows, generator=g) for i in range(n)}


CASES = (
    _Case("tabular, 16 columns x 4096 rows (fp32)", _columns(16), {}),
    _Case("tabular, 64 columns x 4096 rows (fp32)", _columns(64), {}),
    _Case(
        "token ids, 32 x 1024 int64 under 50,257, narrow=True",
        lambda g: torch.randint(0, 50_257, (32, 1024), generator=g),
        {"narrow": True},
    ),
    _Case(
        "features, 1024 x 1024 fp32 read in bf16",
        lambda g: torch.randn(1024, 1024, generator=g),
        {"lossy_float": "bf16"},
    ),
)


def _leaves(batch: Any) -> list[torch.Tensor]:
    return list(batch.values()) if isinstance(batch, dict) else [batch]


def _read_all(device: Device, loader: Iterable[Any], dtype: torch.dtype | None) -> float:
    """``timed_reads`` with each batch's tensors stacked and summed (in ``dtype``, if given), as a
    model reads all of them."""

    def read(batch: Any) -> torch.Tensor:
        leaves = _leaves(batch)
        whole = torch.stack(leaves) if len(leaves) > 1 else leaves[0]
        return (whole if dtype is None else whole.to(dtype)).sum()

    return timed_reads(device, loader, read)


def _case_idioms(device: Device) -> dict[str, Callable[[list[Any]], Iterable[Any]]]:
    target = device.torch
    pinned = device.supports_pinned_memory

    def each(batch: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        return {k: move(v) for k, v in batch.items()} if isinstance(batch, dict) else move(batch)

    def dataloader(batches: list[Any]) -> Iterator[Any]:
        loader = torch.utils.data.DataLoader(batches, batch_size=None, pin_memory=pinned)
        return (each(b, lambda t: t.to(target, non_blocking=True)) for b in loader)

    def pin_to(batches: list[Any]) -> Iterator[Any]:
        move = (lambda t: t.pin_memory().to(target, non_blocking=True)) if pinned else None
        return (each(b, move or (lambda t: t.to(target))) for b in batches)

    def to(batches: list[Any]) -> Iterator[Any]:
        return (each(b, lambda t: t.to(target)) for b in batches)

    return {"dataloader": dataloader, "pin_to": pin_to, "to": to}


def cases(device: Device, cfg: LoaderBenchConfig) -> list[dict[str, Any]]:
    """One row per case: batches/s of each idiom and of ``DeviceLoader``, and the ratio to
    the fastest idiom."""
    idioms = _case_idioms(device)
    rows = []
    for case in CASES:
        g = torch.Generator().manual_seed(0)
        distinct = [case.make(g) for _ in range(4)]
        batches = list(itertools.islice(itertools.cycle(distinct), cfg.case_batches))
        dtype = torch.bfloat16 if case.loader_options.get("lossy_float") else None
        paths: dict[str, Callable[[list[Any]], Iterable[Any]]] = {
            **idioms,
            "deviceloader": lambda b, o=case.loader_options: DeviceLoader(b, device, **o),
            # no codecs: what narrowing (or bf16) costs or saves on this host and link
            "deviceloader_plain": lambda b: DeviceLoader(b, device, narrow=False),
        }
        for make in paths.values():  # untimed warm-up
            _read_all(device, make(batches[:16]), dtype)
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(cfg.rounds):
            for name, make in paths.items():
                seconds[name].append(_read_all(device, make(batches), dtype))
        logical = sum(t.numel() * t.element_size() for t in _leaves(distinct[0]))
        row: dict[str, Any] = {"case": case.name, "batch_bytes": logical,
                               "tensors": len(_leaves(distinct[0]))}  # fmt: skip
        for name, runs in seconds.items():
            row[f"{name}_batches_s"] = len(batches) / statistics.median(runs)
        fastest = max(IDIOMS, key=lambda name: row[f"{name}_batches_s"])
        row["fastest_idiom"] = fastest
        row["vs_fastest_idiom"] = row["deviceloader_batches_s"] / row[f"{fastest}_batches_s"]
        row["plain_vs_fastest_idiom"] = (
            row["deviceloader_plain_batches_s"] / row[f"{fastest}_batches_s"]
        )
        rows.append(row)
    return rows


# ---- the image loop ------------------------------------------------------------------------------


def image_loop(device: Device, cfg: LoaderBenchConfig) -> list[dict[str, Any]]:
    """Images per second through both feeds, at each batch size, and the feeds alone
    (``image_feed_cost``): what ``DeviceLoader`` adds to the training thread's step."""
    target = device.torch
    model = small_cnn().to(target).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    warmup = max(2, cfg.image_steps // 10)
    rows = []
    for batch_size in cfg.image_batch_sizes:
        data = SyntheticImages(batch_size * (cfg.image_steps + warmup), cfg.image_side)

        def source(pin: bool, data: Any = data, batch_size: int = batch_size) -> Any:
            return torch.utils.data.DataLoader(
                data, batch_size=batch_size, num_workers=cfg.image_workers,
                pin_memory=pin and device.supports_pinned_memory, persistent_workers=False,
                prefetch_factor=4,
            )  # fmt: skip

        def idiom() -> tuple[float, int]:
            feed = (
                {k: v.to(target, non_blocking=True) for k, v in b.items()} for b in source(True)
            )
            return train_images(device, feed, model, optimizer, warmup)

        def ours() -> tuple[float, int]:
            with DeviceLoader(source(False), device) as loader:
                return train_images(device, loader, model, optimizer, warmup)

        batch_bytes = batch_size * (3 * cfg.image_side**2 + 8)
        row: dict[str, Any] = {"batch_size": batch_size, "batch_bytes": batch_bytes}
        row |= paired_rounds(idiom, ours, cfg.image_rounds, "dataloader", "images")
        feed = image_feed_cost(device, batch_size, cfg)
        rows.append(row | feed_figures(feed, "dataloader", batch_size / row["dataloader_images_s"]))
    return rows


def image_feed_cost(device: Device, batch_size: int, cfg: LoaderBenchConfig) -> dict[str, float]:
    """``feed_cost`` of the image loop's feeds from the point where both take their batches
    from DataLoader's pin-memory thread: a bank of pinned batches (uint8 images, int64
    labels) through ``{k: v.to(non_blocking=True)}``, through ``DeviceLoader`` (which reads
    such batches where they lie), and as they are (``source_alone``)."""
    target = device.torch
    pin = device.supports_pinned_memory
    generator = torch.Generator().manual_seed(0)
    side = cfg.image_side

    def made() -> dict[str, torch.Tensor]:
        batch = {
            "image": torch.randint(0, 256, (batch_size, 3, side, side), dtype=torch.uint8,
                                   generator=generator),
            "label": torch.arange(batch_size),
        }  # fmt: skip
        return {k: v.pin_memory() for k, v in batch.items()} if pin else batch

    bank = [made() for _ in range(4)]
    batches = [bank[i % len(bank)] for i in range(cfg.image_feed_batches)]
    placed = {"image": torch.zeros(1, 1, 1, 1, dtype=torch.uint8, device=target)}
    feeds: dict[str, Callable[[], Iterable[Any]]] = {
        "dataloader": lambda: (
            {k: v.to(target, non_blocking=True) for k, v in b.items()} for b in batches
        ),
        "deviceloader": lambda: DeviceLoader(batches, device, fresh_batches=True),
        "source_alone": lambda: (placed for _ in batches),
    }
    return feed_cost(device, feeds, lambda b: b["image"][0, 0, 0, 0], cfg.image_feed_batches)


# ---- the text loop -------------------------------------------------------------------------------


def pin_to_pairs(
    device: Device, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The text loop's idiom: each of a pair's tensors moved by
    ``.pin_memory().to(non_blocking=True)`` (``.to()`` where there is no pinned memory)."""
    target = device.torch
    if not device.supports_pinned_memory:
        return ((x.to(target), y.to(target)) for x, y in pairs)
    return (
        (x.pin_memory().to(target, non_blocking=True), y.pin_memory().to(target, non_blocking=True))
        for x, y in pairs
    )


def text_loop(device: Device, cfg: LoaderBenchConfig) -> dict[str, Any]:
    """Tokens per second with each batch moved by ``pin_memory().to(non_blocking=True)``
    (the idiom of hand-written GPT loops) and by ``DeviceLoader``, alternating rounds."""
    target = device.torch
    model = SmallLM(cfg.text_width, cfg.text_context).to(target)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    tokens = np.random.default_rng(0).integers(0, VOCAB, 1 << 20).astype(np.uint16)
    warmup = max(2, cfg.text_steps // 10)
    steps = cfg.text_steps + warmup

    def source() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return token_batches(tokens, cfg.text_batch, cfg.text_context, steps)

    def idiom() -> tuple[float, int]:
        return train_text(device, pin_to_pairs(device, source()), model, optimizer, warmup)

    def ours() -> tuple[float, int]:
        with DeviceLoader(source(), device) as loader:
            return train_text(device, loader, model, optimizer, warmup)

    row: dict[str, Any] = {
        "batch": cfg.text_batch, "context": cfg.text_context,
        "batch_bytes": 2 * cfg.text_batch * cfg.text_context * 8,
    }  # fmt: skip
    row |= paired_rounds(idiom, ours, cfg.text_rounds, "pin_to", "tokens")
    step_s = cfg.text_batch * cfg.text_context / row["pin_to_tokens_s"]
    return row | feed_figures(text_feed_cost(device, tokens, cfg), "pin_to", step_s)


def text_feed_cost(device: Device, tokens: np.ndarray, cfg: LoaderBenchConfig) -> dict[str, float]:
    """``feed_cost`` of the text loop's feeds: the source's batches through the idiom,
    through ``DeviceLoader``, and as they are (``source_alone``: the same cutting of
    batches, nothing moved)."""
    target = device.torch
    placed = (torch.zeros(1, 1, dtype=torch.int64, device=target),) * 2

    def source() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return token_batches(tokens, cfg.text_batch, cfg.text_context, cfg.text_feed_batches)

    feeds: dict[str, Callable[[], Iterable[Any]]] = {
        "pin_to": lambda: pin_to_pairs(device, source()),
        "deviceloader": lambda: DeviceLoader(source(), device),
        "source_alone": lambda: (placed for _ in source()),
    }
    return feed_cost(device, feeds, lambda b: b[0][0, 0] + b[1][0, 0], cfg.text_feed_batches)
