"""``gpuflow bench io``: token shards into device memory, by every path gpuflow has, in one run.

Paths, each timed from the shard files to a resident corpus the device holds:
- ``kvikio``: ``ResidentTokens(io="kvikio")``, through GPUDirect Storage or kvikio's
  compatibility mode (reported);
- ``pinned``: ``ResidentTokens(io="pinned")``, gpuflow's staged reads through a pinned pool;
- ``auto``: what ``data.io = "auto"`` takes here, timed on its own;
- ``memmap + .to()``: the idiom, ``torch.from_numpy(np.memmap(...)).to(device)`` per shard.

Both gpuflow paths check every id against the vocabulary as training does. Each path runs
cold (the files' pages dropped from the page cache first, and the share still cached
recorded) and warm (read once before timing). The corpus is a prepared folder's train
shards (``--data``) or shards of random tokens that the benchmark writes beside its results
and removes afterwards. The link's pinned host-to-device peak is measured beside them.
"""

from __future__ import annotations

import shutil
import statistics
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuflow.bench.pagecache import cached_fraction, drop_cached
from gpuflow.bench.results import RESULTS_DIR
from gpuflow.common.console import err_console, out_console, table
from gpuflow.common.errors import GpuflowError
from gpuflow.data.resident.tokens import ResidentTokens
from gpuflow.data.shards import Shard, write_shard
from gpuflow.data.tokens import TokenFolder
from gpuflow.device.accelerator import Device
from gpuflow.device.linkprobe import probe_link
from gpuflow.transfer.diskread import choose_io

MEMMAP = "memmap + .to()"
_SHARD_TOKENS = 100 << 20  # 200 MB of uint16 per generated shard, as prepared corpora have


@dataclass(frozen=True)
class IoBenchConfig:
    mib: int = 2048  # of generated shards, when no --data is given
    repeats: int = 3
    data: str = ""  # a prepared token folder: its train shards are read
    scratch: str = str(RESULTS_DIR)  # where generated shards are written (and removed)

    def __post_init__(self) -> None:
        if self.mib < 1 or self.repeats < 1:
            raise GpuflowError(f"--mib and --repeats must be >= 1, got {self.mib}, {self.repeats}")


def _generated_shards(folder: Path, mib: int) -> list[Shard]:
    tokens_left = (mib << 20) // 2
    rng = np.random.default_rng(0)
    shards = []
    while tokens_left > 0:
        n = min(_SHARD_TOKENS, tokens_left)
        path = folder / f"train_{len(shards):06d}.bin"
        write_shard(path, rng.integers(0, 50257, size=n, dtype=np.uint16))
        shards.append(Shard.open(path))
        tokens_left -= n
    return shards


def _memmap_to(shards: list[Shard], device: Device) -> list[torch.Tensor]:
    with warnings.catch_warnings():  # the map is read-only; .to() only reads it
        warnings.simplefilter("ignore", UserWarning)
        return [torch.from_numpy(np.asarray(s.tokens)).to(device.torch) for s in shards]


def _readers(shards: list[Shard], device: Device, vocab: int) -> dict[str, Callable[[], Any]]:
    """Each path as a function that builds the resident corpus and returns what holds it."""
    corpus_bytes = sum(s.n_tokens * s.dtype.itemsize for s in shards)

    def resident(io: str) -> Callable[[], ResidentTokens]:
        return lambda: ResidentTokens(
            shards, device, 1, 64, budget_bytes=corpus_bytes, vocab_size=vocab, io=io,
            show_progress=False,
        )  # fmt: skip

    auto = choose_io("auto", device)
    paths = {"pinned": resident("pinned"), "auto": resident(auto.path)}
    if auto.path == "kvikio":
        paths = {"kvikio": resident("kvikio"), **paths}
    return {**paths, MEMMAP: lambda: _memmap_to(shards, device)}


def _time_once(
    device: Device, build: Callable[[], Any], shards: list[Shard], cold: bool
) -> tuple[float, float | None, Any]:
    """Seconds to build, the cached share of the files before it, and what was built."""
    cached = None
    if cold:
        for shard in shards:
            drop_cached(shard.path)
        shares = [cached_fraction(s.path) for s in shards]
        cached = None if None in shares else statistics.fmean(shares)
    device.synchronize()
    started = time.perf_counter()
    built = build()
    device.synchronize()
    return time.perf_counter() - started, cached, built


def _corpus_of(built: Any) -> torch.Tensor:
    """The bytes a path put on the device, as one (n,) uint8 tensor to compare."""
    if isinstance(built, ResidentTokens):
        return built._active.view(torch.uint8)
    return torch.cat([t.view(torch.uint8) for t in built])


def check_io_device(device: Device) -> None:
    if device.type != "cuda":
        raise GpuflowError(f"bench io reads into CUDA memory; the device is {device}")


def run_io_bench(device: Device, config: IoBenchConfig) -> dict[str, Any]:
    check_io_device(device)
    scratch = None
    if config.data:
        shards = list(TokenFolder.open(config.data).train)
    else:
        scratch = Path(config.scratch) / f".io-shards-{uuid.uuid4().hex[:8]}"
        scratch.mkdir(parents=True)
    try:
        if scratch is not None:
            err_console.print(f"writing {config.mib} MiB of shards into {scratch} (removed after)")
            shards = _generated_shards(scratch, config.mib)
        return _measure(device, config, shards)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _measure(device: Device, config: IoBenchConfig, shards: list[Shard]) -> dict[str, Any]:
    corpus_bytes = sum(s.n_tokens * s.dtype.itemsize for s in shards)
    vocab = 1 << (8 * shards[0].dtype.itemsize)  # every id passes; the check still runs
    auto = choose_io("auto", device)
    reference: torch.Tensor | None = None
    rows = []
    for name, build in _readers(shards, device, vocab).items():
        row: dict[str, Any] = {"path": name}
        if name in ("kvikio", "auto") and auto.path == "kvikio":
            row["mode"] = auto.mode
        if name == "auto":
            row["takes"] = auto.path
        for temperature in ("cold", "warm"):
            cold = temperature == "cold"
            if not cold:
                _time_once(device, build, shards, cold=False)  # fills the page cache
            seconds, cached = [], []
            for _ in range(config.repeats):
                took, share, built = _time_once(device, build, shards, cold)
                seconds.append(took)
                cached.append(share)
                corpus = _corpus_of(built)
                if reference is None:
                    reference = corpus.clone()
                elif not torch.equal(corpus, reference):
                    raise GpuflowError(f"bench io: {name} put different bytes on the device")
                if isinstance(built, ResidentTokens):
                    built.close()
                del built, corpus
            row[temperature] = {
                "gb_per_s": corpus_bytes / statistics.median(seconds) / 1e9,
                "seconds": seconds,
                "cached_before": cached if cold else None,
            }
        err_console.print(
            f"  {name}: cold {row['cold']['gb_per_s']:.2f} GB/s, warm {row['warm']['gb_per_s']:.2f}"
        )
        rows.append(row)
    link = probe_link(device).get("h2d_pinned")
    best_other = {
        t: max(r[t]["gb_per_s"] for r in rows if r["path"] != "auto") for t in ("cold", "warm")
    }
    auto_row = next(r for r in rows if r["path"] == "auto")
    return {
        "corpus_bytes": corpus_bytes,
        "shards": len(shards),
        "data": config.data or None,  # None: generated shards
        "repeats": config.repeats,
        "auto": {"path": auto.path, "mode": auto.mode, "reason": auto.reason},
        "link_h2d_pinned_gb_per_s": link,
        "rows": rows,
        "auto_vs_best_other": {t: auto_row[t]["gb_per_s"] / best_other[t] for t in best_other},
        "identical_bytes": True,  # every path's corpus was compared with the first one's
    }


def print_io_table(results: dict[str, Any]) -> None:
    link = results["link_h2d_pinned_gb_per_s"]
    mib = results["corpus_bytes"] / (1 << 20)
    rows = table(
        "path", "cold GB/s", "cached before", "warm GB/s", "warm / link peak",
        title=f"{mib:,.0f} MiB of shards to device memory, median of {results['repeats']}",
    )  # fmt: skip
    for row in results["rows"]:
        label = row["path"] + (f" ({row['mode']})" if row.get("mode") else "")
        if row["path"] == "auto":
            label += f" -> {row['takes']}"
        cached = [c for c in row["cold"]["cached_before"] if c is not None]
        rows.add_row(
            label,
            f"{row['cold']['gb_per_s']:.2f}",
            f"{max(cached):.0%}" if cached else "unknown",
            f"{row['warm']['gb_per_s']:.2f}",
            f"{row['warm']['gb_per_s'] / link:.0%}" if link else "-",
        )
    out_console.print(rows)
    auto = results["auto"]
    ratio = results["auto_vs_best_other"]
    out_console.print(
        f"auto takes {auto['path']}: {auto['reason']}\n"
        f"auto against the best other path: cold {ratio['cold']:.2f}x, warm {ratio['warm']:.2f}x"
        + (f"; link peak (pinned h2d) {link:.1f} GB/s" if link else ""),
        markup=False,  # the reason may name "gpuflow[gds]"
    )
