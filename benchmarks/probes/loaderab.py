"""Probe: DataLoader(pin_memory=True) and DeviceLoader from pageable memory, alternated, so
the host's drifting copy speed hits both alike (GPU machine).

PYTHONPATH=src python3 benchmarks/probes/loaderab.py
"""

import itertools
import json
import statistics
import threading

import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

MB = 1 << 20
N, WARM = 56, 8
src = [torch.randn(16 * MB) for _ in range(4)]
dev = Device("cuda")


def steady(batches):
    acc = torch.zeros((), device="cuda")
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i, b in enumerate(batches):
        if i == WARM:
            first.record()
        acc += b.sum()
    last.record()
    last.synchronize()
    return round((N - WARM) * 64 * MB / (first.elapsed_time(last) * 1e6), 1)


def dataloader():
    loader = torch.utils.data.DataLoader(
        list(itertools.islice(itertools.cycle(src), N)), batch_size=None, pin_memory=True
    )
    return steady(b.to("cuda", non_blocking=True) for b in loader)


def deviceloader(**options):
    def run():
        with DeviceLoader(itertools.islice(itertools.cycle(src), N), dev, **options) as loader:
            return steady(loader)

    return run


threads_seen = []
threading.Thread(target=lambda: threads_seen.append(torch.get_num_threads())).start()
runs = {
    "dataloader": dataloader,
    "deviceloader": deviceloader(),
    "deviceloader, no timing": deviceloader(timing=False),
}
rates = {name: [] for name in runs}
for _ in range(5):
    for name, run in runs.items():
        rates[name].append(run())
print(
    json.dumps(
        {
            "torch threads: main, new thread": [torch.get_num_threads(), *threads_seen],
            "GB/s per round": rates,
            "median": {k: statistics.median(v) for k, v in rates.items()},
        },
        indent=1,
    )
)
