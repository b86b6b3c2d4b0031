"""Probe: NCCL's all-reduce (average, bf16) between two GPUs at the captured step's sizes, as
the step runs it (captured in a CUDA graph, 20 per replay, timed with events), by the
number of thread blocks NCCL may use (``min_ctas``/``max_ctas``; default: NCCL's choice).

    torchrun --standalone --nproc_per_node=2 benchmarks/probes/allreduce.py OUT.json
"""

import json
import os
import sys

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
MIB = 1 << 20
SIZES = [3.5, 7, 12, 16, 34]  # MiB: a seed-d384 block, two, the token table, half, all
rows = []
for ctas in (None, 8, 16, 32, 64):
    options = dist.ProcessGroupNCCL.Options()
    if ctas is not None:
        options.config.min_ctas = ctas
        options.config.max_ctas = ctas
    group = dist.new_group([0, 1], pg_options=options)
    for mib in SIZES:
        x = torch.randn(int(mib * MIB) // 2, device="cuda", dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                dist.all_reduce(x, op=dist.ReduceOp.AVG, group=group)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                dist.all_reduce(x, op=dist.ReduceOp.AVG, group=group)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 20)
        ms = sorted(times)[len(times) // 2]
        row = {"ctas": ctas, "mib": mib, "us": ms * 1e3, "gb_per_s": mib * MIB / (ms * 1e6)}
        rows.append(row)
        if rank == 0:
            print(f"ctas {ctas!s:>4}  {mib:5.1f} MiB  {row['us']:7.1f} us  "
                  f"{row['gb_per_s']:6.1f} GB/s", flush=True)  # fmt: skip
        graph.reset()
    dist.destroy_process_group(group)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"nccl": list(torch.cuda.nccl.version()), "rows": rows}, f, indent=1)
dist.destroy_process_group()
