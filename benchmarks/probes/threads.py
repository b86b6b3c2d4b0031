"""Probe: the same staging copies on the main thread and on a second thread (GPU machine)."""

import threading
import time

import torch

MB = 1 << 20
N = 96
src = [torch.randn(16 * MB) for _ in range(4)]
bufs = [torch.empty(16 * MB).pin_memory() for _ in range(3)]


def loop():
    t0 = time.perf_counter()
    for k in range(N):
        bufs[k % 3].copy_(src[k % 4])
    return round(N * 64 * MB / (time.perf_counter() - t0) / 1e9, 1)


def on_thread(setup=None):
    out = []

    def body():
        if setup:
            setup()
        out.extend([loop(), loop(), loop()])

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


print("main thread", [loop() for _ in range(3)])
print("second thread", on_thread())
print("second thread, 16 torch threads set", on_thread(lambda: torch.set_num_threads(16)))
print("second thread, 8 torch threads", on_thread(lambda: torch.set_num_threads(8)))
print("main thread again", [loop() for _ in range(3)])
torch.set_num_threads(8)
print("main thread, 8 torch threads", [loop() for _ in range(3)])
