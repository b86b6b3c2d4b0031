"""Probe: DeviceLoader's copies queued by driver calls (the default) against torch's copy
(GPUFLOW_TORCH_COPIES=1), A/B in one process, each beside the PyTorch idioms (the sweep and
the image loop of ``gpuflow bench transfer``).

An earlier version compared pageable tensors copied by the driver from where they lie (from
4 MiB, or from 1 MiB with the side stream from 1 MiB) against staging them all; its output
is in benchmarks/results/2026-11-24-probe-loadervariants-h100-pageable.txt.

PYTHONPATH=src python3 benchmarks/probes/loadervariants.py OUT.json
"""

import json
import os
import sys

from gpuflow.bench.loaders import KB, MB, LoaderBenchConfig, image_loop, sweep
from gpuflow.device.accelerator import Device

VARIANTS = {"driver": "", "torch": "1"}
device = Device.resolve("cuda")
cfg = LoaderBenchConfig(
    sizes=(8 * KB, 256 * KB, MB, 4 * MB, 16 * MB, 64 * MB), bytes_per_round=768 * MB,
    rounds=3, image_steps=40,
)  # fmt: skip
results = {}
for name, torch_copies in VARIANTS.items():
    os.environ["GPUFLOW_TORCH_COPIES"] = torch_copies
    rows = sweep(device, cfg)
    images = image_loop(device, cfg)
    results[name] = {"sweep": rows, "images": images}
    print(f"== {name}")
    for r in rows:
        print(
            f"  {r['batch_bytes'] >> 10:6d} KiB {r['source']:8s} fastest idiom "
            f"{r[r['fastest_idiom'] + '_gb_s']:6.2f} ({r['fastest_idiom']:10s}) ours "
            f"{r['deviceloader_gb_s']:6.2f}  {r['vs_fastest_idiom']:.2f}x  host "
            f"{r['deviceloader_host_us_per_batch']:6.1f} us"
        )
    for r in images:
        print(
            f"  images B={r['batch_size']}: DataLoader {r['dataloader_images_s']:9.0f} ours "
            f"{r['deviceloader_images_s']:9.0f}  {r['speedup']:.2f}x"
        )
    sys.stdout.flush()
with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=1)
