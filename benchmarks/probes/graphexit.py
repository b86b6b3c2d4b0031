"""Probe: why a 2-GPU job whose step was captured never exited. Each rank captures an
all-reduce in a CUDA graph, replays it, then leaves the process group with the graph still
alive (``keep``) or freed first (``release``); a thread reports if the destroy has not
returned after 10 s (NCCL's finalize waits for every graph that captured its communicator).

    torchrun --standalone --nproc_per_node=2 benchmarks/probes/graphexit.py keep|release
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist

mode = sys.argv[1]
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
x = torch.ones(1 << 22, device="cuda", dtype=torch.bfloat16)  # (4M,) 8 MB
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    dist.all_reduce(x)  # warm-up outside the capture
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    dist.all_reduce(x)
for _ in range(3):
    graph.replay()
torch.cuda.synchronize()
if mode == "release":
    graph.reset()


def report() -> None:
    time.sleep(10)
    print(f"rank {rank} ({mode}): destroy_process_group has not returned after 10 s", flush=True)
    os._exit(3)


threading.Thread(target=report, daemon=True).start()
started = time.perf_counter()
dist.destroy_process_group()
print(f"rank {rank} ({mode}): left the group in {time.perf_counter() - started:.3f} s", flush=True)
