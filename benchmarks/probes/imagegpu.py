"""Probe: whether the image loop at 3.1 MB batches (``gpuflow bench transfer``'s: a
``DataLoader`` with 6 workers, the small CNN, 256 3x64x64 uint8 images) waits on the device
or on the host. Images per second over five alternating rounds, then, under
``torch.profiler``, the wall time and the device time per step, for: the idiom
(``DataLoader(pin_memory=True)`` + ``.to()``), its copies on a side stream (the consumer's
stream waiting on an event, or the host waiting on the copy), DeviceLoader, and one batch
kept on the device (no feed). Cited by docs/decisions/042.

PYTHONPATH=src OUT=DIR python3 benchmarks/probes/imagegpu.py   (writes DIR/imagegpu.txt)
"""

import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gpuflow.bench.loaders import SyntheticImages, image_step, small_cnn, train_images
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

dev = Device.resolve("cuda")
model = small_cnn().cuda().to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
B = 256
data = SyntheticImages(B * 300, 64)
out = os.environ.get("OUT", ".")
lines = []


def say(*parts):
    lines.append(" ".join(map(str, parts)))
    print(*parts, flush=True)
    with open(f"{out}/imagegpu.txt", "w") as report:
        report.write("\n".join(lines) + "\n")


def source(pin):
    return torch.utils.data.DataLoader(
        data, batch_size=B, num_workers=6, pin_memory=pin, prefetch_factor=4
    )


def idiom():
    return ({k: v.to("cuda", non_blocking=True) for k, v in b.items()} for b in source(True))


def side_stream(host_waits):
    copies = torch.cuda.Stream()
    for b in source(True):
        with torch.cuda.stream(copies):
            placed = {k: v.to("cuda", non_blocking=True) for k, v in b.items()}
        if host_waits:
            copies.synchronize()
        else:
            torch.cuda.current_stream().wait_stream(copies)
            for v in placed.values():
                v.record_stream(torch.cuda.current_stream())
        yield placed


def resident():
    batch = {k: v.cuda() for k, v in next(iter(source(True))).items()}
    return (batch for _ in range(300))


feeds = {
    "idiom": idiom,
    "side": lambda: side_stream(False),
    "side_hostsync": lambda: side_stream(True),
    "ours": lambda: DeviceLoader(source(False), dev),
    "resident": resident,
}


def step(batch):
    image_step(dev, model, opt, batch)


for make in feeds.values():  # warm-up
    train_images(dev, make(), model, opt, 5)
rates = {name: [] for name in feeds}
for r in range(5):
    for name, make in list(feeds.items())[:: 1 if r % 2 == 0 else -1]:
        seconds, images = train_images(dev, make(), model, opt, 30)
        rates[name].append(images / seconds)
for name, per_round in rates.items():
    say(f"{name}: median {statistics.median(per_round):.0f} img/s {[round(x) for x in per_round]}")

for name, make in feeds.items():
    feed = iter(make())
    for _ in range(30):
        step(next(feed))
    torch.cuda.synchronize()
    n = 100
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(n):
            step(next(feed))
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    device_us = sum(
        e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    say(f"== {name}: wall {wall / n * 1e3:.3f} ms/step (profiled), "
        f"device time {device_us / n / 1e3:.3f} ms/step")  # fmt: skip
    say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
