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
per tensor, rebuild it on the device); ``idiom_plan`` (the idiom plus the planning alone).
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

from gpuflow.bench.loaders import SyntheticImages, image_step, small_cnn
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


def lean(plan_only):
    """A sketch of the least a loader can do per batch here: plan it (a known layout), copy
    each tensor by ``.to()``, rebuild the batch on the device; ``plan_only`` hands out the
    idiom's copies instead of the rebuilt batch."""
    planner = Planner(narrow=False, lossy_float=None, direct=True)
    for b in source(True):
        plan = planner.plan_pack(b, 1 << 18, pinned=True)
        if plan_only:
            yield {k: v.to("cuda", non_blocking=True) for k, v in b.items()}
            continue
        outs = [t.to("cuda", non_blocking=True) for t in plan.sources]
        yield rebuild(None, plan.layout.spec, iter(outs))


def feed(kind):
    if kind in ("lean", "idiom_plan"):
        return lean(plan_only=kind == "idiom_plan")
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
