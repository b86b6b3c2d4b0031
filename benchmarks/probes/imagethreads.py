"""Probe: where the training thread's time goes in the image loop at 3.1 MB batches
(``gpuflow bench transfer``'s: a ``DataLoader`` with 6 workers, the small CNN, 256 3x64x64
uint8 images), per feed, over four rounds in alternating order after one untimed round each.

Per batch: images per second; the training thread's time in ``next(feed)`` (and, of it,
inside the DataLoader's own ``next``: ``stats.source_s`` for DeviceLoader, which also counts
planning) and in the step; CPU time and voluntary / involuntary context switches of the
training thread and of the process's other threads (DataLoader's pin-memory thread, the
driver's); for DeviceLoader, the host time of its stages (``plan_pack``, ``next_plan``,
``issue`` and its ``_copy``, ``take``).

Feeds: ``idiom`` (``DataLoader(pin_memory=True)`` + ``{k: v.to(non_blocking=True)}``),
``idiom_callsN`` (the idiom plus N calls of ``torch.empty(1, device="cuda")`` per batch:
what each extra torch call costs while DataLoader's thread runs), ``ours`` (DeviceLoader
over ``DataLoader(pin_memory=False)``), ``ours_cdll`` (its driver copies through
``ctypes.CDLL``, which lets go of the interpreter lock during the call, as they did before
docs/decisions/042; ``ours_pydll`` in that decision's first rows, when CDLL was the default).
Also how often DataLoader's ``next`` found its pin thread's queue empty, and the time in
Python's cyclic collector (the explicit collection after each round included: a generation 2
run in every line). A feed named with ``_nogc`` runs its timed steps with the collector off.
The runs of docs/decisions/044 named ``ours_torchevents`` and ``ours_driver`` variants of code
not kept; see there.
Cited by docs/decisions/042 and 044.

PYTHONPATH=src OUT=DIR python3 benchmarks/probes/imagethreads.py FEED...
    (appends to DIR/imagethreads.txt)
"""

import collections
import ctypes
import gc
import os
import sys
import threading
import time

import torch

from gpuflow.bench.loaders import SyntheticImages, image_step, small_cnn
from gpuflow.device.accelerator import Device
from gpuflow.transfer import issuing
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.packing import Planner
from gpuflow.transfer.staging import Stager

dev = Device.resolve("cuda")
model = small_cnn().cuda().to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
B, STEPS, WARMUP = 256, 300, 30
data = SyntheticImages(B * STEPS, 64)
out = os.environ.get("OUT", ".")
TICK = os.sysconf("SC_CLK_TCK")
REAL_DRIVER = issuing.driver_copy
EMPTY = [0, 0]  # DataLoader next calls that found its pin thread's queue empty, all calls
REAL_NEXT_DATA = torch.utils.data.dataloader._MultiProcessingDataLoaderIter._next_data


def counted_next_data(self):
    EMPTY[0] += self._data_queue.empty()
    EMPTY[1] += 1
    return REAL_NEXT_DATA(self)


torch.utils.data.dataloader._MultiProcessingDataLoaderIter._next_data = counted_next_data
GC = {"s": 0.0, "runs": [0, 0, 0], "started": 0.0}  # seconds in the cyclic collector, runs


def gc_timer(phase, info):
    if phase == "start":
        GC["started"] = time.perf_counter()
    else:
        GC["s"] += time.perf_counter() - GC["started"]
        GC["runs"][info["generation"]] += 1


gc.callbacks.append(gc_timer)
STAGES: dict[str, float] = collections.defaultdict(float)


def timed_method(cls, name):
    real = getattr(cls, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            STAGES[name] += time.perf_counter() - started

    setattr(cls, name, wrapper)


for cls, name in [(Planner, "plan_pack"), (Stager, "next_plan"), (issuing.Issuer, "issue"),
                  (issuing.Issuer, "_copy"), (issuing.Issuer, "take")]:  # fmt: skip
    timed_method(cls, name)


def released_driver_copy():
    call = ctypes.CDLL("libcuda.so.1").cuMemcpyHtoDAsync_v2
    call.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    call.restype = ctypes.c_int
    return call


def source(pin):
    return torch.utils.data.DataLoader(
        data, batch_size=B, num_workers=6, pin_memory=pin, prefetch_factor=4
    )


def read(path):
    with open(path) as f:
        return f.read()


def thread_times():
    """{tid: (cpu seconds, voluntary, involuntary context switches)}"""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = read(f"/proc/self/task/{tid}/stat").rsplit(")", 1)[1].split()
            status = read(f"/proc/self/task/{tid}/status")
        except FileNotFoundError:
            continue
        voluntary = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        involuntary = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        found[int(tid)] = ((int(stat[11]) + int(stat[12])) / TICK, voluntary, involuntary)
    return found


def step(batch):
    image_step(dev, model, opt, batch)


def run(kind):
    waited = [0.0]

    def timed_source():
        batches = iter(source(True))
        while True:
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            waited[0] += time.perf_counter() - started
            yield batch

    no_gc = kind.endswith("_nogc")
    kind = kind.removesuffix("_nogc")
    if kind.startswith("idiom"):
        calls = int(kind.removeprefix("idiom_calls") or 0) if kind != "idiom" else 0

        def idiom():
            for b in timed_source():
                for _ in range(calls):
                    torch.empty(1, device="cuda")
                yield {k: v.to("cuda", non_blocking=True) for k, v in b.items()}

        feed = idiom()
    else:
        issuing.driver_copy = released_driver_copy if kind == "ours_cdll" else REAL_DRIVER
        feed = DeviceLoader(source(False), dev)

    def source_seconds(feed):
        return feed.stats.source_s if isinstance(feed, DeviceLoader) else waited[0]

    batches = iter(feed)
    for _ in range(WARMUP):
        step(next(batches))
    torch.cuda.synchronize()
    main = threading.get_native_id()
    before, source_before = thread_times(), source_seconds(feed)
    STAGES.clear()
    EMPTY[:] = [0, 0]
    GC.update(s=0.0, runs=[0, 0, 0])
    if no_gc:
        gc.disable()
    in_next = in_step = 0.0
    n = 0
    started = time.perf_counter()
    while True:
        a = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            break
        b = time.perf_counter()
        step(batch)
        n += 1
        in_next += b - a
        in_step += time.perf_counter() - b
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    gc.enable()
    after, source_after = thread_times(), source_seconds(feed)
    del batches, feed, batch
    gc.collect()
    threads = collections.defaultdict(lambda: [0.0, 0, 0])
    for tid, now in after.items():
        then = before.get(tid, (0.0, 0, 0))
        group = threads["main" if tid == main else "other"]
        for i in range(3):
            group[i] += now[i] - then[i]
    per_thread = {
        g: (round(v[0] / n * 1e3, 3), round(v[1] / n, 1), round(v[2] / n, 1))
        for g, v in threads.items()
    }
    stages = {k: round(v / n * 1e6) for k, v in STAGES.items()}
    return (
        f"{kind}{'_nogc' if no_gc else ''} {n * B / wall:.0f} img/s "
        f"next {in_next / n * 1e3:.3f} ms "
        f"(source {(source_after - source_before) / n * 1e3:.3f}) step {in_step / n * 1e3:.3f} ms "
        f"cpu ms, voluntary, involuntary switches per batch: {per_thread} "
        f"stages us/batch {stages} queue empty {EMPTY[0] / max(EMPTY[1], 1):.0%} "
        f"gc us/batch {GC['s'] / n * 1e6:.0f} runs by generation {GC['runs']}"
    )


kinds = sys.argv[1:]
for kind in kinds:
    run(kind)
for r in range(4):
    for kind in kinds if r % 2 == 0 else kinds[::-1]:
        line = run(kind)
        print(line, flush=True)
        with open(f"{out}/imagethreads.txt", "a") as report:
            report.write(line + "\n")
