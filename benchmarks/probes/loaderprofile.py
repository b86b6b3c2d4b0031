"""Probe: where DeviceLoader's host time goes at medium batch sizes (cProfile, no compute),
and the price of ``is_pinned()``. (Its first version also ran the image loop with a
DataLoader source read on a thread of the loader's own, since removed; that output is in
benchmarks/results/2026-11-24-probe-loaderprofile-h100.txt.)

PYTHONPATH=src python3 benchmarks/probes/loaderprofile.py
"""

import cProfile
import io
import itertools
import pstats
import time

import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

device = Device.resolve("cuda")
MB = 1 << 20
x = torch.randn(MB // 4).pin_memory()
started = time.perf_counter()
for _ in range(2000):
    x.is_pinned()
print(
    f"is_pinned() on a pinned 1 MiB tensor: {(time.perf_counter() - started) / 2000 * 1e6:.2f} us"
)

for nbytes, pinned in ((MB, True), (256 << 10, False), (MB, False)):
    tensors = [torch.randn(nbytes // 4) for _ in range(4)]
    if pinned:
        tensors = [t.pin_memory() for t in tensors]
    batches = list(itertools.islice(itertools.cycle(tensors), 2000))
    for _b in DeviceLoader(batches[:50], device):
        pass
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    started = time.perf_counter()
    profile.enable()
    for _b in DeviceLoader(batches, device):
        pass
    profile.disable()
    torch.cuda.synchronize()
    per_batch = (time.perf_counter() - started) / 2000 * 1e6
    kind = "pinned" if pinned else "pageable"
    print(f"==== {nbytes >> 10} KiB {kind}: {per_batch:.1f} us per batch (under cProfile)")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(14)
    print("\n".join(out.getvalue().splitlines()[6:24]))
