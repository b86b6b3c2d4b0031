"""Probe: do pageable batches of 1 MiB and more cross faster when the loader pins them just
before their copy, through torch's copy (so torch's pinned cache takes each block back as
soon as its copy ran), instead of when they are read ahead?

The sweep of ``gpuflow bench transfer`` from pageable memory, loader as it is and with that
change, alternating, with torch's host-memory counters after each.

PYTHONPATH=src python3 benchmarks/probes/pinatissue.py OUT.json
"""

import json
import sys

import torch

from gpuflow.bench.loaders import MB, LoaderBenchConfig, sweep
from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import _Pipeline

device = Device.resolve("cuda")
cfg = LoaderBenchConfig(sizes=(MB, 4 * MB, 16 * MB, 64 * MB), bytes_per_round=2048 * MB, rounds=3)
original_stage, original_copy_bytes = _Pipeline._stage, _Pipeline._copy_bytes


def stage_unpinned(self, crossing):
    """As _stage, but pageable direct sources stay pageable until their copy."""
    crossing.direct_sources = [[s for _, s in plan.direct_pairs()] for plan, _ in crossing.parts]
    if crossing.nbytes == 0:
        return
    crossing.host = self._staging_buffer(crossing.nbytes)
    for plan, offset in crossing.parts:  # small staged parts only in this sweep
        if plan.has_staged:
            plan.write_into(crossing.host.bytes, offset)


def copy_bytes_pin_late(self, out, source, nbytes, stream):
    if source.is_pinned():
        return original_copy_bytes(self, out, source, nbytes, stream)
    self.counts["copies"] += 1
    out.copy_(source.pin_memory(), non_blocking=True)  # torch records the block's event
    return False


results = {}
for label, patched in (("as-is", False), ("pin-at-issue", True), ("as-is again", False),
                       ("pin-at-issue again", True)):  # fmt: skip
    _Pipeline._stage = stage_unpinned if patched else original_stage
    _Pipeline._copy_bytes = copy_bytes_pin_late if patched else original_copy_bytes
    torch.cuda.synchronize()
    rows = [r for r in sweep(device, cfg) if r["source"] == "pageable"]
    stats = torch.cuda.host_memory_stats()
    results[label] = {"rows": rows, "host_memory": dict(stats)}
    for r in rows:
        print(
            f"{label:18s} {r['batch_bytes'] >> 20:3d} MiB pageable: pin_to "
            f"{r['pin_to_gb_s']:.1f} GB/s, dataloader {r['dataloader_gb_s']:.1f}, ours "
            f"{r['deviceloader_gb_s']:.1f} GB/s = {r['vs_fastest_idiom']:.2f}x fastest idiom"
        )
    keys = ("num_host", "segment.all.current", "allocated_bytes.all.peak")
    print("  host memory:", {k: v for k, v in stats.items() if k.startswith(keys)})
_Pipeline._stage, _Pipeline._copy_bytes = original_stage, original_copy_bytes
with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=1, default=str)
