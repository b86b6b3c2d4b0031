"""Probe: where DeviceLoader's time goes for batches of 256 KiB to 16 MiB, and two A/Bs.

1. The sweep of ``gpuflow bench transfer`` at 256 KiB, 1 MiB and 4 MiB, then one more pass of
   DeviceLoader per row with its pipeline's methods timed (host us per batch in each).
2. Pageable tensors pinned by ``pin_memory()`` and copied directly from PIN_MIN_BYTES (the
   default), from 1 MiB, or never (staged, on writer threads from 2 MiB).
3. The image loop with a DataLoader with workers read on a thread of its own (which pins
   large tensors) or not, with the consumer's host time split into taking a batch and the
   step.

An earlier version (before pageable tensors were pinned and copied directly) compared staged
writes on writer threads against inline; its output is
benchmarks/results/2026-11-24-probe-midsizes-h100-before.txt.

PYTHONPATH=src python3 benchmarks/probes/midsizes.py OUT.json
"""

import inspect
import json
import os
import statistics
import sys
import time

import torch
from phasetimer import T, timed

import gpuflow.transfer.loader as loader_module
import gpuflow.transfer.packing as packing_module
from gpuflow.bench.loaders import (
    KB,
    MB,
    LoaderBenchConfig,
    SyntheticImages,
    consume,
    image_loop,
    small_cnn,
    sweep,
)
from gpuflow.device.accelerator import Device
from gpuflow.transfer.issuing import Issuer
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.packing import PackPlan
from gpuflow.transfer.pipeline import Pipeline
from gpuflow.transfer.staging import Stager

device = Device.resolve(os.environ.get("PROBE_DEVICE", "cuda"))
SCALE = int(os.environ.get("PROBE_SCALE", "1"))  # divides every amount: a smoke run elsewhere
results: dict = {}


def show(rows, label):
    print(f"== {label}")
    for r in rows:
        print(
            f"  {r['batch_bytes'] >> 10:6d} KiB {r['source']:8s} "
            + " ".join(
                f"{p}={r[p + '_us_per_batch']:.1f}"
                for p in ("dataloader", "pin_to", "to", "deviceloader")
            )
            + f"  vs fastest {r['vs_fastest_idiom']:.2f}x  host "
            f"{r['deviceloader_host_us_per_batch']:.1f} us"
        )


# ---- 1. the sweep and the phases ------------------------------------------------------------
cfg = LoaderBenchConfig(sizes=(256 * KB, MB, 4 * MB), bytes_per_round=1024 * MB // SCALE, rounds=3)
rows = sweep(device, cfg)
show(rows, "sweep")
results["sweep"] = rows

PHASES = {
    Pipeline: ("top_up", "issue_ready", "take"),
    Stager: ("_next_plan", "_stage_part", "_staging_buffer"),
    Issuer: ("issue", "_copy", "_rebuild"),
    PackPlan: ("write_into", "write_jobs"),
}
originals = {  # as stored in the class: a staticmethod stays one
    (cls, name): inspect.getattr_static(cls, name)
    for cls, names in PHASES.items()
    for name in names
}
phases = {}
for nbytes in cfg.sizes:
    n = max(64 // SCALE, min(2000, (512 * MB // SCALE) // nbytes))
    for kind in ("pageable", "pinned") if device.supports_pinned_memory else ("pageable",):
        tensors = [torch.randn(nbytes // 4) for _ in range(4)]
        if kind == "pinned":
            tensors = [t.pin_memory() for t in tensors]
        batches = [tensors[i % 4] for i in range(n)]
        consume(device, DeviceLoader(batches[:16], device))
        for (cls, name), fn in originals.items():
            if isinstance(fn, staticmethod):
                setattr(cls, name, staticmethod(timed(name, fn.__func__)))
            else:
                setattr(cls, name, timed(name, fn))
        T.clear()
        loader = DeviceLoader(batches, device)
        acc = torch.zeros((), device=device.torch)
        device.synchronize()
        started = time.perf_counter()
        it = iter(loader)
        for _ in range(n):
            t0 = time.perf_counter()
            batch = next(it)
            T["(next)"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            acc += batch.sum()
            T["(compute)"] += time.perf_counter() - t0
        device.synchronize()
        T["(total)"] = time.perf_counter() - started
        loader.close()
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)
        per = {k: v / n * 1e6 for k, v in sorted(T.items(), key=lambda kv: -kv[1])}
        phases[f"{nbytes >> 10}KiB-{kind}"] = per
        print(
            f"-- phases {nbytes >> 10} KiB {kind} (us per batch): "
            + " ".join(f"{k}={v:.1f}" for k, v in per.items())
        )
results["phases"] = phases

# ---- 2. pageable tensors: pinned and direct, or staged -------------------------------------
write_cfg = LoaderBenchConfig(
    sizes=(256 * KB, MB, 4 * MB, 16 * MB), bytes_per_round=1024 * MB // SCALE, rounds=3
)
default_pin_min = packing_module.PIN_MIN_BYTES
writes = {}
for label, pin_min in (
    (f"pin-from-{default_pin_min >> 10}KiB (default)", default_pin_min),
    ("pin-from-1MiB", MB),
    ("staged", 1 << 40),
):
    packing_module.PIN_MIN_BYTES = pin_min
    rows = [r for r in sweep(device, write_cfg) if r["source"] == "pageable"]
    show(rows, f"pageable: {label}")
    writes[label] = rows
packing_module.PIN_MIN_BYTES = default_pin_min
results["pageable"] = writes

# ---- 3. the image loop: reader thread or not, and where the consumer's time goes ---------
image_cfg = LoaderBenchConfig(image_steps=60 // SCALE, rounds=3 // SCALE or 1)
images = {}
default_reads_slowly = loader_module.reads_slowly
for label, reads in (("reader-thread", default_reads_slowly), ("no-thread", lambda s: False)):
    loader_module.reads_slowly = reads
    rows = image_loop(device, image_cfg)
    images[label] = rows
    for r in rows:
        print(
            f"== images {label} B={r['batch_size']}: DataLoader "
            f"{r['dataloader_images_s']:.0f} ours {r['deviceloader_images_s']:.0f} img/s "
            f"= {r['speedup']:.2f}x  rounds {r['deviceloader_images_s_per_round']}"
        )
results["images"] = images


def split(feed_name, make_feed, model, optimizer, steps=60 // SCALE):
    """Host us per step in taking the batch and in the step itself."""
    take, step_s = [], []
    feed = iter(make_feed())
    for i in range(steps):
        t0 = time.perf_counter()
        batch = next(feed)
        t1 = time.perf_counter()
        x = batch["image"].float().div_(255)
        with device.autocast():
            loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if i >= min(6, steps // 2):
            take.append(t1 - t0)
            step_s.append(t2 - t1)
    device.synchronize()
    close = getattr(feed, "close", None)
    if close is not None:
        close()
    return {"take_us": statistics.median(take) * 1e6, "step_us": statistics.median(step_s) * 1e6}


model = small_cnn().to(device.torch).to(memory_format=torch.channels_last)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
splits = {}
for batch_size in (256 // SCALE, 2048 // SCALE):
    data = SyntheticImages(batch_size * 70, 64)

    def source(pin, data=data, batch_size=batch_size):
        return torch.utils.data.DataLoader(
            data, batch_size=batch_size, num_workers=6, pin_memory=pin, prefetch_factor=4
        )

    def idiom(source=source):
        return (
            {k: v.to(device.torch, non_blocking=True) for k, v in b.items()} for b in source(True)
        )

    feeds = {
        "dataloader": idiom,
        "ours-thread": lambda source=source: DeviceLoader(source(False), device),
    }
    for name, make in feeds.items():
        loader_module.reads_slowly = default_reads_slowly
        splits[f"B{batch_size}-{name}"] = split(name, make, model, optimizer)
    loader_module.reads_slowly = lambda s: False
    splits[f"B{batch_size}-ours-no-thread"] = split(
        "ours", lambda source=source: DeviceLoader(source(False), device), model, optimizer
    )
    loader_module.reads_slowly = default_reads_slowly
for k, v in splits.items():
    print(f"-- split {k}: take {v['take_us']:.0f} us, step {v['step_us']:.0f} us (medians)")
results["image_splits"] = splits

with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=1, default=str)
