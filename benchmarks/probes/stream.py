"""Probe: DeviceLoader streaming on 64 MB batches, by depth, timing and source memory.

    PYTHONPATH=src python3 benchmarks/probes/stream.py
"""

import itertools
import time

import torch

from gpuflow.device import Device
from gpuflow.loader import _END, DeviceLoader
from gpuflow.pack import plan_pack

MB = 1 << 20
device = Device.resolve("auto")
distinct = [torch.randn(16 * MB) for _ in range(4)]
pinned = [t.pin_memory() for t in distinct]


def run(batches, warmup=8):
    acc = torch.zeros((), device="cuda")
    for i, b in enumerate(batches):
        if i == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        acc += b.sum()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def loader_rate(tensors, n=72, **kw):
    with DeviceLoader(itertools.islice(itertools.cycle(tensors), n), device, **kw) as ld:
        s = run(ld)
    return round(64 * (n - 8) * MB / s / 1e9, 1), round(ld.stats.stall_s * 1e3, 1)


for kind, tensors in (("pinned", pinned), ("pageable", distinct)):
    for depth in (2, 3, 4):
        for timing in (True, False):
            print(kind, "depth", depth, "timing", timing, "GB/s, stall ms",
                  loader_rate(tensors, depth=depth, timing=timing))


class Timed(DeviceLoader):
    phases = {"plan": 0.0, "acquire": 0.0, "write": 0.0, "offer": 0.0}

    def _pack_all(self):
        p = self.phases
        for batch in self._source:
            t0 = time.perf_counter()
            plan = plan_pack(batch, **self._pack_options)
            t1 = time.perf_counter()
            self._size_pool_for(plan.nbytes)
            host = self._pool.acquire(plan.nbytes, timeout=None)
            t2 = time.perf_counter()
            plan.write_into(host.bytes)
            t3 = time.perf_counter()
            self._offer((plan, host))
            t4 = time.perf_counter()
            p["plan"] += t1 - t0
            p["acquire"] += t2 - t1
            p["write"] += t3 - t2
            p["offer"] += t4 - t3
        self._offer(_END)


with Timed(itertools.islice(itertools.cycle(distinct), 72), device) as ld:
    s = run(ld)
print("pageable timed phases ms (72 batches):", {k: round(v * 1e3, 1) for k, v in Timed.phases.items()},
      "rate", round(64 * 64 * MB / s / 1e9, 1))

# memcpy in a fresh thread while DMA runs
import threading

src, dst = distinct[0], torch.empty(16 * MB).pin_memory()
dev = torch.empty(16 * MB, device="cuda")
rates = []


def body():
    for _ in range(20):
        t0 = time.perf_counter()
        dst.copy_(src)
        rates.append(round(64 * MB / (time.perf_counter() - t0) / 1e9, 1))


th = threading.Thread(target=body)
th.start()
side = torch.cuda.Stream()
while th.is_alive():
    with torch.cuda.stream(side):
        dev.copy_(pinned[1], non_blocking=True)
    side.synchronize()
print("thread memcpy GB/s while DMA runs:", rates)
