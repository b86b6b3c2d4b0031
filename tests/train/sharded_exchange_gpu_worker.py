"""A rank of ``test_four_gpus_gpu.py``'s exchange check, run under ``torchrun``: the split
update's averager over peer memory against NCCL's own all-reduce, two steps of different
gradients on every rank, and a meet that rank 0 alone comes to, which must wait until
that rank leaves the job; writes what it found to ``OUT/rank<N>.json``.

    torchrun --nproc_per_node=N tests/train/sharded_exchange_gpu_worker.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpuflow.model.gpt import GPT, ModelConfig
from gpuflow.train.optim.master_adamw import MasterAdamW
from gpuflow.train.peer_meet import PeerMeet, end_waits
from gpuflow.train.sharded import ShardedAverager


def main() -> None:
    out = Path(sys.argv[1])
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=1000, n_layer=2, n_head=2, d_model=72, max_len=64))
    opt = MasterAdamW(torch.optim.AdamW(model.to(device).parameters(), fused=True), (rank, world))
    averager = ShardedAverager(opt, peer_memory=True)
    lo, hi = opt.shard_range
    found = {"exchange": averager.exchange, "steps": []}
    for step in range(2):
        gen = torch.Generator(device=device).manual_seed(1000 * step + rank)
        grads = [torch.randn(p.shape, device=device, generator=gen).bfloat16() for p in opt.params]
        whole = torch.zeros(opt.weights.numel(), device=device)  # (N,) fp32, the mean
        at = 0
        for g in grads:
            whole[at : at + g.numel()] = g.float().reshape(-1)
            at += -(-g.numel() // 8) * 8
        dist.all_reduce(whole)
        want = (whole / world).bfloat16()
        for p, g in zip(opt.params, grads, strict=True):
            p.grad = g.clone()
        loss = torch.tensor(float(rank + 1), device=device)
        part = averager(opt.params, loss)[0]
        norm = averager.grad_norm([part])
        averager.after_step()
        torch.cuda.synchronize()
        found["steps"].append({
            "part_equal": bool(torch.equal(part, want[lo:hi])),
            "part_max_diff": float((part.float() - want[lo:hi].float()).abs().max()),
            "norm": float(norm),
            "want_norm": float(want.float().norm()),
            "loss": float(loss),
            "want_loss": (world + 1) / 2,
        })  # fmt: skip
    meet = PeerMeet.make(rank, world, device)
    if rank == 0:  # the others never come: the wait ends only when this process leaves
        leave = threading.Timer(1.0, end_waits)
        began = time.perf_counter()
        meet(0)
        leave.start()
        torch.cuda.synchronize()
        found["lone_meet_s"] = time.perf_counter() - began
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
