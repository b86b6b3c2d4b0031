"""Peer memory off CUDA: where the GPUs cannot map each other's memory ``SharedBuffer.shared``
answers None, without a collective, so the split update falls back to NCCL's reduce-scatter
and all-gather (the peer kernels themselves run only between GPUs: the two-GPU jobs of
test_distributed_gpu.py, and sharded_exchange_gpu_worker.py under test_four_gpus_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from gpuflow.train.peer_memory import SharedBuffer
from gpuflow.train.sharded import push_plan


def test_no_shared_buffer_on_the_cpu_or_outside_a_job():
    assert not dist.is_initialized()
    assert SharedBuffer.shared(4096, torch.bfloat16, torch.device("cpu")) is None
    # a CUDA device outside a process group: refused before CUDA or a rendezvous is touched
    assert SharedBuffer.shared(4096, torch.bfloat16, torch.device("cuda", 0)) is None
    assert not dist.is_initialized()


def test_no_shared_buffer_for_cpu_ranks_of_a_job(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        assert SharedBuffer.shared(4096, torch.bfloat16, torch.device("cpu")) is None
    finally:
        dist.destroy_process_group()


def test_pushed_pieces_give_each_owner_every_ranks_gradients_for_its_part():
    """Each rank cuts its gradients at the parts' edges and writes each piece into the row
    of its own rank in the part's owner's buffer: then each owner's rows are every rank's
    gradients for its part, and their mean is the mean gradient. Three ranks (parts not a
    power of two), tensors that straddle the parts' edges; each rank writes first into the
    next rank's buffer, so that the ranks write into different GPUs at once."""
    world, sizes = 3, [(5, 7), (13,), (4, 4), (29,)]
    numels = [torch.Size(s).numel() for s in sizes]
    offsets = [0, 40, 56, 72]  # 8-element aligned places in a flat buffer of 3 * 36
    flat_size = 108
    part = flat_size // world
    buffers = [torch.zeros(flat_size) for _ in range(world)]  # each rank's shared buffer
    gradients = [[torch.randn(s) for s in sizes] for _ in range(world)]
    for rank in range(world):
        flat = torch.zeros(flat_size)
        views = [flat[o : o + n].view(s) for o, n, s in zip(offsets, numels, sizes, strict=True)]
        shared = SimpleNamespace(local=buffers[rank], copies=buffers)
        pieces, destinations = push_plan(flat, views, shared, rank, world)
        owners = [b.untyped_storage().data_ptr() for b in buffers]
        first_owner = owners.index(destinations[0].untyped_storage().data_ptr())
        assert first_owner == (rank + 1) % world
        flats = [g.reshape(-1) for g in gradients[rank]]
        torch._foreach_copy_(destinations, [flats[i][a:b] for i, a, b in pieces])
    for owner in range(world):
        rows = buffers[owner].view(world, part)
        for sender in range(world):
            want = torch.zeros(flat_size)
            for o, n, g in zip(offsets, numels, gradients[sender], strict=True):
                want[o : o + n] = g.reshape(-1)
            assert torch.equal(rows[sender], want[owner * part : (owner + 1) * part])


def test_a_shared_buffer_lists_every_ranks_copy_in_rank_order_and_their_addresses():
    """What the kernels index by rank (the meets' flags and sums) and by peer (the update's
    writes into the other copies), from a handle as the rendezvous gives one."""
    world, rank = 4, 2
    others = {r: torch.zeros(8) for r in range(world) if r != rank}
    handle = SimpleNamespace(rank=rank, world_size=world,
                             get_buffer=lambda r, shape, dtype: others[r])  # fmt: skip
    local = torch.zeros(8)
    buffer = SharedBuffer(local, handle)
    assert buffer.copies[rank] is local
    assert all(buffer.copies[r] is others[r] for r in others)
    assert buffer.peers == [others[r] for r in (0, 1, 3)]
    assert buffer.copy_table.tensor.tolist() == [t.data_ptr() for t in buffer.copies]
    assert buffer.peer_table.tensor.tolist() == [t.data_ptr() for t in buffer.peers]
