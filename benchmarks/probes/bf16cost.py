"""Probe: where a 1024 x 1024 fp32 batch read as bf16 spends host time: the range check
(``aminmax``), the conversion (``.to(bfloat16)``, and ``copy_`` into pinned bf16 memory on
this thread and on a thread of its own), pinning the fp32 tensor, an ``isinf`` check of the
bf16 result; then DeviceLoader (``lossy_float="bf16"``) and the idiom
(``.pin_memory().to()`` then bf16 on the device) over 400 batches, host us per batch. Ran
with the conversion on DeviceLoader's writer threads. Cited by docs/decisions/041.

PYTHONPATH=src python3 benchmarks/probes/bf16cost.py
"""

import itertools
import threading
import time

import torch

from gpuflow.device.accelerator import Device
from gpuflow.transfer.loader import DeviceLoader

dev = Device.resolve("cuda")
x = torch.randn(1024, 1024)
pinned_bf = torch.empty(1024, 1024, dtype=torch.bfloat16, pin_memory=True)


def per_call_us(f, n=200):
    f()
    started = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - started) / n * 1e6


print("threads", torch.get_num_threads())
print("aminmax us", per_call_us(lambda: torch.aminmax(x)))
print("to(bf16) us", per_call_us(lambda: x.to(torch.bfloat16)))
print("copy_ into pinned bf16 us", per_call_us(lambda: pinned_bf.copy_(x)))
print("pin_memory fp32 us", per_call_us(lambda: x.pin_memory()))
print("isinf check on bf16 us", per_call_us(lambda: torch.isinf(pinned_bf).any()))
on_thread = {}


def convert_on_a_thread():
    on_thread["thread copy_ us"] = per_call_us(lambda: pinned_bf.copy_(x))


worker = threading.Thread(target=convert_on_a_thread)
worker.start()
worker.join()
print(on_thread)
distinct = [torch.randn(1024, 1024) for _ in range(4)]
batches = list(itertools.islice(itertools.cycle(distinct), 400))


def ours():
    acc = torch.zeros((), device="cuda")
    with DeviceLoader(batches, dev, lossy_float="bf16") as loader:
        for b in loader:
            acc += b[0, 0].float()
    torch.cuda.synchronize()


def idiom():
    acc = torch.zeros((), device="cuda")
    for b in batches:
        acc += b.pin_memory().to("cuda", non_blocking=True).to(torch.bfloat16)[0, 0].float()
    torch.cuda.synchronize()


for run in (ours, idiom):
    run()
    started = time.perf_counter()
    run()
    print(run.__name__, (time.perf_counter() - started) / 400 * 1e6, "us/batch")
