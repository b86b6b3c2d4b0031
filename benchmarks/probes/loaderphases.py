"""Probe: DeviceLoader's per-batch phases on pageable 64 MiB batches, with and without a
little compute per batch (GPU machine). Steady state from consumer-stream events.

PYTHONPATH=src python3 benchmarks/probes/loaderphases.py
"""

import itertools
import json

import torch
from phasetimer import T, timed

import gpuflow.transfer.loader as L
from gpuflow.device.accelerator import Device
from gpuflow.transfer.pinned import PinnedPool

MB = 1 << 20
N, WARM = 72, 8

PinnedPool.acquire = timed("acquire", PinnedPool.acquire)
L.PackPlan.write_into = timed("write", L.PackPlan.write_into)
L.DeviceLoader._issue = timed("issue", L.DeviceLoader._issue)
L.DeviceLoader._take_free_slot = timed("take_slot", L.DeviceLoader._take_free_slot)
L.DeviceLoader._take_ready = timed("consumer_wait", L.DeviceLoader._take_ready)

src = [torch.randn(16 * MB) for _ in range(4)]
dev = Device("cuda")


def measure(compute, timing, depth=2):
    acc = torch.zeros((), device="cuda")
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    batches = itertools.islice(itertools.cycle(src), N)
    with L.DeviceLoader(batches, dev, depth=depth, timing=timing) as loader:
        for i, b in enumerate(loader):
            if i == WARM:
                T.clear()
                first.record()
            if compute:
                acc += b.sum()
        last.record()
        last.synchronize()
        pool = loader.pool_stats
    ms = first.elapsed_time(last)
    per = {k: round(v * 1e3 / (N - WARM), 3) for k, v in T.items()}
    return {
        "gb_s": round((N - WARM) * 64 * MB / (ms * 1e6), 1),
        "ms_per_batch": per,
        "pool_waits": pool.waits,
    }


out = {}
for rep in range(2):
    out[f"compute, timing #{rep}"] = measure(True, True)
    out[f"no compute, timing #{rep}"] = measure(False, True)
    out[f"compute, no timing #{rep}"] = measure(True, False)
    out[f"compute, depth 3 #{rep}"] = measure(True, True, depth=3)
print(json.dumps(out, indent=1))
