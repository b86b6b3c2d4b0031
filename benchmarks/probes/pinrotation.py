"""Probe: does the loader's hold on pinned sources cost the pageable rows of 16 MiB and more?

The loader keeps each pinned source until its copy's event has completed, checking only once
``depth + 1`` crossings wait; torch's pinned cache then rotates over more blocks than the
idiom's. The sweep of ``gpuflow bench transfer`` at 16 and 64 MiB from pageable memory, run
with the loader as it is and with every completed source let go before each copy, with
torch's host-memory counters after each.

PYTHONPATH=src python3 benchmarks/probes/pinrotation.py OUT.json
"""

import json
import sys

import torch

from gpuflow.bench.loaders import MB, LoaderBenchConfig, sweep
from gpuflow.device.accelerator import Device
from gpuflow.transfer.issuing import Issuer

device = Device.resolve("cuda")
cfg = LoaderBenchConfig(sizes=(16 * MB, 64 * MB), bytes_per_round=2048 * MB, rounds=5)
original = Issuer.issue


def eager_issue(self, crossing, key):
    while self.sources_in_flight and self.sources_in_flight[0][0].query():
        self.sources_in_flight.popleft()
    return original(self, crossing, key)


results = {}
for label, issue in (
    ("as-is", original),
    ("eager-release", eager_issue),
    ("as-is again", original),
):
    Issuer.issue = issue
    rows = [r for r in sweep(device, cfg) if r["source"] == "pageable"]
    stats = torch.cuda.host_memory_stats()
    results[label] = {
        "rows": rows,
        "host_memory": {k: v for k, v in stats.items() if "allocation" in k or "segment" in k},
    }
    for r in rows:
        print(
            f"{label:14s} {r['batch_bytes'] >> 20:3d} MiB pageable: pin_to "
            f"{r['pin_to_gb_s']:.1f} GB/s, ours {r['deviceloader_gb_s']:.1f} GB/s = "
            f"{r['vs_fastest_idiom']:.2f}x fastest idiom"
        )
    print(
        "  host memory:",
        {k: v for k, v in stats.items() if k.startswith(("allocation", "segment", "num_host"))},
    )
Issuer.issue = original
with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=1, default=str)
