"""Probe: where the image loop's host time goes at 3.1 MB batches, per feed.

For each feed, the training thread's time inside ``next(feed)`` and in the step, per step,
and the loader's own ``stats`` (time waiting on its source, waiting for staging). Feeds, in
alternating rounds: the idiom (``DataLoader(pin_memory=True)`` + ``.to()``); DeviceLoader
as it is (when this ran, each batch made on its reader thread, ``transfer.device_reader``,
gone since docs/decisions/039); with
``narrow=False`` (labels cross as int64, no staging, no widening kernel); over
``DataLoader(pin_memory=True)`` (no reader thread of its own); and the source alone (the
idiom's feed with no training: the workers' ceiling).

The path before ``device_reader`` (the reader thread only taking batches from the workers,
the rest on the training thread), measured in docs/decisions/033, was run by replacing a
private method of DeviceLoader; that variant is in this file at commit bc04c34.

PYTHONPATH=src python3 benchmarks/probes/imagephases.py OUT.json
"""

import json
import statistics
import sys
import time

import torch

from gpuflow.bench.loaders import SyntheticImages, small_cnn
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

device = Device.resolve("cuda")
dev = device.torch
model = small_cnn().to(dev).to(memory_format=torch.channels_last)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
steps, warmup, rounds, batch_size = 240, 24, 6, 256
data = SyntheticImages(batch_size * (steps + warmup), 64)
print("threads", torch.get_num_threads(), "interop", torch.get_num_interop_threads())


def source(pin):
    return torch.utils.data.DataLoader(
        data, batch_size=batch_size, num_workers=6, pin_memory=pin,
        persistent_workers=False, prefetch_factor=4,
    )  # fmt: skip


def train(feed):
    """(images/s, ms per step in next(), ms per step in the step) after warmup."""
    it = iter(feed)
    in_next = in_step = 0.0
    count = 0
    for step in range(steps + warmup):
        if step == warmup:
            device.synchronize()
            started = time.perf_counter()
            in_next = in_step = 0.0
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        x = batch["image"].float().div_(255)
        with device.autocast():
            loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        in_next += t1 - t0
        in_step += time.perf_counter() - t1
        if step >= warmup:
            count += batch_size
    device.synchronize()
    elapsed = time.perf_counter() - started
    return count / elapsed, in_next / steps * 1e3, in_step / steps * 1e3


def idiom():
    return train({k: v.to(dev, non_blocking=True) for k, v in b.items()} for b in source(True))


def ours(pin=False, **kwargs):
    with DeviceLoader(source(pin), device, **kwargs) as loader:
        out = train(loader)
        s = loader.stats
    per = 1e3 / (steps + warmup)
    return (*out, s.source_s * per, s.stall_s * per)


def source_alone():
    feed = ({k: v.to(dev, non_blocking=True) for k, v in b.items()} for b in source(True))
    count = 0
    for step, _ in enumerate(feed):
        if step == warmup:
            device.synchronize()
            started = time.perf_counter()
        if step >= warmup:
            count += batch_size
    device.synchronize()
    return count / (time.perf_counter() - started), 0.0, 0.0


paths = {
    "idiom": idiom,
    "ours": ours,
    "ours-narrow=False": lambda: ours(narrow=False),
    "ours-over-pinned-dataloader": lambda: ours(True),
    "source-alone": source_alone,
}
runs = {name: [] for name in paths}
for _ in range(rounds):
    for name, run in paths.items():
        runs[name].append(run())
results = {}
idiom_rate = statistics.median(r[0] for r in runs["idiom"])
for name, rs in runs.items():
    cols = list(zip(*rs, strict=True))
    med = [statistics.median(c) for c in cols]
    results[name] = {"median": med, "rounds": rs}
    extra = f" source {med[3]:.3f} ms, stall {med[4]:.3f} ms" if len(med) > 3 else ""
    print(
        f"{name:34s} {med[0]:9,.0f} img/s ({med[0] / idiom_rate:.2f}x)"
        f"  in next {med[1]:.3f} ms, in step {med[2]:.3f} ms{extra}"
        f"  rounds {[round(r[0]) for r in rs]}"
    )
with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=1)
