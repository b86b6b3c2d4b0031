"""Probe: 64 MB pinned copies back to back on one stream vs a side stream with events."""

import itertools
import time

import torch

from gpuflow.device import Device
from gpuflow.loader import DeviceLoader

MB = 1 << 20
N, W = 64, 8
src = [torch.randn(16 * MB).pin_memory() for _ in range(4)]
dev = [torch.empty(16 * MB, device="cuda") for _ in range(2)]
acc = torch.zeros((), device="cuda")


def timed(body):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    body()
    torch.cuda.synchronize()
    return round(N * 64 * MB / (time.perf_counter() - t0) / 1e9, 1)


def one_stream():
    for k in range(N):
        d = dev[k % 2]
        d.copy_(src[k % 4], non_blocking=True)
        acc.add_(d.sum())


side = torch.cuda.Stream()
copied = [torch.cuda.Event() for _ in range(2)]
used = [torch.cuda.Event() for _ in range(2)]


def two_streams():
    main = torch.cuda.current_stream()
    for k in range(N):
        s = k % 2
        with torch.cuda.stream(side):
            side.wait_event(used[s])
            dev[s].copy_(src[k % 4], non_blocking=True)
            copied[s].record(side)
        main.wait_event(copied[s])
        acc.add_(dev[s].sum())
        used[s].record(main)


def loader(**kw):
    def body():
        with DeviceLoader(itertools.islice(itertools.cycle(src), N), Device("cuda"), **kw) as ld:
            for b in ld:
                acc.add_(b.sum())
    return body


for _ in range(2):
    print("one stream", timed(one_stream), "two streams", timed(two_streams),
          "loader", timed(loader()), "loader depth 4", timed(loader(depth=4)),
          "loader no timing", timed(loader(timing=False)))
dl = torch.utils.data.DataLoader(src * 16, batch_size=None, pin_memory=True)
print("dataloader", timed(lambda: [acc.add_(b.to("cuda", non_blocking=True).sum()) for b in dl]))
print("loader after dataloader", timed(loader()))
