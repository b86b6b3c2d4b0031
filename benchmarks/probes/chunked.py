"""Probe: stage pageable 64 MiB batches through a small ring of pinned chunks (each chunk's
host->device copy queued as soon as it is written) versus whole-batch pinned buffers.

PYTHONPATH=src python3 benchmarks/probes/chunked.py
"""

import json
import threading
import time

import torch

MB = 1 << 20
N = 64
BATCH = 64 * MB
src = [torch.randn(BATCH // 4) for _ in range(4)]  # pageable, as a dataset yields them
dev = [torch.empty(BATCH, dtype=torch.uint8, device="cuda") for _ in range(2)]
side = torch.cuda.Stream()
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


def whole(nbuf):
    bufs = [torch.empty(BATCH, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)]
    done = [torch.cuda.Event() for _ in range(nbuf)]

    def body():
        for k in range(N):
            i = k % nbuf
            done[i].synchronize()
            bufs[i].view(torch.float32).copy_(src[k % 4])
            with torch.cuda.stream(side):
                dev[k % 2].copy_(bufs[i], non_blocking=True)
                done[i].record()

    return body


def chunked(chunk, ring):
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(ring)]
    done = [torch.cuda.Event() for _ in range(ring)]

    def body():
        j = 0
        for k in range(N):
            flat = src[k % 4].view(torch.uint8)
            for start in range(0, BATCH, chunk):
                i = j % ring
                j += 1
                done[i].synchronize()
                bufs[i].copy_(flat[start : start + chunk])
                with torch.cuda.stream(side):
                    dev[k % 2][start : start + chunk].copy_(bufs[i], non_blocking=True)
                    done[i].record()

    return body


def in_thread(body):
    def run():
        t = threading.Thread(target=body)
        t.start()
        t.join()

    return run


results["whole, 2 buffers"] = rate(whole(2))
results["whole, 3 buffers"] = rate(whole(3))
for chunk in (1 * MB, 4 * MB, 8 * MB, 16 * MB):
    for ring in (2, 4, 8):
        results[f"chunk {chunk // MB} MiB x {ring}"] = rate(chunked(chunk, ring))
results["chunk 4 MiB x 4, second thread"] = rate(in_thread(chunked(4 * MB, 4)))
results["whole, 3 buffers, second thread"] = rate(in_thread(whole(3)))
print(json.dumps(results, indent=1))
