# ruff: noqa: B023  (each closure runs inside the iteration that made it)
"""Probe: how fast pageable bytes reach pinned staging memory, by who copies them.

Main-thread torch ``copy_`` (intra-op threads), torch ``copy_`` jobs on N threads, and
``ctypes.memmove`` jobs on N threads (one plain memcpy each, interpreter lock released),
for 4 and 64 MiB batches; then the host price of a few calls the loader makes per batch.

PYTHONPATH=src python3 benchmarks/probes/writes.py
"""

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor

import torch

MB = 1 << 20


def rate(nbytes, fn, n=20):
    fn()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return nbytes * n / (time.perf_counter() - started) / 1e9


def chunks(nbytes, chunk):
    return [(b, min(b + chunk, nbytes)) for b in range(0, nbytes, chunk)]


print(f"torch {torch.__version__}, intra-op threads {torch.get_num_threads()}")


def measure(size):
    src = torch.randn(size // 4).view(torch.uint8)
    dst = torch.empty(size, dtype=torch.uint8).pin_memory()
    print(f"== {size // MB} MiB pageable -> pinned")
    print(f"  main thread copy_           {rate(size, lambda: dst.copy_(src)):6.1f} GB/s")
    print(
        f"  main thread memmove         "
        f"{rate(size, lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), size)):6.1f} GB/s"
    )
    for threads in (1, 2, 4, 8):
        pool = ThreadPoolExecutor(threads)
        for chunk in (512 << 10, 4 * MB):
            parts = chunks(size, chunk)
            if len(parts) < threads and threads > 1:
                continue

            def torch_jobs():
                list(pool.map(lambda be: dst[be[0] : be[1]].copy_(src[be[0] : be[1]]), parts))

            d, s = dst.data_ptr(), src.data_ptr()

            def memmove_jobs():
                list(
                    pool.map(lambda be: ctypes.memmove(d + be[0], s + be[0], be[1] - be[0]), parts)
                )

            print(
                f"  {threads} threads {chunk >> 10:5d} KiB jobs: copy_ "
                f"{rate(size, torch_jobs):6.1f}  memmove {rate(size, memmove_jobs):6.1f} GB/s"
            )
        pool.shutdown()


for size in (MB, 4 * MB, 64 * MB):
    measure(size)

dev = torch.device("cuda")
s = torch.cuda.Stream()
cur = torch.cuda.current_stream()
ev = torch.cuda.Event()
x = torch.randn(2048).pin_memory()
big = torch.randn(1 << 18).pin_memory()
buf = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
key = torch._C._cuda_getCurrentStream(0)


def per_call_us(fn, n=5000):
    fn()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


calls = {
    "ev.record()": lambda: ev.record(),
    "ev.record(stream)": lambda: ev.record(cur),
    "torch.cuda.Event()": lambda: torch.cuda.Event(),
    "_cuda_getCurrentStream": lambda: torch._C._cuda_getCurrentStream(0),
    "x.to(dev, nb) 8 KiB pinned": lambda: x.to(dev, non_blocking=True),
    "big.to(dev, nb) 1 MiB pinned": lambda: big.to(dev, non_blocking=True),
    "empty+copy_ 1 MiB pinned": lambda: torch.empty(1 << 20, dtype=torch.uint8, device=dev).copy_(
        big.view(torch.uint8), non_blocking=True
    ),
    "buf.as_strided 32x(2048) + unbind": lambda: (
        buf.view(torch.float32).as_strided((32, 2048), (2052, 1), 0).unbind(0)
    ),
    "buf[a:b].view(f32).view(shape)": lambda: buf[16:8208].view(torch.float32).view((2048,)),
    "t.sum() 8 KiB": lambda: buf[:8192].view(torch.float32).sum(),
}
for name, fn in calls.items():
    print(f"{name:36s} {per_call_us(fn):6.2f} us")
