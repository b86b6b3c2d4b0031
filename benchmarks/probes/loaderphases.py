"""Probe: the training thread's time in each part of ``DeviceLoader.__next__`` in the image
loop at 3.1 MB batches (a ``DataLoader`` with 6 workers as the source, read by the loader's
reader thread), per step: the reader's queue, planning, staging, issuing copies, handing out.

PYTHONPATH=src python3 benchmarks/probes/loaderphases.py OUT.json
"""

import json
import sys
import time
from collections import defaultdict

import torch

from gpuflow.bench.loaders import SyntheticImages, small_cnn
from gpuflow.device.accelerator import Device
from gpuflow.transfer import pipeline as pipeline_module
from gpuflow.transfer.issuing import Issuer
from gpuflow.transfer.loader import DeviceLoader
from gpuflow.transfer.packing import Planner
from gpuflow.transfer.pipeline import Pipeline
from gpuflow.transfer.reader import ThreadedSource
from gpuflow.transfer.staging import Stager

device = Device.resolve("cuda")
dev = device.torch
spent: dict[str, float] = defaultdict(float)


def timed(owner, name, label):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t0

    is_static = isinstance(vars(owner).get(name), staticmethod)
    setattr(owner, name, staticmethod(wrapper) if is_static else wrapper)


timed(ThreadedSource, "__next__", "reader queue get")
timed(Planner, "plan_pack", "plan_pack")
timed(Stager, "_stage_part", "stage (pin, write)")
timed(Issuer, "issue", "issue (alloc, copy, event)")
timed(Issuer, "_rebuild", "rebuild (views, widen)")
timed(Pipeline, "take", "take (incl. rebuild)")
timed(Pipeline, "top_up", "top_up (incl. queue, plan, stage)")
timed(Pipeline, "issue_ready", "issue_ready")
timed(DeviceLoader, "_let_go_of_held", "let go of held")
timed(DeviceLoader, "_next_of", "next batch total")
timed(pipeline_module, "report_copy", "report_copy")

model = small_cnn().to(dev).to(memory_format=torch.channels_last)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
steps, batch_size = 300, 256
data = SyntheticImages(batch_size * steps, 64)
results = {}
for narrow in (True, False, True):
    spent.clear()
    source = torch.utils.data.DataLoader(
        data, batch_size=batch_size, num_workers=6, persistent_workers=False, prefetch_factor=4
    )
    loop = 0.0
    with DeviceLoader(source, device, narrow=narrow) as loader:
        started = time.perf_counter()
        for batch in loader:
            x = batch["image"].float().div_(255)
            with device.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        device.synchronize()
        loop = time.perf_counter() - started
    per = {k: v / steps * 1e3 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    results[f"narrow={narrow}"] = {"loop_ms_per_step": loop / steps * 1e3, "ms_per_step": per}
    print(f"narrow={narrow}: {loop / steps * 1e3:.3f} ms per step (first steps included)")
    for k, v in per.items():
        print(f"  {k:36s} {v:.3f} ms")
with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=1)
