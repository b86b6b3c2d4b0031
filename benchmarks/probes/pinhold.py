"""Probe: what pin_memory() of a pageable tensor costs when the caller holds K pinned results
alive at once (the loader keeps each until its copy has run), and whether torch's pinned
cache allocates anew (torch.cuda.host_memory_stats). Also DeviceLoader at 64 MiB pageable
with its host stats.

PYTHONPATH=src python3 benchmarks/probes/pinhold.py
"""

import collections
import time

import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

MB = 1 << 20
dev = Device.resolve("cuda")


def host_allocs():
    stats = torch.cuda.host_memory_stats()
    return {
        k: stats.get(k)
        for k in (
            "num_host_alloc",
            "num_host_free",
            "allocated_bytes.current",
            "reserved_bytes.current",
        )
        if k in stats
    } or stats


for size in (16 * MB, 64 * MB):
    sources = [torch.randn(size // 4) for _ in range(4)]
    for hold in (1, 3, 7):
        held = collections.deque()
        times = []
        before = host_allocs()
        for i in range(40):
            t0 = time.perf_counter()
            p = sources[i % 4].pin_memory()
            times.append(time.perf_counter() - t0)
            held.append(p)
            while len(held) > hold:
                held.popleft()
        held.clear()
        times.sort()
        print(
            f"{size // MB} MiB hold {hold}: pin_memory median {times[20] * 1e3:.2f} ms, "
            f"max {times[-1] * 1e3:.2f} ms; host stats before {before} after {host_allocs()}"
        )

for size in (16 * MB, 64 * MB):
    batches = [torch.randn(size // 4) for _ in range(4)] * 8
    for rnd in range(3):
        acc = torch.zeros((), device=dev.torch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with DeviceLoader(batches, dev) as loader:
            for b in loader:
                acc += b.sum()
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        print(
            f"DeviceLoader {size // MB} MiB pageable round {rnd}: "
            f"{len(batches) * size / s / 1e9:.1f} GB/s, source_s "
            f"{loader.stats.source_s * 1e3:.1f} ms stall_s {loader.stats.stall_s * 1e3:.1f} ms; "
            f"host {host_allocs()}"
        )
    t0 = time.perf_counter()
    acc = torch.zeros((), device=dev.torch)
    for b in batches:
        acc += b.pin_memory().to(dev.torch, non_blocking=True).sum()
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    print(
        f"pin_to {size // MB} MiB: {len(batches) * size / s / 1e9:.1f} GB/s; host {host_allocs()}"
    )
