"""Probe: the image loop of ``gpuflow bench transfer`` fed four ways, and what a 4 MiB host
write into pinned memory costs by each copier.

1. Images/s at 3.1 MB and 25 MB batches, paths in alternating rounds: the idiom
   (``DataLoader(pin_memory=True)`` + ``.to()``); DeviceLoader over ``DataLoader(pin=False)``
   (its reader thread, ``ahead`` 3, 8 or 24); DeviceLoader over ``DataLoader(pin_memory=True)``
   (DataLoader's own pin thread, no reader thread).
2. A (1000, 1024) fp32 tensor written into a pinned buffer: torch ``copy_`` at the default
   thread count, at 1 and 4 threads, and one ``ctypes.memmove``; both after 1-100 ms idle.

PYTHONPATH=src python3 benchmarks/probes/feeds.py OUT.json
"""

import ctypes
import json
import os
import statistics
import sys
import time

import torch

import gpuflow.transfer.loader as loader_module
from gpuflow.bench.loaders import SyntheticImages, small_cnn, train_images
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.reader import ThreadedSource

device = Device.resolve("cuda")
dev = device.torch
results: dict = {
    "threads": torch.get_num_threads(),
    "cpu_count": os.cpu_count(),
    "affinity": len(os.sched_getaffinity(0)),
}
print(results)

# ---- 2. writes ---------------------------------------------------------------------------
src = torch.stack([torch.randn(1024) for _ in range(1000)])
dst = torch.empty(src.nbytes, dtype=torch.uint8).pin_memory()
view = dst.view(torch.float32).view(src.shape)


def ms(fn, n=30):
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


default = torch.get_num_threads()
writes = {}
for threads in (default, 4, 1):
    torch.set_num_threads(threads)
    writes[f"copy_ threads={threads}"] = ms(lambda: view.copy_(src))
torch.set_num_threads(default)
writes["memmove"] = ms(lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes))
writes["unbind 1000 (cuda)"] = ms(lambda: torch.empty(1000, 1024, device=dev).unbind(0))
writes["unbind 1000 (cpu)"] = ms(lambda: src.unbind(0))
for pause in (0.001, 0.01, 0.1):
    samples = []
    for _ in range(10):
        time.sleep(pause)
        t0 = time.perf_counter()
        view.copy_(src)
        samples.append((time.perf_counter() - t0) * 1e3)
    writes[f"copy_ after {pause * 1e3:g} ms idle"] = (statistics.median(samples), min(samples))
    samples = []
    for _ in range(10):
        time.sleep(pause)
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)
        samples.append((time.perf_counter() - t0) * 1e3)
    writes[f"memmove after {pause * 1e3:g} ms idle"] = (statistics.median(samples), min(samples))
for k, (med, low) in writes.items():
    print(f"write {k:24s} median {med:.3f} ms  min {low:.3f} ms")
results["writes_ms"] = writes

# ---- 1. image feeds ----------------------------------------------------------------------
model = small_cnn().to(dev).to(memory_format=torch.channels_last)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
steps, warmup, rounds = 60, 6, 5
original_source = loader_module.ThreadedSource


def reader_ahead(n):
    return lambda source, ahead, pin_for=None: ThreadedSource(source, ahead=n, pin_for=pin_for)


images = {}
for batch_size in (256, 2048):
    data = SyntheticImages(batch_size * (steps + warmup), 64)

    def source(pin, data=data, batch_size=batch_size):
        return torch.utils.data.DataLoader(
            data, batch_size=batch_size, num_workers=6, pin_memory=pin,
            persistent_workers=False, prefetch_factor=4,
        )  # fmt: skip

    def idiom(source=source):
        feed = ({k: v.to(dev, non_blocking=True) for k, v in b.items()} for b in source(True))
        return train_images(device, feed, model, optimizer, warmup)

    def ours(pin, ahead=None, source=source):
        loader_module.ThreadedSource = original_source if ahead is None else reader_ahead(ahead)
        try:
            with DeviceLoader(source(pin), device) as loader:
                return train_images(device, loader, model, optimizer, warmup)
        finally:
            loader_module.ThreadedSource = original_source

    paths = {
        "idiom": idiom,
        "ours-reader": lambda: ours(False),
        "ours-reader-ahead8": lambda: ours(False, 8),
        "ours-reader-ahead24": lambda: ours(False, 24),
        "ours-over-pinned-dataloader": lambda: ours(True),
    }
    rates: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, run in paths.items():
            seconds, count = run()
            rates[name].append(count / seconds)
    row = {name: statistics.median(r) for name, r in rates.items()}
    images[batch_size] = {"median": row, "rounds": rates}
    print(
        f"images B={batch_size}: "
        + " ".join(f"{name}={v:,.0f} ({v / row['idiom']:.2f}x)" for name, v in row.items())
    )
results["images"] = images

with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=1)
