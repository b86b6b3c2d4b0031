"""Probe: host microseconds of the calls a loader makes per batch, on this host, and of the
small-tensor paths of ``gpuflow bench transfer`` split into their steps.

1. Per call (median of rounds of 200 calls, device idle at the start of each round): the
   allocation, driver copy, event and stream calls the loader makes, against torch's
   ``.to(non_blocking=True)`` of the same pinned 1 MiB tensor and the bench's compute.
2. Loops at 1 MiB from pinned memory with ``acc += batch.sum()``: the idiom, bare
   ``empty`` + driver copy (no event), the same with an event per batch, and DeviceLoader.
3. 1000 x 4 KiB tensors, packed and in bulk, each step timed: plan, acquire, write, copy,
   rebuild, unbind.

PYTHONPATH=src python3 benchmarks/probes/primitives.py OUT.json
"""

import json
import statistics
import sys
import time

import torch

from gpuflow.device.accelerator import Device
from gpuflow.device.drivercopy import driver_copy
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.packing import Planner, plan_pack, rebuild
from gpuflow.transfer.pinned import PinnedPool

device = Device.resolve("cuda")
dev = device.torch
results: dict = {}
MB = 1 << 20


def per_call(fn, n=200, rounds=7):
    """Median host us per call of ``fn(i)`` over ``rounds`` rounds of ``n`` calls."""
    samples = []
    for _ in range(rounds):
        device.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        samples.append((time.perf_counter() - t0) / n * 1e6)
    device.synchronize()
    return statistics.median(samples)


# ---- 1. calls ------------------------------------------------------------------------------
src = torch.randn(MB // 4).pin_memory()
pageable = torch.randn(MB // 4)
out = torch.empty(MB // 4, device=dev)
copy = driver_copy()
stream = torch.cuda.current_stream()
handle = stream.cuda_stream
ev = torch.cuda.Event()
ev.record()
acc = torch.zeros((), device=dev)
keep = []
calls = {
    "torch.empty(1 MiB, cuda)": lambda i: torch.empty(MB // 4, device=dev),
    "torch.empty(1 MiB, uint8)": lambda i: torch.empty(MB, dtype=torch.uint8, device=dev),
    "driver copy 1 MiB": lambda i: copy(out.data_ptr(), src.data_ptr(), MB, handle),
    "out.copy_(pinned, non_blocking)": lambda i: out.copy_(src, non_blocking=True),
    "pinned.to(dev, non_blocking)": lambda i: src.to(dev, non_blocking=True),
    "pinned.pin_memory().to(dev, nb)": lambda i: src.pin_memory().to(dev, non_blocking=True),
    "Event() + record": lambda i: torch.cuda.Event().record(),
    "device.new_event() + record": lambda i: device.new_event().record(stream),
    "event.query": lambda i: ev.query(),
    "current_stream()": lambda i: torch.cuda.current_stream(),
    "device.current_stream_key()": lambda i: device.current_stream_key(),
    "stream.cuda_stream": lambda i: stream.cuda_stream,
    "current_device()": lambda i: torch.cuda.current_device(),
    "is_pinned (pinned)": lambda i: src.is_pinned(),
    "is_pinned (pageable)": lambda i: pageable.is_pinned(),
    "is_contiguous": lambda i: src.is_contiguous(),
    "data_ptr": lambda i: src.data_ptr(),
    "out.sum()": lambda i: out.sum(),
    "acc += out.sum()": lambda i: acc.add_(out.sum()),
    "pageable.pin_memory() 1 MiB": lambda i: keep.append(pageable.pin_memory()) or keep.clear(),
}
results["calls_us"] = {}
for name, fn in calls.items():
    fn(0)
    us = per_call(fn)
    results["calls_us"][name] = us
    print(f"{name:36s} {us:7.2f} us")


# ---- 2. loops at 1 MiB pinned ------------------------------------------------------------
def loop(make, n=1000, rounds=5):
    """us per batch of a whole loop (median round), device idle to idle."""
    tensors = [torch.randn(MB // 4).pin_memory() for _ in range(4)]
    batches = [tensors[i % 4] for i in range(n)]
    samples = []
    for _ in range(rounds):
        acc = torch.zeros((), device=dev)
        device.synchronize()
        t0 = time.perf_counter()
        for b in make(batches):
            acc += b.sum()
        device.synchronize()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples), samples


def idiom(batches):
    return (b.pin_memory().to(dev, non_blocking=True) for b in batches)


def bare(batches):
    held = []
    for b in batches:
        o = torch.empty(b.shape, dtype=b.dtype, device=dev)
        copy(o.data_ptr(), b.data_ptr(), b.nbytes, torch.cuda.current_stream().cuda_stream)
        held.append(b)
        yield o


def evented(batches):
    held = []
    for b in batches:
        o = torch.empty(b.shape, dtype=b.dtype, device=dev)
        copy(o.data_ptr(), b.data_ptr(), b.nbytes, torch.cuda.current_stream().cuda_stream)
        e = torch.cuda.Event()
        e.record()
        held.append((e, b))
        yield o


def ahead(batches):
    """bare, one batch ahead: the copy of batch i+1 queued before batch i is used."""
    it = iter(batches)
    pending = None
    for b in it:
        o = torch.empty(b.shape, dtype=b.dtype, device=dev)
        copy(o.data_ptr(), b.data_ptr(), b.nbytes, torch.cuda.current_stream().cuda_stream)
        if pending is not None:
            yield pending
        pending = o
    if pending is not None:
        yield pending


def loader(batches):
    return DeviceLoader(batches, device)


results["loops_us"] = {}
for name, make in (("idiom", idiom), ("bare", bare), ("evented", evented), ("ahead", ahead),
                   ("deviceloader", loader), ("idiom again", idiom)):  # fmt: skip
    med, samples = loop(make)
    results["loops_us"][name] = samples
    print(f"loop {name:14s} {med:7.2f} us/batch  {[round(s, 1) for s in samples]}")

# ---- 3. small tensors --------------------------------------------------------------------
tensors = [torch.randn(1024) for _ in range(1000)]
stacked = torch.stack(tensors)
pool = PinnedPool(device, max_bytes=64 * MB)
steps: dict[str, dict[str, list[float]]] = {"packed": {}, "bulk": {}, "one by one": {}}
for _ in range(12):
    for name, batch in (("packed", tensors), ("bulk", stacked)):
        device.synchronize()
        s = steps[name]
        t = [time.perf_counter()]
        plan = plan_pack(batch)
        t.append(time.perf_counter())
        buffer = pool.acquire(plan.nbytes)
        t.append(time.perf_counter())
        plan.write_into(buffer.bytes)
        t.append(time.perf_counter())
        on_device = buffer.bytes[: plan.nbytes].to(dev, non_blocking=True)
        done = device.new_event()
        done.record()
        pool.release(buffer, after=done)
        t.append(time.perf_counter())
        rebuilt = rebuild(on_device, plan.spec)
        t.append(time.perf_counter())
        if name == "bulk":
            rebuilt.unbind(0)
        t.append(time.perf_counter())
        device.synchronize()
        t.append(time.perf_counter())
        for label, a, b in zip(("plan", "acquire", "write", "copy", "rebuild", "unbind", "sync"),
                               t, t[1:], strict=False):  # fmt: skip
            s.setdefault(label, []).append((b - a) * 1e3)
        s.setdefault("total", []).append((t[-1] - t[0]) * 1e3)
    device.synchronize()
    t0 = time.perf_counter()
    [x.to(dev, non_blocking=True) for x in tensors]
    device.synchronize()
    steps["one by one"].setdefault("total", []).append((time.perf_counter() - t0) * 1e3)
planner = Planner(True, None)
for _ in range(12):
    t0 = time.perf_counter()
    planner.plan_pack(tensors)
    steps["packed"].setdefault("plan (cached layout)", []).append((time.perf_counter() - t0) * 1e3)
results["small_ms"] = {
    k: {p: statistics.median(v[2:]) for p, v in d.items()} for k, d in steps.items()
}
for k, d in results["small_ms"].items():
    print(f"small {k:10s} " + " ".join(f"{p}={v:.3f}" for p, v in d.items()))
pool.close()

if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
