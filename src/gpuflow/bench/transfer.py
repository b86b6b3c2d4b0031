"""``gpuflow bench transfer``: the transfer layer against plain PyTorch, measured in one run.

Sections, each beside its baseline: link peak, memory kinds (pageable, freshly pinned,
pooled), small tensors (one by one against ``pack``), payloads (fp32, bf16, uint8), loaders
(``gpuflow.bench.loaders``) and memory over many loader iterations and epochs. What each
section runs: docs/architecture/benches.md (gpuflow bench transfer). The goals the results
are held to: ``gpuflow.bench.transfer_targets``; their tables: ``gpuflow.bench.transfer_tables``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuflow.bench.loaders import LoaderBenchConfig, cases, image_loop, sweep, text_loop
from gpuflow.bench.results import device_ms, gb_per_s, wall_ms
from gpuflow.bench.transfer_tables import KB, MB, SECTIONS
from gpuflow.bench.transfer_targets import targets
from gpuflow.common.console import err_console
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.packing import plan_pack, rebuild
from gpuflow.transfer.pinned import PinnedPool, release_cached_host_memory


@dataclass(frozen=True)
class TransferBenchConfig:
    sizes: tuple[int, ...] = (4 * KB, 64 * KB, MB, 16 * MB, 256 * MB)
    small_tensors: int = 1000
    small_tensor_bytes: int = 4 * KB
    payload_bytes: int = 64 * MB  # of fp32
    flat_iterations: int = 10_000
    flat_epochs: int = 20
    flat_batch_bytes: int = MB
    loaders: LoaderBenchConfig = field(default_factory=LoaderBenchConfig)

    @classmethod
    def quick(cls) -> TransferBenchConfig:
        """Small sizes for a smoke run (and CI): same code, minutes become seconds."""
        return cls(
            sizes=(4 * KB, 64 * KB, MB),
            small_tensors=200,
            payload_bytes=MB,
            flat_iterations=300,
            flat_epochs=3,
            flat_batch_bytes=64 * KB,
            loaders=LoaderBenchConfig.quick(),
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

        def one_copy(batch: Any) -> Any:
            """``batch`` packed into a pooled pinned buffer, one copy, rebuilt on the device."""
            plan = plan_pack(batch)
            buffer = pool.acquire(plan.nbytes)
            plan.write_into(buffer.bytes)
            on_device = buffer.bytes[: plan.nbytes].to(device.torch, non_blocking=True)
            done = device.new_event()
            done.record()
            pool.release(buffer, after=done)
            return rebuild(on_device, plan.spec)

        stacked = torch.stack(tensors)  # the same values as they come in bulk: (count, n)

        def packed() -> Any:
            return one_copy(tensors)

        def bulk() -> Any:
            return one_copy(stacked)  # (count, n): a view of the copy; each row a view of it

        def bulk_unbound() -> Any:
            # count tensor objects (views), each made by torch in host time of its own
            return bulk().unbind(0)

        for check in (packed(), bulk(), bulk_unbound()):
            device.synchronize()
            assert all(torch.equal(a.cpu(), b) for a, b in zip(check, tensors, strict=True))
        separate_pageable = wall_ms(device, one_by_one(tensors), 10)
        separate_pinned = wall_ms(device, one_by_one(pinned), 10)
        packed_ms = wall_ms(device, packed, 10)
        bulk_ms = wall_ms(device, bulk, 10)
        unbound_ms = wall_ms(device, bulk_unbound, 10)
        return {
            "tensors": count,
            "bytes_each": nbytes,
            "separate_pageable_ms": separate_pageable,
            "separate_pinned_ms": separate_pinned,
            "packed_ms": packed_ms,
            "bulk_ms": bulk_ms,
            "speedup_vs_pageable": separate_pageable / packed_ms,
            "speedup_vs_pinned": separate_pinned / packed_ms,
            "bulk_speedup_vs_pageable": separate_pageable / bulk_ms,
            "bulk_speedup_vs_pinned": separate_pinned / bulk_ms,
            "bulk_unbound_ms": unbound_ms,
            "bulk_unbound_speedup_vs_pageable": separate_pageable / unbound_ms,
            "bulk_unbound_speedup_vs_pinned": separate_pinned / unbound_ms,
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

    # ---- loaders ----------------------------------------------------------------------------

    def loader_sweep(self) -> list[dict[str, Any]]:
        return sweep(self.device, self.config.loaders)

    def loader_cases(self) -> list[dict[str, Any]]:
        return cases(self.device, self.config.loaders)

    def image_loop(self) -> list[dict[str, Any]]:
        return image_loop(self.device, self.config.loaders)

    def text_loop(self) -> dict[str, Any]:
        return text_loop(self.device, self.config.loaders)

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
        batches = [torch.randn(cfg.flat_batch_bytes // 4) for _ in range(50)]
        by_epoch = {}
        with DeviceLoader(batches, device) as loader:
            for epoch in range(1, cfg.flat_epochs + 1):
                for on_device in loader:
                    on_device.sum()
                if epoch in (2, cfg.flat_epochs):
                    device.synchronize()
                    by_epoch[epoch] = _memory_sample(device, loader)
        return {
            "iterations": cfg.flat_iterations,
            "after_100": first,
            f"after_{cfg.flat_iterations}": last,
            "epochs": cfg.flat_epochs,
            "after_epoch_2": by_epoch[2],
            f"after_epoch_{cfg.flat_epochs}": by_epoch[cfg.flat_epochs],
            "flat": _same_footprint(first, last)
            and _same_footprint(by_epoch[2], by_epoch[cfg.flat_epochs]),
        }


def _same_footprint(*samples: dict[str, int]) -> bool:
    """Equal pinned and reserved bytes and no new cudaMalloc: the memory a run holds. Bytes
    allocated at a sample also count the batches in flight then, which vary with the
    position in the source, so they are reported but not compared."""
    keys = ("pinned_pool_bytes", "device_reserved_bytes", "cudamalloc_calls")
    return all({k: s.get(k) for k in keys} == {k: samples[0].get(k) for k in keys} for s in samples)


def _memory_sample(device: Device, loader: DeviceLoader) -> dict[str, int]:
    sample = {"pinned_pool_bytes": loader.pool_stats.bytes_reserved}
    if device.type == "cuda":
        sample["device_allocated_bytes"] = torch.cuda.memory_allocated(device.torch)
        sample["device_reserved_bytes"] = torch.cuda.memory_reserved(device.torch)
        # Cumulative cudaMalloc calls: flat means the run allocated nothing new.
        stats = torch.cuda.memory_stats(device.torch)
        sample["cudamalloc_calls"] = stats.get("segment.all.allocated", 0)
    return sample


# ---- the run ------------------------------------------------------------------------------------


def run_transfer_bench(
    device: Device, config: TransferBenchConfig, sections: tuple[str, ...] = SECTIONS
) -> dict[str, Any]:
    """The ``sections`` (every one by default), measured in this process on ``device``; see
    the module docstring."""
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown sections {unknown}; the sections are {', '.join(SECTIONS)}")
    bench = TransferBench(device, config)
    results: dict[str, Any] = {"config": dataclasses.asdict(config)}
    try:
        for name in SECTIONS:
            if name in sections:
                with err_console.status(f"measuring {name.replace('_', ' ')}..."):
                    results[name] = getattr(bench, name)()
    finally:
        bench.close()
    results["targets"] = targets(results)
    return results
