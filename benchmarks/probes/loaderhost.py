"""Probe: a DeviceLoader's host time per batch on the GPU machine, by function (cProfile),
beside the price of the torch calls it is made of.

PYTHONPATH=src python3 benchmarks/probes/loaderhost.py
"""

import cProfile
import ctypes
import io
import itertools
import pstats
import time

import torch

from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.packing import plan_pack

dev = torch.device("cuda")


def per_call_us(fn, n=2000):
    fn()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


x = torch.randn(2048)
pinned = x.pin_memory()
on_dev = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
host = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
ev = torch.cuda.Event()
stream = torch.cuda.Stream()
prims = {
    "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
    "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
    "torch.empty 8 KiB cuda": lambda: torch.empty(8192, dtype=torch.uint8, device=dev),
    "slice+view+view cuda": lambda: on_dev[0:8192].view(torch.float32).view((2048,)),
    "plan_pack 1 tensor": lambda: plan_pack(x, direct=True),
    "memmove 8 KiB": lambda: ctypes.memmove(host.data_ptr(), x.data_ptr(), 8192),
    "copy_ 8 KiB host": lambda: host[:8192].view(torch.float32).copy_(x),
    "x.to(dev, nb) pinned": lambda: pinned.to(dev, non_blocking=True),
    "x.pin_memory()": lambda: x.pin_memory(),
    "event record": lambda: ev.record(),
    "stream.wait_event": lambda: stream.wait_event(ev),
    "with torch.cuda.stream(s)": lambda: torch.cuda.stream(stream).__enter__(),
    "torch.cuda.Event()": lambda: torch.cuda.Event(),
}
for name, fn in prims.items():
    print(f"{name:32s} {per_call_us(fn):7.2f} us", flush=True)
torch.cuda.set_stream(torch.cuda.default_stream())

CASES = ((8 << 10, "pageable"), (8 << 10, "pinned"), (1 << 20, "pageable"), (4 << 20, "pinned"))
for nbytes, kind in CASES:
    distinct = [torch.randn(nbytes // 4) for _ in range(4)]
    if kind == "pinned":
        distinct = [t.pin_memory() for t in distinct]
    n = 2000 if nbytes < 1 << 20 else 300
    batches = list(itertools.islice(itertools.cycle(distinct), n))

    def run(batches=batches):
        with DeviceLoader(batches, dev) as loader:
            for _ in loader:
                pass
        torch.cuda.synchronize()

    run()
    started = time.perf_counter()
    run()
    us = (time.perf_counter() - started) / n * 1e6
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(14)
    print(f"==== {nbytes >> 10} KiB {kind}: {us:.1f} us per batch (no compute)")
    print("\n".join(out.getvalue().splitlines()[6:28]), flush=True)
