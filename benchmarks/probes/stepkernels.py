"""Probe: where a data-parallel captured step's time goes, per rank: the kernels of 20
replays of the preset's step under the profiler, by name (µs per step), and the end of one
step in time order (the update and the collectives after the backward).

    torchrun --standalone --nproc_per_node=2 benchmarks/probes/stepkernels.py PRESET OUT
"""

import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from gpuflow.accounting.crosscheck import DeviceTrace
from gpuflow.device.accelerator import Device
from gpuflow.train import distributed
from gpuflow.train.config import resolve_config
from gpuflow.train.distributed import Ranks
from gpuflow.train.trainer import Trainer

WARMUP, STEPS = 10, 20
preset, out = sys.argv[1], Path(sys.argv[2])
ranks = Ranks.from_env()
device = Device.resolve(f"cuda:{ranks.local_rank}")
distributed.start(ranks, device)
config = resolve_config(preset, None, [f"train.steps={WARMUP + STEPS + 1}"])
with tempfile.TemporaryDirectory() as scratch:
    trainer = Trainer(config, Path(scratch) / "run", device, ranks=ranks)
    trainer.build(resume=False, say=lambda note: None)
    with trainer.open_step(0, WARMUP + STEPS + 1) as step:
        for n in range(WARMUP):
            step(n)
        with DeviceTrace(Path(scratch) / "trace.json", device) as trace:
            for n in range(WARMUP, WARMUP + STEPS):
                step(n)
kernels = sorted((a for a in trace.activity if a.kind == "kernel"), key=lambda a: a.start)
span = (kernels[-1].end - kernels[0].start) / STEPS
by_name: dict[str, float] = defaultdict(float)
for k in kernels:
    by_name[k.name] += (k.end - k.start) / STEPS
# One step's end: the kernels of the last replay from its last backward matmul on.
last = [k for k in kernels if k.start >= kernels[-1].end - span]
tail = last[-25:]
record = {
    "rank": ranks.rank,
    "preset": preset,
    "step_us": span,
    "by_name_us": sorted(by_name.items(), key=lambda item: -item[1])[:30],
    "tail": [
        {"name": k.name[:90], "stream": k.stream, "start_us": k.start - last[0].start,
         "us": k.end - k.start}
        for k in tail
    ],
}  # fmt: skip
out.mkdir(parents=True, exist_ok=True)
(out / f"stepkernels-{preset}-rank{ranks.rank}.json").write_text(json.dumps(record, indent=1))
if ranks.rank == 0:
    print(f"{preset}: {span:.0f} us per step (device span / steps)")
    for name, us in record["by_name_us"][:18]:
        print(f"  {us:7.1f} us  {name[:100]}")
    print("  the step's end, in time order:")
    for k in record["tail"]:
        print(f"  +{k['start_us']:7.1f}  {k['us']:6.1f} us  s{k['stream']}  {k['name'][:80]}")
distributed.stop()
