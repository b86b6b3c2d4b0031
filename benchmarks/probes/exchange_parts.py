"""Where the four-GPU split update's exchange spends its time, part by part, at a preset's
size: each part captured in a CUDA graph of its own and replayed, timed by events on every
rank. Run under ``torchrun --nproc_per_node=4`` on GPUs that map each other's memory;
writes one JSON line per part (rank 0) to the path given.

    torchrun --nproc_per_node=4 benchmarks/probes/exchange_parts.py seed-d384 out.jsonl
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from gpuflow.model.gpt import GPT
from gpuflow.train.config import preset
from gpuflow.train.peer_memory import PeerAverage, SharedBuffer


@triton.jit
def average_variant(
    local,
    peer_addrs,
    partial_sq,
    start,
    numel,
    world_size,
    BLOCK: tl.constexpr,
    N_PEERS: tl.constexpr,
    HINT: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    idx = start + offs
    total = tl.load(local + idx, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(N_PEERS):
        addr = tl.load(peer_addrs + j)
        if HINT:
            addr = tl.multiple_of(addr, 16)
        peer = addr.to(tl.pointer_type(tl.bfloat16))
        total += tl.load(peer + idx, mask=mask, other=0.0).to(tl.float32)
    mean = (total / world_size).to(tl.bfloat16)
    tl.store(local + idx, mean, mask=mask)
    m = mean.to(tl.float32)
    tl.store(partial_sq + pid, tl.sum(m * m, axis=0))


@triton.jit
def write_variant(
    source,
    weights,
    peer_addrs,
    start,
    numel,
    BLOCK: tl.constexpr,
    N_PEERS: tl.constexpr,
    HINT: tl.constexpr,
):
    # the update's stores: its part of the new weights into its copy and every peer's
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    w = tl.load(source + offs, mask=mask).to(tl.bfloat16)
    idx = start + offs
    tl.store(weights + idx, w, mask=mask)
    for j in tl.static_range(N_PEERS):
        addr = tl.load(peer_addrs + j)
        if HINT:
            addr = tl.multiple_of(addr, 16)
        peer = addr.to(tl.pointer_type(tl.bfloat16))
        tl.store(peer + idx, w, mask=mask)


REPLAYS = 200


def timed(name: str, body, out: list[dict]) -> None:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / REPLAYS)
        dist.barrier()
    us = torch.tensor([statistics.median(times)], device="cuda")
    every = [torch.zeros_like(us) for _ in range(dist.get_world_size())]
    dist.all_gather(every, us)
    out.append({"part": name, "us_per_rank": [round(float(t), 2) for t in every]})
    del graph


def main() -> None:
    name, path = sys.argv[1], sys.argv[2]
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT(preset(name).model)
    shapes = [p.shape for p in model.parameters()]
    n = sum(p.numel() for p in model.parameters())
    n += -n % (8 * world)
    part = n // world
    lo, hi = rank * part, (rank + 1) * part
    grads = SharedBuffer.shared(n, torch.bfloat16, torch.device("cuda", local))
    weights = SharedBuffer.shared(n, torch.bfloat16, torch.device("cuda", local))
    assert grads is not None and weights is not None, "no peer memory here"
    average = PeerAverage(grads, lo, hi, world)
    made = [torch.randn(s, device="cuda").to(torch.bfloat16) for s in shapes]
    views, at = [], 0
    for s in shapes:
        k = torch.Size(s).numel()
        views.append(grads.local[at : at + k].view(s))
        at += k
    one = torch.zeros(1, device="cuda")
    two = torch.zeros(2, device="cuda")
    out: list[dict] = []
    from torch.distributed import _symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    small = symm_mem.empty(64, dtype=torch.float32, device="cuda")
    small_handle = symm_mem.rendezvous(small, group)

    def writes() -> None:
        for peer in weights.peers:
            peer[lo:hi].copy_(weights.local[lo:hi])

    timed("nccl all_reduce 1 float", lambda: dist.all_reduce(one), out)
    timed("nccl all_reduce 2 floats", lambda: dist.all_reduce(two), out)
    timed("3 nccl all_reduces", lambda: [dist.all_reduce(one) for _ in range(3)], out)
    timed(
        "gradients copied into the buffer (foreach)", lambda: torch._foreach_copy_(views, made), out
    )
    timed("peer average of this rank's part", average, out)
    timed("weights written into the peers' copies (copy_)", writes, out)
    timed("symm_mem barrier", lambda: small_handle.barrier(channel=0), out)
    timed("3 symm_mem barriers", lambda: [small_handle.barrier(channel=0) for _ in range(3)], out)
    try:
        timed(
            "symm_mem one_shot_all_reduce 2 floats",
            lambda: torch.ops.symm_mem.one_shot_all_reduce(small[:2], "sum", group),
            out,
        )
    except Exception as exc:
        out.append({"part": "one_shot_all_reduce", "error": repr(exc)[:200]})

    master = torch.randn(part, device="cuda")
    sq = torch.zeros(triton.cdiv(part, 512), device="cuda")
    for hint in (False, True):
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                grid = (triton.cdiv(part, block),)

                def avg(block=block, warps=warps, hint=hint, grid=grid) -> None:
                    average_variant[grid](
                        grads.local,
                        grads.peer_table.tensor,
                        sq,
                        lo,
                        part,
                        float(world),
                        BLOCK=block,
                        N_PEERS=world - 1,
                        HINT=hint,
                        num_warps=warps,
                    )

                def wr(block=block, warps=warps, hint=hint, grid=grid) -> None:
                    write_variant[grid](
                        master,
                        weights.local,
                        weights.peer_table.tensor,
                        lo,
                        part,
                        BLOCK=block,
                        N_PEERS=world - 1,
                        HINT=hint,
                        num_warps=warps,
                    )

                timed(f"average kernel hint={hint} block={block} warps={warps}", avg, out)
                timed(f"write kernel hint={hint} block={block} warps={warps}", wr, out)

    def exchange() -> None:
        torch._foreach_copy_(views, made)
        dist.all_reduce(one)
        sum_sq = average()
        dist.all_reduce(sum_sq)
        writes()
        dist.all_reduce(one)

    timed("exchange as the step runs it (less the update's math)", exchange, out)

    def exchange_barriers() -> None:
        torch._foreach_copy_(views, made)
        small_handle.barrier(channel=0)
        average()
        small_handle.barrier(channel=0)
        writes()
        small_handle.barrier(channel=0)

    timed("the same, meeting at symm_mem barriers", exchange_barriers, out)
    if rank == 0:
        with open(path, "w") as f:
            for row in out:
                row.update(
                    preset=name,
                    world_size=world,
                    elements=n,
                    device=torch.cuda.get_device_name(),
                    torch=torch.__version__,
                )
                f.write(json.dumps(row) + "\n")
                print(json.dumps(row))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
