"""Probe: where DeviceLoader's host time goes per batch, by cProfile, beside the idiom
``.pin_memory().to(non_blocking=True)``: 2000 batches of 256 KiB pinned and pageable floats,
1 MiB pageable floats and 32 x 1024 int64 ids, each with a little compute. Run when large
pinned batches of a reusing source first crossed as they were read, through torch's stream
context manager; narrowing on, its default then. Cited by docs/decisions/037.

PYTHONPATH=src OUT=DIR python3 benchmarks/probes/hostcost.py   (writes DIR/hostcost.txt)
"""

import cProfile
import io
import itertools
import os
import pstats
import time

import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

dev = Device.resolve("cuda")
out = os.environ.get("OUT", ".")


def loop(batches, **kw):
    acc = torch.zeros((), device="cuda")
    with DeviceLoader(batches, dev, narrow=True, **kw) as loader:
        for b in loader:
            if isinstance(b, torch.Tensor):
                acc += b.sum()
            else:
                acc += b[0].sum()
    torch.cuda.synchronize()


def idiom(batches):
    acc = torch.zeros((), device="cuda")
    for b in batches:
        acc += b.pin_memory().to("cuda", non_blocking=True).sum()
    torch.cuda.synchronize()


cases = {
    "256k_pinned": [t.pin_memory() for t in [torch.randn(65536) for _ in range(4)]],
    "256k_pageable": [torch.randn(65536) for _ in range(4)],
    "1m_pageable": [torch.randn(262144) for _ in range(4)],
    "ids_pageable": [torch.randint(0, 50257, (32, 1024)) for _ in range(4)],
}
with open(f"{out}/hostcost.txt", "w") as report:
    for name, distinct in cases.items():
        batches = list(itertools.islice(itertools.cycle(distinct), 2000))
        loop(batches[:50])
        idiom(batches[:50])
        for label, run in (("idiom", idiom), ("ours", loop)):
            started = time.perf_counter()
            run(batches)
            per_batch = (time.perf_counter() - started) / len(batches) * 1e6
            print(f"{name} {label}: {per_batch:.1f} us/batch", file=report, flush=True)
        profile = cProfile.Profile()
        profile.enable()
        loop(batches)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
        print(f"==== {name}\n" + text.getvalue(), file=report, flush=True)
