"""Probe: the device time of a `gpuflow profile` trace by kernel name, largest first.

PYTHONPATH=src python3 benchmarks/probes/kernels.py runs/profile-seed-d384/trace.json [steps]
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

from gpuflow.accounting.crosscheck import device_activity

trace = json.loads(Path(sys.argv[1]).read_text())
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
names = {}
for e in trace.get("traceEvents", []):
    if e.get("ph") == "X" and e.get("cat") == "kernel":
        names[(float(e["ts"]), int(e.get("args", {}).get("stream", e.get("tid", 0)) or 0))] = e[
            "name"
        ]
total = defaultdict(float)
count = defaultdict(int)
for a in device_activity(trace):
    if a.kind == "kernel":
        name = names.get((a.start, a.stream), "?")[:90]
        total[name] += a.end - a.start
        count[name] += 1
busy = sum(total.values())
per_step = sum(count.values()) / steps
print(f"kernels: {per_step:.0f} per step, {busy / steps / 1e3:.3f} ms busy per step")
for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:45]:
    print(f"{us / steps:9.1f} us/step {us / busy:6.1%} x{count[name] // steps:<3} {name}")
