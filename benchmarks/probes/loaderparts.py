"""Probe: which part of DeviceLoader slows staging from pageable memory (GPU machine).

PYTHONPATH=src python3 benchmarks/probes/loaderparts.py
"""

import itertools
import json
import queue
import threading
import time

import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

MB = 1 << 20
N = 64
BATCH = 64 * MB
src = [torch.randn(BATCH // 4) for _ in range(4)]
results = {}


def rate(body, repeats=3):
    body()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        body()
        torch.cuda.synchronize()
        out.append(round(N * BATCH / (time.perf_counter() - t0) / 1e9, 1))
    return out


bufs = [torch.empty(BATCH, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
dev = [torch.empty(BATCH, dtype=torch.uint8, device="cuda") for _ in range(2)]
side = torch.cuda.Stream()


def mini_loader(compute):
    """A thread stages into 2 pinned buffers and copies into 2 device slots; the main
    thread takes each slot through a queue and (optionally) reads it."""

    def body():
        ready: queue.Queue = queue.Queue()
        free: queue.Queue = queue.Queue()
        for i in range(2):
            free.put(i)
        done = [torch.cuda.Event() for _ in range(2)]
        consumed = [torch.cuda.Event() for _ in range(2)]
        copied = [torch.cuda.Event() for _ in range(2)]

        def produce():
            for k in range(N):
                i = k % 2
                done[i].synchronize()
                bufs[i].view(torch.float32).copy_(src[k % 4])
                s = free.get()
                with torch.cuda.stream(side):
                    side.wait_event(consumed[s])
                    dev[s].copy_(bufs[i], non_blocking=True)
                    copied[s].record()
                    done[i].record()
                ready.put(s)
            ready.put(None)

        t = threading.Thread(target=produce)
        t.start()
        acc = torch.zeros((), device="cuda")
        held = None
        while True:
            if held is not None:
                consumed[held].record()
                free.put(held)
            s = ready.get()
            if s is None:
                break
            torch.cuda.current_stream().wait_event(copied[s])
            if compute:
                acc += dev[s].view(torch.float32).sum()
            held = s
        t.join()

    return body


def device_loader(compute, timing):
    def body():
        acc = torch.zeros((), device="cuda")
        batches = itertools.islice(itertools.cycle(src), N)
        with DeviceLoader(batches, Device("cuda"), timing=timing) as loader:
            for b in loader:
                if compute:
                    acc += b.sum()

    return body


results["mini loader, no compute"] = rate(mini_loader(False))
results["mini loader, compute"] = rate(mini_loader(True))
results["DeviceLoader, no compute, no timing"] = rate(device_loader(False, False))
results["DeviceLoader, compute, timing"] = rate(device_loader(True, True))
results["mini loader, compute (again)"] = rate(mini_loader(True))
print(json.dumps(results, indent=1))
