"""Data parallelism with the update split over the ranks (as ZeRO's first stage splits it).

    gradients --reduce-scatter--> this rank's part, averaged
              --update that part--> its new bf16 weights
              --all-gather--> every rank's weights

Where the GPUs map each other's memory (``train/peer_memory.py``) neither collective is
NCCL's: each rank writes each part of its gradients into that part's owner's memory, the
owner averages what the ranks wrote, and its update kernel writes the new weights into every
rank's copy. Each rank holds the fp32 masters and moments of its own part only
(``MasterAdamW.gather_state`` assembles them on rank 0 for a checkpoint). How and why:
docs/architecture/distributed.md (The split update).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gpuflow.train.optim.master_adamw import MasterAdamW
from gpuflow.train.peer_meet import PeerMeet
from gpuflow.train.peer_memory import RowsAverage, SharedBuffer


class ShardedAverager:
    """The averager of a ``MasterAdamW`` made with ``shard=(rank, world_size)``.
    ``peer_memory=False`` (ranks on several hosts): NCCL's collectives, never peer memory."""

    def __init__(self, optimizer: MasterAdamW, peer_memory: bool = True) -> None:
        if optimizer.world_size < 2:
            raise ValueError("a sharded update needs a MasterAdamW split over 2 or more ranks")
        self.optimizer = optimizer
        self.world_size = optimizer.world_size
        device = optimizer.weights.device
        n = optimizer.weights.numel()
        lo, hi = optimizer.shard_range
        rank = lo // (hi - lo)
        # None where the GPUs cannot map each other's memory: then NCCL reduces and gathers.
        self._meet = (
            PeerMeet.make(rank, self.world_size, device)
            if peer_memory and MasterAdamW.runs_on(device) else None
        )  # fmt: skip

        def shared() -> SharedBuffer | None:  # (N,) bf16 that every rank maps, with the meets
            return None if self._meet is None else SharedBuffer.shared(n, torch.bfloat16, device)

        self._gradients = shared()
        # (N,) bf16 in the weights' layout, and each parameter's view of it
        self._flat, self._views = optimizer.gradient_buffer(
            None if self._gradients is None else self._gradients.local
        )
        self._part = self._flat[lo:hi]  # (N / world_size,) this rank's averaged gradients
        self._average = (
            None if self._gradients is None
            else RowsAverage(self._gradients, rank, self.world_size)
        )  # fmt: skip
        # Where each piece of each gradient goes: its part's owner's buffer, in the row of
        # this rank (empty without peer memory: then the gradients are copied here whole).
        self._pieces, self._destinations = (
            ([], []) if self._gradients is None
            else push_plan(self._flat, self._views, self._gradients, rank, self.world_size)
        )  # fmt: skip
        self._weights = shared()
        if self._weights is not None:
            optimizer.share_weights(self._weights)
        self._weights_part = optimizer.weights[lo:hi]
        self._norm = torch.zeros((), device=self._flat.device)
        part_bytes = self._part.numel() * self._part.element_size()
        peers = self.world_size - 1
        # What this rank hands the others per step: the gradients (all of them to NCCL's
        # reduce-scatter, or each other rank's part written into its memory), its part of the
        # weights (to the all-gather, or written into their copies), the norm and the loss
        # (to an all-reduce, or written into each peer with the flags of the three meets).
        gradient_bytes = (
            self._flat.numel() * self._flat.element_size() if self._average is None
            else peers * part_bytes
        )  # fmt: skip
        weight_bytes = part_bytes if self._weights is None else peers * part_bytes
        stats_bytes = 8 if self._meet is None else 8 * peers + 3 * self._meet.bytes_per_meet
        self.bytes_per_step = gradient_bytes + weight_bytes + stats_bytes

    def __call__(
        self, params: Sequence[torch.Tensor], loss: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Average this rank's part of the gradients (and ``loss``, in place) over the ranks.
        ``params`` are the optimizer's own; each ``.grad`` becomes its view of the buffer,
        averaged in this rank's part only, which is all the update reads."""
        opt_params = self.optimizer.params
        if len(params) != len(opt_params):
            raise RuntimeError("a sharded update needs a gradient for every parameter")
        grads = [p.grad for p in opt_params]
        if self._average is None:
            torch._foreach_copy_(self._views, grads)
        else:
            flats = [g.reshape(-1) for g in grads]
            pieces = [flats[i][first:end] for i, first, end in self._pieces]
            torch._foreach_copy_(self._destinations, pieces)
        for p, view in zip(opt_params, self._views, strict=True):
            p.grad = view  # the gradient autograd made is freed
        loss_sum = loss.float() if loss is not None else self._norm.new_zeros(())
        if self._average is not None:
            self._meet(0)  # every rank has pushed: the average reads what they wrote
            sum_sq = self._average()
        else:
            self._reduce_scatter()
            # fp32 accumulation: a bf16 sum of squares keeps three digits
            sum_sq = torch.linalg.vector_norm(self._part, dtype=torch.float32).square()
        stats = torch.stack([sum_sq, loss_sum])  # (2,) squared norm, loss: summed over ranks
        if self._meet is None:
            dist.all_reduce(stats)
        else:  # also where the ranks meet after each has read its rows (the next push writes)
            self._meet.sum_(stats)
        self._norm.copy_(stats[0].sqrt())
        loss_sum = stats[1]
        if loss is not None:
            loss.copy_(loss_sum / self.world_size)
        return [self._part]

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm of the whole averaged gradient, as reduced with it."""
        return self._norm

    @property
    def exchange(self) -> str:
        """How the ranks exchange gradients and weights."""
        gradients = "NCCL reduce-scatter" if self._average is None else "peer writes"
        weights = "NCCL all-gather" if self._weights is None else "peer writes"
        return f"gradients by {gradients}, weights by {weights}"

    def after_step(self) -> None:
        """Every rank's updated part of the bf16 weights onto every rank."""
        if self._weights is None:
            dist.all_gather_into_tensor(self.optimizer.weights, self._weights_part)
        else:  # written by every rank's update: meet once all of them have finished
            self._meet(1)

    def _reduce_scatter(self) -> None:
        if self._part.is_cuda:  # NCCL divides as it reduces
            dist.reduce_scatter_tensor(self._part, self._flat, op=dist.ReduceOp.AVG)
        else:  # gloo sums
            dist.reduce_scatter_tensor(self._part, self._flat)
            self._part.mul_(1.0 / self.world_size)


def push_plan(
    flat: torch.Tensor,
    views: Sequence[torch.Tensor],
    buffer: SharedBuffer,
    rank: int,
    world_size: int,
) -> tuple[list[tuple[int, int, int]], list[torch.Tensor]]:
    """Each gradient cut at the parts' edges: ``(parameter index, first, end)`` elements of
    it, and where that piece goes, the row ``rank`` of its part's owner's ``buffer``
    ((world_size, part) each). ``views`` are the parameters' views of ``flat`` (N,), the
    weights' layout. The owners are taken from the next rank on, so that while the ranks
    write each writes into a different GPU's memory, not all into one."""
    part = flat.numel() // world_size
    planned = []
    for index, view in enumerate(views):
        first = view.storage_offset() - flat.storage_offset()
        end = first + view.numel()
        for owner in range(first // part, (end - 1) // part + 1):
            lo, hi = max(first, owner * part), min(end, (owner + 1) * part)
            at = rank * part + lo - owner * part  # its place in the owner's row for this rank
            destination = buffer.copies[owner][at : at + hi - lo]  # (N,) bf16 copies
            planned.append((owner, (index, lo - first, hi - first), destination))
    planned.sort(key=lambda p: (p[0] - rank - 1) % world_size)
    return [piece for _, piece, _ in planned], [dest for _, _, dest in planned]
