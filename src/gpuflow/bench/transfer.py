"""``gpuflow bench transfer``: the transfer layer against plain PyTorch, in one run.

Sections, each beside its baseline:
- link peak: host->device and device->host from pinned memory at the largest size;
- memory kinds: pageable, freshly pinned (pinned for the copy, then freed) and pooled
  (``PinnedPool``) buffers, both directions, 4 KB to 256 MB, data starting in pageable
  memory where the kind needs a staging copy;
- small tensors: 1000 x 4 KB copied one by one versus ``pack`` + one copy + rebuild;
- payloads: the same values crossing as fp32, bf16 and uint8 (upcast on the device);
- streaming: ``DeviceLoader`` versus ``DataLoader(pin_memory=True)`` + ``.to(non_blocking)``
  on 64 MB float batches with a little compute each;
- memory: pinned and device memory after warm-up and after 10,000 loader iterations.

Longer than most modules: every table shares one ``TransferBench``'s buffers and one
result, and the tables' printing sits beside the measurements it reports.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gpuflow.bench.common import device_ms, gb_per_s, wall_ms
from gpuflow.common.console import err_console
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.packing import plan_pack, rebuild
from gpuflow.transfer.pinned import PinnedPool, release_cached_host_memory

KB, MB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class TransferBenchConfig:
    sizes: tuple[int, ...] = (4 * KB, 64 * KB, MB, 16 * MB, 256 * MB)
    small_tensors: int = 1000
    small_tensor_bytes: int = 4 * KB
    payload_bytes: int = 64 * MB  # of fp32
    stream_batch_bytes: int = 64 * MB
    stream_batches: int = 96
    flat_iterations: int = 10_000
    flat_batch_bytes: int = MB

    @classmethod
    def quick(cls) -> TransferBenchConfig:
        """Small sizes for a smoke run (and CI): same code, minutes become seconds."""
        return cls(
            sizes=(4 * KB, 64 * KB, MB),
            small_tensors=200,
            payload_bytes=MB,
            stream_batch_bytes=MB,
            stream_batches=12,
            flat_iterations=300,
            flat_batch_bytes=64 * KB,
        )


def _repeats(nbytes: int) -> int:
    return 30 if nbytes <= MB else 10 if nbytes <= 16 * MB else 4


class TransferBench:
    def __init__(self, device: Device, config: TransferBenchConfig) -> None:
        self.device = device
        self.config = config
        self.pool = PinnedPool(device, max_bytes=4 * max(config.sizes))

    def close(self) -> None:
        self.pool.close()

    # ---- link peak --------------------------------------------------------------------------

    def peak(self) -> dict[str, float]:
        """Pinned-to-device and device-to-pinned rates at the largest size: the reference."""
        n = max(self.config.sizes)
        pinned = self.device.pinned_empty(n)
        pinned.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        on_device = torch.empty(n, dtype=torch.uint8, device=self.device.torch)
        h2d = device_ms(self.device, lambda: on_device.copy_(pinned, non_blocking=True), 10)
        d2h = device_ms(self.device, lambda: pinned.copy_(on_device, non_blocking=True), 10)
        return {"bytes": n, "h2d_gb_s": gb_per_s(n, h2d), "d2h_gb_s": gb_per_s(n, d2h)}

    # ---- memory kinds -----------------------------------------------------------------------

    def memory_kinds(self) -> list[dict[str, Any]]:
        rows = []
        for n in self.config.sizes:
            source = torch.randint(0, 256, (n,), dtype=torch.uint8)  # pageable
            on_device = torch.randint(0, 256, (n,), dtype=torch.uint8, device=self.device.torch)
            target = torch.empty(n, dtype=torch.uint8)  # pageable
            for direction, kinds in (
                ("h2d", self._h2d_kinds(source, on_device)),
                ("d2h", self._d2h_kinds(on_device, target)),
            ):
                for kind, fn in kinds.items():
                    ms = wall_ms(self.device, fn, _repeats(n))
                    rows.append(
                        {
                            "direction": direction,
                            "memory": kind,
                            "bytes": n,
                            "ms": ms,
                            "gb_s": gb_per_s(n, ms),
                        }
                    )
        return rows

    def _h2d_kinds(self, source: torch.Tensor, on_device: torch.Tensor) -> dict[str, Callable]:
        device, pool = self.device, self.pool

        def pageable() -> None:
            on_device.copy_(source)

        def fresh_pinned() -> None:
            release_cached_host_memory(device)  # so the next pin is really fresh
            staging = device.pinned_empty(source.numel())
            staging.copy_(source)
            on_device.copy_(staging, non_blocking=True)
            device.synchronize()  # the staging buffer must outlive its copy

        def pooled() -> None:
            buffer = pool.acquire(source.numel())
            staging = buffer.bytes[: source.numel()]
            staging.copy_(source)
            on_device.copy_(staging, non_blocking=True)
            done = device.new_event()
            done.record()
            pool.release(buffer, after=done)

        return {"pageable": pageable, "fresh_pinned": fresh_pinned, "pooled": pooled}

    def _d2h_kinds(self, on_device: torch.Tensor, target: torch.Tensor) -> dict[str, Callable]:
        device, pool = self.device, self.pool

        def pageable() -> None:
            target.copy_(on_device)

        def fresh_pinned() -> None:
            release_cached_host_memory(device)  # so the next pin is really fresh
            landing = device.pinned_empty(on_device.numel())
            landing.copy_(on_device, non_blocking=True)
            device.synchronize()

        def pooled() -> None:
            buffer = pool.acquire(on_device.numel())
            buffer.bytes[: on_device.numel()].copy_(on_device, non_blocking=True)
            done = device.new_event()
            done.record()
            done.synchronize()  # the host reads what landed
            pool.release(buffer)

        return {"pageable": pageable, "fresh_pinned": fresh_pinned, "pooled": pooled}

    # ---- many small tensors ---------------------------------------------------------------

    def small_tensors(self) -> dict[str, Any]:
        count, nbytes = self.config.small_tensors, self.config.small_tensor_bytes
        tensors = [torch.randn(nbytes // 4) for _ in range(count)]
        pinned = (
            [t.pin_memory() for t in tensors] if self.device.supports_pinned_memory else tensors
        )
        device, pool = self.device, self.pool

        def one_by_one(source: list[torch.Tensor]) -> Callable[[], object]:
            return lambda: [t.to(device.torch, non_blocking=True) for t in source]

        def packed() -> Any:
            plan = plan_pack(tensors)
            buffer = pool.acquire(plan.nbytes)
            plan.write_into(buffer.bytes)
            on_device = buffer.bytes[: plan.nbytes].to(device.torch, non_blocking=True)
            done = device.new_event()
            done.record()
            pool.release(buffer, after=done)
            return rebuild(on_device, plan.spec)

        check = packed()
        device.synchronize()
        assert all(torch.equal(a.cpu(), b) for a, b in zip(check, tensors, strict=True))
        separate_pageable = wall_ms(device, one_by_one(tensors), 10)
        separate_pinned = wall_ms(device, one_by_one(pinned), 10)
        packed_ms = wall_ms(device, packed, 10)
        return {
            "tensors": count,
            "bytes_each": nbytes,
            "separate_pageable_ms": separate_pageable,
            "separate_pinned_ms": separate_pinned,
            "packed_ms": packed_ms,
            "speedup_vs_pageable": separate_pageable / packed_ms,
            "speedup_vs_pinned": separate_pinned / packed_ms,
        }

    # ---- payload codecs -----------------------------------------------------------------------

    def payloads(self) -> list[dict[str, Any]]:
        n = self.config.payload_bytes // 4  # fp32 values
        values = torch.rand(n) * 255
        rows = []
        for name, wire in (
            ("fp32", torch.float32),
            ("bf16", torch.bfloat16),
            ("uint8", torch.uint8),
        ):
            host = values.to(wire)
            if self.device.supports_pinned_memory:
                host = host.pin_memory()
            landing = torch.empty(n, dtype=wire, device=self.device.torch)

            def cross(host: torch.Tensor = host, landing: torch.Tensor = landing) -> None:
                landing.copy_(host, non_blocking=True)
                if landing.dtype != torch.float32:
                    landing.float()  # the upcast on the device is part of the cost

            ms = device_ms(self.device, cross, 10)
            convert_ms = wall_ms(self.device, lambda wire=wire: values.to(wire), 3, warmup=1)
            rows.append(
                {
                    "payload": name,
                    "wire_bytes": host.nbytes,
                    "logical_bytes": 4 * n,
                    "ms": ms,
                    "effective_gb_s": gb_per_s(4 * n, ms),
                    "host_convert_ms": convert_ms if wire != torch.float32 else 0.0,
                }
            )
        base = rows[0]["effective_gb_s"]
        for row in rows:
            row["vs_fp32"] = row["effective_gb_s"] / base if base else 0.0
        return rows

    # ---- streaming --------------------------------------------------------------------------

    def streaming(self) -> dict[str, Any]:
        """Both loaders on the same batches, from pageable and from pinned source memory
        (the DataLoader's pin_memory leaves already pinned tensors as they are)."""
        cfg, device = self.config, self.device
        distinct = [torch.randn(cfg.stream_batch_bytes // 4) for _ in range(4)]
        sources = {"pageable": distinct}
        if device.supports_pinned_memory:
            sources["pinned"] = [t.pin_memory() for t in distinct]
        out: dict[str, Any] = {
            "batch_bytes": cfg.stream_batch_bytes,
            "batches_timed": cfg.stream_batches,
        }
        for kind, tensors in sources.items():
            out[kind] = self._stream(tensors)
        return out

    def _stream(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """Each loader over the same batches, in alternating rounds; the median round counts.
        The rate is the steady state: device events on
        the consumer's stream from the start of batch ``warm`` to the end of the last one,
        with no host sync in between (a sync would drain the prefetched batches and count
        them as free). Start-up (thread, first pinning, first batch) is timed apart, from
        construction to batch ``warm``, with torch's pinned-block cache emptied before each
        run so that both loaders pin their memory afresh, as a new process does."""
        cfg, device = self.config, self.device
        warm = min(8, cfg.stream_batches // 4)

        def batches(n: int) -> Any:
            return itertools.islice(itertools.cycle(tensors), n)

        def consume(loader: Iterable[torch.Tensor]) -> tuple[float, float]:
            """(start-up ms on the host, steady-state ms on the device)."""
            started = time.perf_counter()
            acc = torch.zeros((), device=device.torch)
            first, last = device.new_event(timing=True), device.new_event(timing=True)
            startup_ms = 0.0
            for i, batch in enumerate(loader):
                if i == warm:
                    startup_ms = (time.perf_counter() - started) * 1e3
                    first.record(device.current_stream())
                acc += batch.sum()  # a little work per batch: one read of it
            last.record(device.current_stream())
            last.synchronize()
            return startup_ms, first.elapsed_time(last)

        def dataloader(n: int) -> tuple[float, float]:
            loader = torch.utils.data.DataLoader(
                list(batches(n)),
                batch_size=None,
                num_workers=0,
                pin_memory=device.supports_pinned_memory,
            )
            return consume(b.to(device.torch, non_blocking=True) for b in loader)

        last: list[DeviceLoader] = []

        def deviceloader(n: int) -> tuple[float, float]:
            with DeviceLoader(batches(n), device) as loader:
                timed = consume(loader)
            last[:] = [loader]
            return timed

        n, rounds = cfg.stream_batches, 5
        steady_bytes = (n - warm) * cfg.stream_batch_bytes
        loaders = {"dataloader": dataloader, "deviceloader": deviceloader}
        for run in loaders.values():
            run(2 * warm)  # untimed: kernels, allocator and threads warmed up
        # Rounds alternate the two loaders: the host's copy speed drifts within a process
        # (benchmarks/NOTES.md), and back-to-back runs of one loader would take the drift
        # for a difference between them.
        timings: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
        for _ in range(rounds):
            for name, run in loaders.items():
                release_cached_host_memory(device)
                device.synchronize()
                timings[name].append(run(n))
        out: dict[str, Any] = {}
        for name, runs in timings.items():
            out[f"{name}_startup_ms"] = statistics.median(t[0] for t in runs)
            out[f"{name}_gb_s"] = gb_per_s(steady_bytes, statistics.median(t[1] for t in runs))
            out[f"{name}_gb_s_per_round"] = [gb_per_s(steady_bytes, t[1]) for t in runs]
        stats = last[0].stats
        return {
            **out,
            "batches_warmup": warm,
            "speedup": out["deviceloader_gb_s"] / out["dataloader_gb_s"],
            "deviceloader_stats": {
                "stall_s": stats.stall_s,
                "transfer_ms": stats.transfer_ms,
                "exposed_ms": stats.exposed_ms,
                "compute_ms": stats.compute_ms,
                "overlap_efficiency": stats.overlap_efficiency,
                "link_gb_s_during_copies": stats.link_gb_per_s,
            },
        }

    # ---- flat memory ------------------------------------------------------------------------

    def flat_memory(self) -> dict[str, Any]:
        cfg, device = self.config, self.device
        batch = torch.randn(cfg.flat_batch_bytes // 4)
        samples = {}
        with DeviceLoader(itertools.repeat(batch, cfg.flat_iterations), device) as loader:
            for i, on_device in enumerate(loader, start=1):
                on_device.sum()
                if i in (100, cfg.flat_iterations):
                    device.synchronize()
                    samples[i] = _memory_sample(device, loader)
        first, last = samples[100], samples[cfg.flat_iterations]
        return {
            "iterations": cfg.flat_iterations,
            "after_100": first,
            f"after_{cfg.flat_iterations}": last,
            "flat": first == last,
        }


def _memory_sample(device: Device, loader: DeviceLoader) -> dict[str, int]:
    sample = {"pinned_pool_bytes": loader.pool_stats.bytes_reserved}
    if device.type == "cuda":
        sample["device_allocated_bytes"] = torch.cuda.memory_allocated(device.torch)
        sample["device_reserved_bytes"] = torch.cuda.memory_reserved(device.torch)
        # Cumulative cudaMalloc calls: flat means the run allocated nothing new.
        stats = torch.cuda.memory_stats(device.torch)
        sample["cudamalloc_calls"] = stats.get("segment.all.allocated", 0)
    return sample


# ---- the run, its targets and its tables ------------------------------------------------------


def run_transfer_bench(device: Device, config: TransferBenchConfig) -> dict[str, Any]:
    """Every section, measured in this process on ``device``; see the module docstring."""
    bench = TransferBench(device, config)
    sections: dict[str, Callable[[], Any]] = {
        "peak": bench.peak,
        "memory_kinds": bench.memory_kinds,
        "small_tensors": bench.small_tensors,
        "payloads": bench.payloads,
        "streaming": bench.streaming,
        "flat_memory": bench.flat_memory,
    }
    results: dict[str, Any] = {"config": dataclasses.asdict(config)}
    try:
        for name, measure in sections.items():
            with err_console.status(f"measuring {name.replace('_', ' ')}..."):
                results[name] = measure()
    finally:
        bench.close()
    results["targets"] = _targets(results)
    return results


def _targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    peak = r["peak"]["h2d_gb_s"]
    payload = {row["payload"]: row for row in r["payloads"]}
    small = r["small_tensors"]
    targets = []
    for kind in ("pageable", "pinned"):
        stream = r["streaming"].get(kind)
        if stream is None:
            continue
        targets += [
            {
                "target": f"DeviceLoader >= 95% of pinned H2D peak ({kind} source)",
                "value": stream["deviceloader_gb_s"] / peak if peak else 0.0,
                "goal": 0.95,
            },
            {
                "target": f"DeviceLoader beats DataLoader(pin_memory=True) ({kind} source)",
                "value": stream["speedup"],
                "goal": 1.0,
            },
        ]
    return [
        *targets,
        {
            "target": "packed small tensors >= 20x separate copies (pageable)",
            "value": small["speedup_vs_pageable"],
            "goal": 20.0,
        },
        {
            "target": "bf16 payload >= 1.8x fp32 effective rate",
            "value": payload["bf16"]["vs_fp32"],
            "goal": 1.8,
        },
        {
            "target": "pinned and device memory flat over the loader run",
            "value": float(r["flat_memory"]["flat"]),
            "goal": 1.0,
        },
    ]


def print_transfer_tables(r: dict[str, Any]) -> None:
    from gpuflow.common.console import out_console, table

    peak = r["peak"]["h2d_gb_s"]

    def of_peak(rate: float) -> str:
        return f"{rate:.2f} ({rate / peak:.0%})" if peak else f"{rate:.2f}"

    out_console.print(
        f"pinned peak at {r['peak']['bytes'] >> 20} MiB: host->device "
        f"{peak:.1f} GB/s, device->host {r['peak']['d2h_gb_s']:.1f} GB/s"
    )
    grid = table(
        "size",
        *(f"{d} {m}" for d in ("h2d", "d2h") for m in ("pageable", "fresh pinned", "pooled")),
        title="GB/s by memory kind (fraction of the pinned h2d peak)",
    )
    sizes = sorted({row["bytes"] for row in r["memory_kinds"]})
    lookup = {(row["direction"], row["memory"], row["bytes"]): row for row in r["memory_kinds"]}
    for n in sizes:
        cells = [
            of_peak(lookup[(d, m, n)]["gb_s"])
            for d in ("h2d", "d2h")
            for m in ("pageable", "fresh_pinned", "pooled")
        ]
        grid.add_row(_size(n), *cells)
    out_console.print(grid)

    s = r["small_tensors"]
    grid = table(
        "path",
        "ms",
        "speedup of packed",
        title=(f"{s['tensors']} tensors of {_size(s['bytes_each'])} to the device"),
    )
    grid.add_row(
        "one by one, pageable",
        f"{s['separate_pageable_ms']:.3f}",
        f"{s['speedup_vs_pageable']:.1f}x",
    )
    grid.add_row(
        "one by one, pinned", f"{s['separate_pinned_ms']:.3f}", f"{s['speedup_vs_pinned']:.1f}x"
    )
    grid.add_row("packed: plan + pack + 1 copy + rebuild", f"{s['packed_ms']:.3f}", "")
    out_console.print(grid)

    grid = table(
        "payload",
        "wire bytes",
        "ms",
        "effective GB/s",
        "vs fp32",
        "host convert ms",
        title="the same values as fp32, bf16 and uint8 (upcast on the device included)",
    )
    for row in r["payloads"]:
        grid.add_row(
            row["payload"],
            _size(row["wire_bytes"]),
            f"{row['ms']:.3f}",
            of_peak(row["effective_gb_s"]),
            f"{row['vs_fp32']:.2f}x",
            f"{row['host_convert_ms']:.1f}",
        )
    out_console.print(grid)

    st = r["streaming"]
    grid = table(
        "source memory",
        "DataLoader(pin_memory=True) + .to",
        "DeviceLoader",
        "speedup",
        "start-up ms DataLoader / ours",
        "copies ran at",
        title=(
            f"{st['batches_timed']} batches of {_size(st['batch_bytes'])}, a little compute "
            "each: steady-state GB/s (fraction of the pinned h2d peak)"
        ),
    )
    for kind in ("pageable", "pinned"):
        if kind not in st:
            continue
        row, ds = st[kind], st[kind]["deviceloader_stats"]
        grid.add_row(
            kind,
            of_peak(row["dataloader_gb_s"]),
            of_peak(row["deviceloader_gb_s"]),
            f"{row['speedup']:.2f}x",
            f"{row['dataloader_startup_ms']:.1f} / {row['deviceloader_startup_ms']:.1f}",
            f"{ds['link_gb_s_during_copies']:.1f} GB/s",
        )
    out_console.print(grid)
    fm = r["flat_memory"]
    out_console.print(
        f"memory after 100 and {fm['iterations']} loader iterations: "
        f"{'flat' if fm['flat'] else 'GREW'} ({fm['after_100']})"
    )
    grid = table("target", "measured", "goal", "met", title="targets")
    for t in r["targets"]:
        met = t["value"] >= t["goal"]
        grid.add_row(
            t["target"],
            f"{t['value']:.3g}",
            f"{t['goal']:.3g}",
            "yes" if met else "[bold red]no[/]",
        )
    out_console.print(grid)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MB), ("KiB", KB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"
