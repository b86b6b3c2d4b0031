"""What every benchmark shares: timing, machine facts and the JSON result file."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpuflow.common.atomic import write_text_atomic
from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device

# Benchmarks write here unless told otherwise (--out): beside the runs, not into a checkout.
RESULTS_DIR = Path("runs") / "bench"


def wall_ms(device: Device, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median host time of ``fn`` from idle device to idle device, in ms.

    For work whose cost is partly on the host (pinning, packing, Python per tensor): device
    events alone would miss it.
    """
    for _ in range(warmup):
        fn()
    device.synchronize()
    times = []
    for _ in range(repeats):
        device.synchronize()
        started = time.perf_counter()
        fn()
        device.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def device_ms(device: Device, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median device time of ``fn`` between events, in ms (the host clock on the cpu)."""
    return statistics.median(device.time_ms(fn, repeats=repeats, warmup=warmup))


def gb_per_s(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e6) if ms > 0 else 0.0


def machine(device: Device) -> dict[str, Any]:
    return {
        **device.describe(),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def device_slug(device: Device, count: int = 1) -> str:
    """A short name for the device in result file names: ``h100``, ``h200x2``, ``cpu``."""
    if device.type == "cpu":
        return "cpu"
    words = re.findall(r"[a-z0-9]+", device.name().lower())
    model = next((w for w in words if w not in ("nvidia", "amd", "intel", "tesla")), device.type)
    return f"{model}x{count}" if count > 1 else model


def check_results_folder(folder: Path | None = None) -> None:
    """Refuse, before a bench spends its time, a results folder (default ``runs/bench``)
    that could not be written: a file in its place, or a first existing folder on its path
    that is read-only. Nothing is created here: a bench refused for another reason leaves
    nothing behind."""
    folder = Path(folder) if folder else RESULTS_DIR
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise GpuflowError(
            f"cannot write bench results into {folder}: {existing} is a file, not a folder; "
            "choose another --out"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise GpuflowError(
            f"cannot write bench results into {folder}: {existing} is not writable (a "
            "read-only file system, or its permissions); choose another --out"
        )


def write_result(
    name: str, device: Device, payload: dict[str, Any], folder: Path | None = None,
    preset: str | None = None, gpus: int = 1,
) -> Path:  # fmt: skip
    """``<folder>/<date>-<name>-<preset>-<device>.json`` (default folder ``runs/bench``; the
    preset left out where a bench has none; ``gpus``: how many the bench ran on), written
    atomically under a name no earlier result has: results are never overwritten."""
    folder = Path(folder) if folder else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    stem = "-".join(
        part for part in (now.strftime("%Y-%m-%d"), name, preset, device_slug(device, gpus)) if part
    )
    path, n = folder / f"{stem}.json", 2
    while True:  # claimed by creating it: two benches ending at once never share a name
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            break
        except FileExistsError:
            path, n = folder / f"{stem}-{n}.json", n + 1
    stamp = now.strftime("%Y%m%d-%H%M%S")
    record = {"benchmark": name, "created_utc": stamp, "machine": machine(device), **payload}
    try:
        write_text_atomic(path, json.dumps(record, indent=2) + "\n")  # over its own claim
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path
