"""Probe: what a loader pays before its first batch, and where 1000 small tensors' time goes.

PYTHONPATH=src python3 benchmarks/probes/startup.py
"""

import json
import time

import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.packing import plan_pack, rebuild
from gpuflow.transfer.pinned import release_cached_host_memory

MB = 1 << 20
dev = Device("cuda")
out = {}


def ms(fn, n=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(sorted(times)[n // 2], 3)


# Pinning 64 MiB afresh (cudaHostAlloc) versus taking a block from torch's cache.
cold = []
for _ in range(3):
    release_cached_host_memory(dev)
    t0 = time.perf_counter()
    b = torch.empty(64 * MB, dtype=torch.uint8, pin_memory=True)
    cold.append(round((time.perf_counter() - t0) * 1e3, 2))
    del b
t0 = time.perf_counter()
b = torch.empty(64 * MB, dtype=torch.uint8, pin_memory=True)
out["pin_64mib_cold_ms"] = cold
out["pin_64mib_cached_ms"] = round((time.perf_counter() - t0) * 1e3, 3)

# 1000 x 4 KiB: each phase of the packed path.
tensors = [torch.randn(1024) for _ in range(1000)]
plan = plan_pack(tensors)
host = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=True)
plan.write_into(host)
on_dev = host.to("cuda", non_blocking=True)
out["small"] = {
    "one_by_one_pageable_ms": ms(lambda: [t.to("cuda", non_blocking=True) for t in tensors]),
    "plan_ms": ms(lambda: plan_pack(tensors)),
    "write_ms": ms(lambda: plan.write_into(host)),
    "copy_ms": ms(lambda: host.to("cuda", non_blocking=True)),
    "rebuild_ms": ms(lambda: rebuild(on_dev, plan.spec)),
    "unbind_only_ms": ms(lambda: on_dev[:4096000].view(torch.float32).view(1000, -1).unbind(0)),
    "stack_only_ms": ms(lambda: torch.stack(tensors)),
}
print(json.dumps(out, indent=1))
