"""Probe: staging pageable 64 MB batches through pinned buffers, plain torch, one thread.

PYTHONPATH=src python3 benchmarks/probes/staging.py
"""

import time

import torch

MB = 1 << 20
N = 96
src = [torch.randn(16 * MB) for _ in range(4)]
dev = [torch.empty(16 * MB, device="cuda") for _ in range(2)]
side = torch.cuda.Stream()
acc = torch.zeros((), device="cuda")


def timed(body):
    body()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    body()
    torch.cuda.synchronize()
    return round(N * 64 * MB / (time.perf_counter() - t0) / 1e9, 1)


def rotating(nbuf):
    bufs = [torch.empty(16 * MB).pin_memory() for _ in range(nbuf)]
    done = [torch.cuda.Event() for _ in range(nbuf)]

    def body():
        for k in range(N):
            i = k % nbuf
            done[i].synchronize()  # its last copy has read it
            bufs[i].copy_(src[k % 4])
            d = dev[k % 2]
            d.copy_(bufs[i], non_blocking=True)
            done[i].record()
            acc.add_(d.sum())

    return body


def fresh():
    for k in range(N):
        d = dev[k % 2]
        d.copy_(src[k % 4].pin_memory(), non_blocking=True)
        acc.add_(d.sum())


def memcpy_only(nbuf):
    bufs = [torch.empty(16 * MB).pin_memory() for _ in range(nbuf)]

    def body():
        for k in range(N):
            bufs[k % nbuf].copy_(src[k % 4])

    return body


print("memcpy only, 3 buffers", timed(memcpy_only(3)))
print("memcpy only, 16 buffers", timed(memcpy_only(16)))
print("fresh pin_memory()", timed(fresh))
for nbuf in (2, 3, 4, 8):
    print(f"rotating {nbuf} pinned buffers", timed(rotating(nbuf)))
