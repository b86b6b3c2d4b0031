"""Probe: host microseconds per batch of the image loop's batch (256 3x64x64 uint8 images
and int64 labels, pinned, as DataLoader's pin thread hands them over) with no model: the
idiom ``{k: v.to(non_blocking=True)}``, DeviceLoader (``fresh_batches=True``), and the
consumer alone (one small op per batch); seven alternating rounds of 600 batches, medians;
then a cProfile of DeviceLoader's loop. Cited by docs/decisions/039.

PYTHONPATH=src OUT=DIR python3 benchmarks/probes/imagefeedalone.py   (writes DIR/imagefeed.txt)
"""

import cProfile
import io
import os
import pstats
import statistics
import time

import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

dev = Device.resolve("cuda")
out = os.environ.get("OUT", ".")
lines = []


def say(*a):
    lines.append(" ".join(map(str, a)))
    print(*a, flush=True)
    with open(f"{out}/imagefeed.txt", "w") as report:
        report.write("\n".join(lines) + "\n")


N = 600
bank = [
    {
        "image": torch.randint(0, 255, (256, 3, 64, 64), dtype=torch.uint8).pin_memory(),
        "label": torch.arange(256).pin_memory(),
    }
    for _ in range(8)
]
batches = [bank[i % 8] for i in range(N)]
placed = {
    "image": torch.zeros(1, 1, 1, 1, dtype=torch.uint8, device="cuda"),
    "label": torch.zeros(1, device="cuda"),
}


def consume(feed):
    acc = torch.zeros((), device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for b in feed:
        acc += b["image"][0, 0, 0, 0]
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / N * 1e6


feeds = {
    "idiom": lambda: ({k: v.to("cuda", non_blocking=True) for k, v in b.items()} for b in batches),
    "ours": lambda: DeviceLoader(batches, dev, fresh_batches=True),
    "alone": lambda: (placed for _ in batches),
}
for f in feeds.values():
    consume(f())
runs = {k: [] for k in feeds}
for r in range(7):
    for k, f in list(feeds.items())[:: 1 if r % 2 == 0 else -1]:
        runs[k].append(consume(f()))
for k, v in runs.items():
    say(f"image feed {k}: median {statistics.median(v):.1f} us/batch {[round(x, 1) for x in v]}")
p = cProfile.Profile()
p.enable()
consume(feeds["ours"]())
p.disable()
s = io.StringIO()
pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(40)
say(s.getvalue())
s = io.StringIO()
pstats.Stats(p, stream=s).sort_stats("cumtime").print_stats(30)
say(s.getvalue())
