"""Probe: how the split update's ranks exchange gradients and weights. MODE nccl: NCCL's
reduce-scatter and all-gather; weights: NCCL's reduce-scatter, the weights written into every
rank's copy by the update kernel (symmetric memory, then a barrier); peer: that and the
gradients averaged by reading the other ranks' copies (what ``train`` does where it can).

Runs the gpuflow command line given after MODE under torchrun; at the end each rank's bf16
weights are compared with rank 0's, bit for bit, and the verdict printed by rank 0 (a peer
write that landed late would show as a difference).

torchrun --standalone --nproc_per_node=2 benchmarks/probes/peerwrites.py MODE train ARGS...
"""

import sys

import torch
import torch.distributed as dist

from gpuflow.interface.cli.main import main
from gpuflow.train import distributed, sharded

made: list = []
make = sharded.ShardedAverager.__init__


def recording_init(self, optimizer):
    make(self, optimizer)
    made.append(self)


def compared_stop(stop=distributed.stop):
    if made and dist.is_initialized():
        weights = made[-1].optimizer.weights
        torch.cuda.synchronize()
        gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, weights)
        if dist.get_rank() == 0:
            same = all(torch.equal(g, gathered[0]) for g in gathered)
            print(f"PROBE mode={sys.argv[1]} exchange={made[-1].exchange} "
                  f"ranks' weights bit-identical: {same}", flush=True)  # fmt: skip
    stop()


if __name__ == "__main__":
    shared, calls = sharded.peer_buffer, []

    def shared_as_mode(numel, device):  # called for the gradients, then for the weights
        calls.append(1)
        wanted = {"nccl": (), "weights": (2,), "peer": (1, 2)}[sys.argv[1]]
        return shared(numel, device) if len(calls) in wanted else None

    sharded.peer_buffer = shared_as_mode
    sharded.ShardedAverager.__init__ = recording_init
    distributed.stop = compared_stop
    sys.exit(main(sys.argv[2:]))
