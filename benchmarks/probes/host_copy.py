"""Probe: where the host side of a transfer spends its time (run on the GPU machine).

    PYTHONPATH=src python3 benchmarks/probes/host_copy.py
"""

import statistics
import threading
import time

import torch

from gpuflow.pack import plan_pack, rebuild, _same_shape_tensors

MB = 1 << 20


def rate(fn, nbytes, repeats=7):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def in_thread(fn, setup=None):
    out = []

    def body():
        if setup:
            setup()
        out.append(fn())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out[0]


n = 64 * MB
src = torch.randn(n // 4)
dst = torch.empty(n // 4, pin_memory=True)
print("threads", torch.get_num_threads())
print("memcpy 64MB main thread GB/s", rate(lambda: dst.copy_(src), n))
print("memcpy 64MB python thread GB/s", in_thread(lambda: rate(lambda: dst.copy_(src), n)))
nt = torch.get_num_threads()
print("memcpy 64MB thread after set_num_threads GB/s",
      in_thread(lambda: rate(lambda: dst.copy_(src), n), lambda: torch.set_num_threads(nt)))
print("numpy copyto main GB/s", rate(lambda: dst.numpy().__setitem__(slice(None), src.numpy()), n))

# Chunked: memcpy chunk k+1 while chunk k crosses.
dev = torch.empty(n // 4, device="cuda")
stream = torch.cuda.Stream()


def chunked(chunks):
    step = (n // 4) // chunks
    for k in range(chunks):
        sl = slice(k * step, (k + 1) * step)
        dst[sl].copy_(src[sl])
        with torch.cuda.stream(stream):
            dev[sl].copy_(dst[sl], non_blocking=True)
    stream.synchronize()


for chunks in (1, 4, 8, 16):
    print(f"pack+h2d 64MB in {chunks} chunks GB/s", rate(lambda c=chunks: chunked(c), n))

# Two threads copying different 64 MB batches at once.
src2, dst2 = torch.randn(n // 4), torch.empty(n // 4, pin_memory=True)


def two_threads():
    ts = [threading.Thread(target=lambda a=a, b=b: a.copy_(b)) for a, b in ((dst, src), (dst2, src2))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


print("two threads memcpy 2x64MB GB/s", rate(two_threads, 2 * n))

# Small tensors: the packed path's pieces.
ts = [torch.randn(1024) for _ in range(1000)]
buf = torch.empty(8 * MB, dtype=torch.uint8, pin_memory=True)


def ms(fn, repeats=20):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 4)


plan = plan_pack(ts)
on_dev = buf[: plan.nbytes].cuda()
print("same-shape check ms", ms(lambda: _same_shape_tensors(ts)))
print("plan ms", ms(lambda: plan_pack(ts)))
print("write (stack) ms", ms(lambda: plan.write_into(buf)))
print("h2d 4MB ms", ms(lambda: on_dev.copy_(buf[: plan.nbytes], non_blocking=True)))
print("rebuild (unbind) ms", ms(lambda: rebuild(on_dev, plan.spec)))
print("1000 separate .to ms", ms(lambda: [t.to("cuda", non_blocking=True) for t in ts]))
print("1000 separate copy_ into preallocated ms",
      ms(lambda: [d.copy_(t, non_blocking=True) for d, t in zip(rebuild(on_dev, plan.spec), ts)]))

print("memcpy 64MB python thread, 5 rounds GB/s",
      in_thread(lambda: [round(rate(lambda: dst.copy_(src), n), 1) for _ in range(5)]))
print("cat 1000 ms", ms(lambda: torch.cat(ts, out=buf[: plan.nbytes].view(torch.float32))))
with torch.no_grad():
    print("rebuild under no_grad ms", ms(lambda: rebuild(on_dev, plan.spec)))
v = on_dev.view(torch.float32).view(1000, 1024)
print("unbind cuda ms", ms(lambda: v.unbind(0)))
print("split cuda ms", ms(lambda: v.split(1)))
vc = buf[: plan.nbytes].view(torch.float32).view(1000, 1024)
print("unbind cpu ms", ms(lambda: vc.unbind(0)))
