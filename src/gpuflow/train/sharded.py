"""Data parallelism with the update split over the ranks (as ZeRO's first stage splits it).

Averaging the gradients with one all-reduce leaves every rank the whole averaged gradient,
and every rank then runs the same update over all the weights. An all-reduce is a
reduce-scatter followed by an all-gather; here the two halves go around the update instead:

    gradients --reduce-scatter--> this rank's part, averaged
              --update that part--> its new bf16 weights
              --all-gather--> every rank's weights

The bytes on the link are those of the all-reduce, but each rank updates 1/N of the weights,
and the clip's norm is a sum over the parts (one two-number all-reduce, which carries the
loss too). All of it is device work, so it is captured with the step.

Each rank keeps full-size masters and moments, current on its own part only:
``MasterAdamW.gather_state`` brings them together before a checkpoint."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gpuflow.train.optim.master_adamw import MasterAdamW


class ShardedAverager:
    """The averager of a ``MasterAdamW`` made with ``shard=(rank, world_size)``."""

    def __init__(self, optimizer: MasterAdamW) -> None:
        if optimizer.world_size < 2:
            raise ValueError("a sharded update needs a MasterAdamW split over 2 or more ranks")
        self.optimizer = optimizer
        self.world_size = optimizer.world_size
        # (N,) bf16 in the weights' layout, and each parameter's view of it
        self._flat, self._views = optimizer.gradient_buffer()
        lo, hi = optimizer.shard_range
        self._part = self._flat[lo:hi]  # (N / world_size,) this rank's averaged gradients
        self._weights_part = optimizer.weights[lo:hi]
        self._norm = torch.zeros((), device=self._flat.device)
        part_bytes = self._part.numel() * self._part.element_size()
        # What this rank hands the collectives per step: the gradients to the reduce-scatter,
        # its part of the weights to the all-gather, the norm and the loss.
        self.bytes_per_step = self._flat.numel() * self._flat.element_size() + part_bytes + 8

    def __call__(
        self, params: Sequence[torch.Tensor], loss: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Average this rank's part of the gradients (and ``loss``, in place) over the ranks.
        ``params`` are the optimizer's own; each ``.grad`` becomes its view of the buffer,
        averaged in this rank's part only, which is all the update reads."""
        opt_params = self.optimizer.params
        if len(params) != len(opt_params):
            raise RuntimeError("a sharded update needs a gradient for every parameter")
        torch._foreach_copy_(self._views, [p.grad for p in opt_params])
        self._average_part()
        for p, view in zip(opt_params, self._views, strict=True):
            p.grad = view  # the gradient autograd made is freed
        # fp32 accumulation: a bf16 sum of squares keeps three digits
        sum_sq = torch.linalg.vector_norm(self._part, dtype=torch.float32).square()
        stats = torch.stack([sum_sq, loss.float() if loss is not None else sum_sq.new_zeros(())])
        dist.all_reduce(stats)  # (2,) sums over ranks: squared norm, loss
        self._norm.copy_(stats[0].sqrt())
        if loss is not None:
            loss.copy_(stats[1] / self.world_size)
        return [self._part]

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm of the whole averaged gradient, as reduced with it."""
        return self._norm

    def after_step(self) -> None:
        """Every rank's updated part of the bf16 weights onto every rank."""
        dist.all_gather_into_tensor(self.optimizer.weights, self._weights_part)

    def _average_part(self) -> None:
        if self._part.is_cuda:  # NCCL divides as it reduces
            dist.reduce_scatter_tensor(self._part, self._flat, op=dist.ReduceOp.AVG)
        else:  # gloo sums
            dist.reduce_scatter_tensor(self._part, self._flat)
            self._part.mul_(1.0 / self.world_size)
