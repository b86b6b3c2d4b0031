"""Probe: where a DeviceLoader's time goes on small batches (1 MiB and 8 KiB), beside the
PyTorch idiom, in one process. Per batch: host microseconds in each phase of the loader
thread and of the consumer's next(), and the loop's rate; variants: timing events off,
depth 4, and a 0.1 ms GIL switch interval (is the consumer waiting for the GIL?).

PYTHONPATH=src python3 benchmarks/probes/smallbatches.py
"""

import sys
import time

import torch
from phasetimer import T, timed

import gpuflow.transfer.loader as L
import gpuflow.transfer.packing as P
from gpuflow.transfer.pinned import PinnedPool

L.plan_pack = timed("thread: plan", P.plan_pack)
P.PackPlan.write_into = timed("thread: write", P.PackPlan.write_into)
PinnedPool.acquire = timed("thread: acquire", PinnedPool.acquire)
L._Producer._take_free_slot = timed("thread: take slot", L._Producer._take_free_slot)
L._Producer._issue = timed("thread: issue", L._Producer._issue)
L.DeviceLoader._take_ready = timed("next: wait", L.DeviceLoader._take_ready)
L.DeviceLoader.__next__ = timed("next: all", L.DeviceLoader.__next__)

dev = torch.device("cuda")
N = 300


def loop(batches, wrap):
    acc = torch.zeros((), device=dev)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for b in wrap(batches):
        acc += b.sum()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / len(batches) * 1e6


def idiom(batches):
    return (b.pin_memory().to(dev, non_blocking=True) for b in batches)


default_interval = sys.getswitchinterval()
for nbytes in (1 << 20, 8 << 10):
    batches = [torch.randn(nbytes // 4) for _ in range(N)]
    variants = {
        "idiom": lambda bs: idiom(bs),
        "loader": lambda bs: L.DeviceLoader(bs, "cuda"),
        "no timing": lambda bs: L.DeviceLoader(bs, "cuda", timing=False),
        "depth 4": lambda bs: L.DeviceLoader(bs, "cuda", depth=4),
        "views": lambda bs: L.DeviceLoader(bs, "cuda", views=True),
    }
    for interval in (default_interval, 1e-4):
        sys.setswitchinterval(interval)
        for name, wrap in variants.items():
            loop(batches[:20], wrap)  # warm-up
            T.clear()
            us = loop(batches, wrap)
            phases = "  ".join(f"{k} {v / N * 1e6:.0f}" for k, v in sorted(T.items()))
            print(
                f"{nbytes >> 10} KiB, switch {interval * 1e3:g} ms, {name:9s}: {us:6.0f} "
                f"us/batch | {phases}",
                flush=True,
            )
