"""Peer memory off CUDA: where the GPUs cannot map each other's memory ``SharedBuffer.shared``
answers None, without a collective, so the split update falls back to NCCL's reduce-scatter
and all-gather (the peer kernels themselves run only between GPUs: the two-GPU jobs of
test_distributed_gpu.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpuflow.train.peer_memory import SharedBuffer


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
