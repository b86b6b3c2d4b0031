"""Probe: DeviceLoader lifetimes on a real device, each in a process of its own.

raise: an exception inside a loop without `with` (the process must exit 1, not abort);
abandon: three loaders dropped mid-epoch (threads and pinned memory back to where they were);
exit: the interpreter leaves while a loader's thread is mid-epoch.

PYTHONPATH=src python3 benchmarks/probes/lifetimes.py
"""

import subprocess
import sys

CASES = {
    "raise": """
import torch
from gpuflow import DeviceLoader
batches = (torch.zeros(1 << 20) for _ in range(10**6))
for i, b in enumerate(DeviceLoader(batches, "cuda")):
    if i == 20:
        raise ValueError("the loop failed")
""",
    "abandon": """
import gc, threading, torch
from gpuflow import DeviceLoader
def threads():
    return sum(t.name == "gpuflow-loader" for t in threading.enumerate())
def pinned():
    torch.cuda.synchronize()
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) >> 20
start = threads()
for n in range(3):
    loader = DeviceLoader((torch.zeros(64 << 20, dtype=torch.uint8) for _ in range(100)), "cuda")
    for i, b in enumerate(loader):
        if i == 5:
            break
    del loader, b
    gc.collect()
    print(f"after {n + 1} dropped: {threads()} loader threads, {pinned()} MiB pinned in use")
""",
    "exit": """
import torch
from gpuflow import DeviceLoader
loader = DeviceLoader((torch.zeros(1 << 20) for _ in range(10**6)), "cuda")
next(loader)
print("leaving with the loader running")
""",
}

for name, code in CASES.items():
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    tail = (done.stdout + done.stderr).strip().splitlines()[-2:]
    print(f"{name}: exit {done.returncode}: {' | '.join(tail)}", flush=True)
