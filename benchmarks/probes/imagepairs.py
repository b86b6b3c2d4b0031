"""Probe: the image loop at 3.1 MB batches (``gpuflow bench transfer``'s model, data and
DataLoader settings), with the feeds compared in short chunks of steps taken in turn from
feeds that all stay live, each on a DataLoader of its own (6 persistent workers and its own
pin-memory thread). Rounds of a whole epoch per feed, as the bench runs them, moved by
+-15% from one round to the next on the H100 hosts, which swamps differences of a few
percent; chunks side by side cancel whatever drifts slower than a chunk.

Feeds: ``idiom`` (``{k: v.to(non_blocking=True)}`` over the pinned batches; ``idiom_again``
is another such feed, which should come out at 1.0); ``ours`` (``DeviceLoader`` over its
DataLoader); ``ours_depthN`` (that with ``depth=N``); ``idiom_busyN`` (the idiom plus ``N``
us of Python a batch, holding the interpreter lock); ``idiom_callsN`` (the idiom plus ``N``
calls of ``torch.empty(1)`` on the device a batch, each letting go of the lock); ``lean``
(the least a loader could do per batch here: plan the batch with a known layout, ``.to()``
per tensor, rebuild it on the device); ``idiom_plan`` (the idiom plus the planning alone);
``lean_now`` and ``idiom_now`` (those letting go of the host batch before handing out the
device one, where a generator lets go of it as it reads the next); ``lean_object`` (``lean``
behind an iterator object with the loader's call depth and bookkeeping);
``lean_object_pinset`` (that over a DataLoader made as the loader makes it: ``pin_memory``
set only while its iterator is made).
Feeds of code tried and not kept ran too (docs/decisions/044 names them). The order of the
feeds reverses each time round. Per feed: the mean rate, and against the idiom's chunk beside
it the geometric mean of the ratios with a 95% bootstrap interval. Cited by
docs/decisions/044.

PYTHONPATH=src OUT=DIR python3 benchmarks/probes/imagepairs.py CHUNKS FEED...
    (appends to DIR/imagepairs.txt)
"""

import math
import os
import random
import statistics
import sys
import time

import torch

from gpuflow.bench.workloads import SyntheticImages, image_step, small_cnn
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.packing import Planner, rebuild

dev = Device.resolve("cuda")
model = small_cnn().cuda().to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
B, STEPS, WARMUP = 256, 25, 50  # steps per chunk; untimed steps per feed first


def source(pin):
    return torch.utils.data.DataLoader(
        SyntheticImages(B * 100_000, 64), batch_size=B, num_workers=6, pin_memory=pin,
        persistent_workers=True, prefetch_factor=4,
    )  # fmt: skip


def busy(us):
    until = time.perf_counter() + us * 1e-6
    while time.perf_counter() < until:
        pass


def idiom(extra):
    for b in source(True):
        extra()
        yield {k: v.to("cuda", non_blocking=True) for k, v in b.items()}


def lean(plan_only, drop_now=False):
    """A sketch of the least a loader can do per batch here: plan it (a known layout), copy
    each tensor by ``.to()``, rebuild the batch on the device; ``plan_only`` hands out the
    idiom's copies instead of the rebuilt batch. ``drop_now``: the host batch is let go of
    before the device batch is handed out, not when the next one is read."""
    planner = Planner(narrow=False, lossy_float=None, direct=True)
    for b in source(True):
        plan = planner.plan_pack(b, 1 << 18, pinned=True)
        if plan_only:
            yield {k: v.to("cuda", non_blocking=True) for k, v in b.items()}
            continue
        outs = [t.to("cuda", non_blocking=True) for t in plan.sources]
        batch = rebuild(None, plan.layout.spec, iter(outs))
        if drop_now:
            del b, plan
        yield batch


class _LeanIterator:
    """``lean`` behind an iterator object whose ``__next__`` goes through three method calls,
    with the loader's per-batch bookkeeping: a stream key, timings, counts."""

    def __init__(self, batches):
        self.batches, self.planner = batches, Planner(narrow=False, lossy_float=None, direct=True)
        self.counts = {"batches": 0, "copies": 0, "bytes_moved": 0}
        self.source_s = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        return self._next_of(torch._C._cuda_getCurrentStream(0))

    def _next_of(self, key):
        plan = self._plan()
        return self._hand_out(plan, key)

    def _plan(self):
        started = time.perf_counter()
        try:
            return self.planner.plan_pack(next(self.batches), 1 << 18, pinned=True)
        finally:
            self.source_s += time.perf_counter() - started

    def _hand_out(self, plan, key):
        outs = [t.to(dev.torch, non_blocking=True) for t in plan.sources]
        batch = rebuild(None, plan.layout.spec, iter(outs))
        self.counts["batches"] += 1
        self.counts["copies"] += len(outs)
        self.counts["bytes_moved"] += plan.wire_nbytes
        return batch


def loaders_dataloader():
    """Made as DeviceLoader makes its epoch's iterator: pin_memory set only while made."""
    loader = source(False)
    loader.pin_memory = True
    try:
        return iter(loader)
    finally:
        loader.pin_memory = False


def idiom_dropping_now():
    for b in source(True):
        batch = {k: v.to("cuda", non_blocking=True) for k, v in b.items()}
        del b
        yield batch


def feed(kind):
    if kind in ("lean", "lean_now", "idiom_plan"):
        return lean(plan_only=kind == "idiom_plan", drop_now=kind == "lean_now")
    if kind == "idiom_now":
        return idiom_dropping_now()
    if kind == "lean_object":
        return _LeanIterator(iter(source(True)))
    if kind == "lean_object_pinset":
        return _LeanIterator(loaders_dataloader())
    if kind.startswith("idiom_busy"):
        us = int(kind.removeprefix("idiom_busy"))
        return idiom(lambda: busy(us))
    if kind.startswith("idiom_calls"):
        calls = range(int(kind.removeprefix("idiom_calls")))
        return idiom(lambda: [torch.empty(1, device="cuda") for _ in calls])
    if kind.startswith("idiom"):  # (a second one, idiom_again, checks the method: 1.0)
        return idiom(lambda: None)
    depth = int(kind.removeprefix("ours_depth")) if kind.startswith("ours_depth") else 2
    return iter(DeviceLoader(source(False), dev, depth=depth))


def chunk(batches, steps):
    """Images per second over ``steps`` steps, their device work included."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        image_step(dev, model, opt, next(batches))
    torch.cuda.synchronize()
    return steps * B / (time.perf_counter() - started)


chunks, kinds = int(sys.argv[1]), sys.argv[2:]
feeds = {kind: feed(kind) for kind in kinds}
for batches in feeds.values():
    chunk(batches, WARMUP)
rates = {kind: [] for kind in kinds}
for r in range(chunks):
    for kind in kinds if r % 2 == 0 else kinds[::-1]:
        rates[kind].append(chunk(feeds[kind], STEPS))
lines = [f"# {chunks} chunks of {STEPS} steps per feed, {B} images a batch"]
random.seed(0)
for kind, got in rates.items():
    logs = [math.log(a / b) for a, b in zip(got, rates["idiom"], strict=True)]
    means = sorted(statistics.mean(random.choices(logs, k=len(logs))) for _ in range(4000))
    lines.append(
        f"{kind} mean {statistics.mean(got):.0f} img/s, vs idiom "
        f"{math.exp(statistics.mean(logs)):.3f} "
        f"(95% {math.exp(means[100]):.3f}-{math.exp(means[3899]):.3f})"
    )
print("\n".join(lines), flush=True)
with open(f"{os.environ.get('OUT', '.')}/imagepairs.txt", "a") as report:
    report.write("\n".join(lines) + "\n")
