"""The four-GPU split update's exchange, whole, built three ways at a preset's size, each
captured in a CUDA graph and replayed, timed on every rank:

- as the step runs it: gradients copied into this rank's buffer, NCCL all-reduce (meet),
  the owner reads its part from every copy, NCCL all-reduce of the norm, the update (which
  writes every copy of its weights), NCCL all-reduce (meet);
- the same with the meets made by a Triton kernel on signal flags in memory every rank maps,
  which gives up waiting once a flag in host memory is set (the job's abort);
- gradients pushed: each rank copies each part of its gradients into that part's owner's
  buffer (one row a sender), the owner sums its rows locally; meets by the kernel.

Also the update kernel's block and warps, and the meet kernel's abort (a rank waits for a
meet no other rank comes to; the host sets the flag; the wait must end).

    torchrun --nproc_per_node=4 benchmarks/probes/exchange_variants.py seed-d384 out.jsonl
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from gpuflow.model.gpt import GPT
from gpuflow.train.config import preset
from gpuflow.train.optim import master_adamw
from gpuflow.train.optim.master_adamw import MasterAdamW
from gpuflow.train.peer_memory import PeerAverage, SharedBuffer

REPLAYS = 200


@triton.jit
def meet_kernel(
    pads,  # (W,) int64: each rank's flags, (CHANNELS * W,) int32
    slots,  # (W,) int64: each rank's value slots, (W * K,) fp32
    values,  # (K,) fp32: this rank's values; their sums over the ranks on return
    abort_addr,  # int64: an int32 in host memory, nonzero once the job aborts
    rank,
    channel,
    W: tl.constexpr,
    K: tl.constexpr,
    VALUES: tl.constexpr,
):
    ks = tl.arange(0, K)
    if VALUES:
        mine = tl.load(values + ks)
        for j in tl.static_range(W):
            slot = tl.load(slots + j).to(tl.pointer_type(tl.float32))
            tl.store(slot + rank * K + ks, mine)
        tl.debug_barrier()
    abort = abort_addr.to(tl.pointer_type(tl.int32))
    for j in tl.static_range(W):
        if j != rank:
            pad = tl.load(pads + j).to(tl.pointer_type(tl.int32))
            flag = pad + channel * W + rank
            prev = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
            stop = tl.load(abort, volatile=True)
            while (prev != 0) & (stop == 0):
                prev = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
                stop = tl.load(abort, volatile=True)
    own = tl.load(pads + rank).to(tl.pointer_type(tl.int32))
    for j in tl.static_range(W):
        if j != rank:
            flag = own + channel * W + j
            got = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
            stop = tl.load(abort, volatile=True)
            while (got != 1) & (stop == 0):
                got = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
                stop = tl.load(abort, volatile=True)
    if VALUES:
        tl.debug_barrier()
        mine_slots = tl.load(slots + rank).to(tl.pointer_type(tl.float32))
        total = tl.zeros([K], dtype=tl.float32)
        for j in tl.static_range(W):
            total += tl.load(mine_slots + j * K + ks, volatile=True)
        tl.store(values + ks, total)


@triton.jit
def rows_mean_kernel(
    rows,  # (W, part) bf16: what each rank sent for this rank's part
    out,  # (part,) bf16: their mean
    partial_sq,  # (n_programs,) fp32
    part,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < part
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(W):
        total += tl.load(rows + j * part + offs, mask=mask, other=0.0).to(tl.float32)
    mean = (total / W).to(tl.bfloat16)
    tl.store(out + offs, mean, mask=mask)
    m = mean.to(tl.float32)
    tl.store(partial_sq + pid, tl.sum(m * m, axis=0))


class Meet:
    def __init__(self, world: int, rank: int, device: torch.device) -> None:
        self.flags = SharedBuffer.shared(3 * world, torch.int32, device)
        self.slots = SharedBuffer.shared(world * 2, torch.float32, device)
        self.rank, self.world = rank, world
        self.pads = self._table(self.flags)
        self.slot_table = self._table(self.slots)
        self.abort = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.values = torch.zeros(2, device=device)

    def _table(self, shared: SharedBuffer) -> torch.Tensor:
        every = list(shared.peers)
        every.insert(self.rank, shared.local)
        return torch.tensor([t.data_ptr() for t in every], dtype=torch.int64, device="cuda")

    def __call__(self, channel: int, values: bool = False) -> None:
        meet_kernel[(1,)](
            self.pads, self.slot_table, self.values, self.abort.data_ptr(), self.rank, channel,
            W=self.world, K=2, VALUES=values,
        )  # fmt: skip


def timed(name: str, body, out: list[dict], after_capture=None) -> None:
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
    if after_capture is not None:
        after_capture()
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
    row = {"part": name, "us_per_rank": [round(float(t), 2) for t in every]}
    out.append(row)
    if dist.get_rank() == 0:
        print(json.dumps(row), flush=True)
    del graph


def main() -> None:
    name, path = sys.argv[1], sys.argv[2]
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: list[dict] = []
    model = GPT(preset(name).model).to(device)
    made = [torch.randn_like(p).to(torch.bfloat16) for p in model.parameters()]
    one = torch.zeros(1, device=device)
    meet = Meet(world, rank, device)
    lr = torch.full((), 1e-4, device=device)

    def optimizer(block: int, warps: int) -> MasterAdamW:
        master_adamw.BLOCK, master_adamw.WARPS = block, warps
        opt = MasterAdamW(torch.optim.AdamW(model.parameters(), fused=True), (rank, world))
        opt.use_device_lr(lr)
        return opt

    weights = SharedBuffer.shared(optimizer(4096, 4).weights.numel(), torch.bfloat16, device)
    grads = SharedBuffer.shared(weights.local.numel(), torch.bfloat16, device)
    assert weights is not None and grads is not None, "no peer memory here"
    n = weights.local.numel()
    part = n // world
    lo, hi = rank * part, (rank + 1) * part

    def prepared(opt: MasterAdamW) -> MasterAdamW:
        opt.share_weights(weights)
        _, views = opt.gradient_buffer(grads.local)
        for p, v in zip(opt.params, views, strict=True):
            p.grad = v
        return opt

    for block, warps in ((4096, 4), (4096, 8), (2048, 8), (2048, 16), (1024, 8), (1024, 16)):
        opt = prepared(optimizer(block, warps))
        timed(f"update, peer writes, block={block} warps={warps}", opt.step, out,
              opt.after_capture)  # fmt: skip

    timed("nccl all_reduce 1 float", lambda: dist.all_reduce(one), out)
    timed("meet kernel", lambda: meet(0), out)
    timed("meet kernel with 2 values", lambda: meet(1, values=True), out)
    timed("3 meet kernels", lambda: [meet(c) for c in range(3)], out)
    # the values must come back summed
    meet.values.fill_(rank + 1.0)
    meet(1, values=True)
    got = meet.values.tolist()
    out.append({"part": "meet sums", "rank0_got": got, "want": world * (world + 1) / 2})

    average = PeerAverage(grads, lo, hi, world)
    opt = prepared(optimizer(4096, 4))
    _, views = opt.gradient_buffer(grads.local)
    for p, v in zip(opt.params, views, strict=True):
        p.grad = v

    def current() -> None:
        torch._foreach_copy_(views, made)
        dist.all_reduce(one)
        sum_sq = average()
        dist.all_reduce(sum_sq)
        opt.step()
        dist.all_reduce(one)

    timed("exchange + update as the step runs it", current, out, opt.after_capture)

    def current_meets() -> None:
        torch._foreach_copy_(views, made)
        meet(0)
        meet.values[0:1].copy_(average())
        meet(1, values=True)
        opt.step()
        meet(2)

    timed("the same, meets by the kernel", current_meets, out, opt.after_capture)

    # Pushed: the receive buffer is (world, part): row s is what rank s sent.
    every_grads = list(grads.peers)
    every_grads.insert(rank, grads.local)
    srcs, dsts = [], []
    offsets = [v.data_ptr() - grads.local.data_ptr() for v in views]
    for g, off in zip(made, offsets, strict=True):
        first = off // 2
        flat = g.reshape(-1)
        for owner in range(world):
            a, b = max(first, owner * part), min(first + flat.numel(), (owner + 1) * part)
            if a < b:
                rows = every_grads[owner].view(world, part)
                srcs.append((owner, flat[a - first : b - first]))
                dsts.append(rows[rank, a - owner * part : b - owner * part])
    order = sorted(range(len(srcs)), key=lambda i: (srcs[i][0] - rank - 1) % world)
    push_src = [srcs[i][1] for i in order]
    push_dst = [dsts[i] for i in order]
    mean_part = torch.zeros(part, dtype=torch.bfloat16, device=device)
    sq = torch.zeros(triton.cdiv(part, 2048), device=device)

    def pushed(meets: bool) -> None:
        torch._foreach_copy_(push_dst, push_src)
        meet(0) if meets else dist.all_reduce(one)
        rows_mean_kernel[(triton.cdiv(part, 2048),)](
            grads.local, mean_part, sq, part, W=world, BLOCK=2048
        )
        if meets:
            meet.values[0:1].copy_(sq.sum())
            meet(1, values=True)
        else:
            dist.all_reduce(sq.sum())
        opt.step()  # (reads the gradients where the current layout has them: timing only)
        meet(2) if meets else dist.all_reduce(one)

    timed("pushed gradients, NCCL meets", lambda: pushed(False), out, opt.after_capture)
    timed("pushed gradients, meets by the kernel", lambda: pushed(True), out, opt.after_capture)
    timed("the push alone", lambda: torch._foreach_copy_(push_dst, push_src), out)
    timed("the rows' mean alone", lambda: rows_mean_kernel[(triton.cdiv(part, 2048),)](
        grads.local, mean_part, sq, part, W=world, BLOCK=2048), out)  # fmt: skip

    if rank == 0:
        with open(path, "w") as f:
            for row in out:
                row.update(preset=name, world_size=world, elements=n)
                row.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
                f.write(json.dumps(row) + "\n")
    # The meet kernel ends a wait on the host's word: rank 0 waits for a meet nobody else
    # comes to; its host sets the flag a second later; the wait must end.
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        meet(2)
        time.sleep(1.0)
        meet.abort[0] = 1
        torch.cuda.synchronize()
        out.append({"part": "abort ends a lone wait", "seconds": time.perf_counter() - t0})
        print(out[-1], flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(out[-1]) + "\n")
        meet.abort[0] = 0
        meet.flags.local.zero_()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
