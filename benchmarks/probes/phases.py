"""Probe: time each phase of DeviceLoader on pageable 64 MB batches (GPU machine)."""

import itertools
import time

import torch
from phasetimer import T, timed

import gpuflow.transfer.loader as L
from gpuflow.device.accelerator import Device
from gpuflow.transfer.packing import plan_pack as real_plan
from gpuflow.transfer.pinned import PinnedPool

MB = 1 << 20
N = 96

L.plan_pack = timed("plan", real_plan)
PinnedPool.acquire = timed("acquire", PinnedPool.acquire)
L.PackPlan.write_into = timed("write", L.PackPlan.write_into)
L.DeviceLoader._issue = timed("issue", L.DeviceLoader._issue)
L.DeviceLoader._take_ready = timed("take_ready", L.DeviceLoader._take_ready)
L.rebuild = timed("rebuild", L.rebuild)

src = [torch.randn(16 * MB) for _ in range(4)]


def measure(label, tensors):
    T.clear()
    acc = torch.zeros((), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with L.DeviceLoader(itertools.islice(itertools.cycle(tensors), N), Device("cuda")) as ld:
        for b in ld:
            acc += b.sum()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    phases = {k: round(v * 1e3, 1) for k, v in T.items()}
    print(label, "GB/s", round(N * 64 * MB / wall / 1e9, 1), "phases ms", phases)


pinned = [t.pin_memory() for t in src]
for _ in range(2):
    measure("pageable", src)
    measure("pinned", pinned)

# Events that sleep instead of spin when waited on.
plain_event = Device.new_event


def blocking_event(self, timing=False):
    if self.has_streams:
        return torch.cuda.Event(enable_timing=timing, blocking=True)
    return plain_event(self, timing)


Device.new_event = blocking_event
for _ in range(2):
    measure("pageable, blocking events", src)
