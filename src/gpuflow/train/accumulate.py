"""Gradient accumulation: a step's batch trained in micro-batches whose gradients are summed
before the update.

Autograd sums them itself into each ``.grad``, in the parameters' dtype: exact enough for
fp32 weights (the eager data paths, the cpu), not for the captured step's bf16 weights, whose
8-bit mantissa would round every addition. ``FP32Sum`` keeps the sum in fp32 there and hands
the update one bf16 gradient, rounded once, as a single large batch's would be.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel

from gpuflow.common.sizes import round_up

ALIGN = 8  # each gradient's place in the sum: a multiple of 8 elements (16 bf16 bytes)


def micro_batches(
    inputs: torch.Tensor, targets: torch.Tensor, count: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches of consecutive rows of a step's (k*B, T) inputs and targets:
    (B, T) views each, no copy."""
    return zip(inputs.chunk(count), targets.chunk(count), strict=True)


def gradient_sync(forward: torch.nn.Module, last: bool) -> AbstractContextManager[object]:
    """Where ``forward`` is (compiled) DistributedDataParallel: its gradient exchange held back
    for every micro-batch but the ``last`` (DDP then averages the summed gradients once);
    elsewhere nothing."""
    module = getattr(forward, "_orig_mod", forward)  # torch.compile's wrapper
    if last or not isinstance(module, DistributedDataParallel):
        return nullcontext()
    return module.no_sync()


def accumulated_loss(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    count: int,
    autocast: Callable[[], AbstractContextManager[object]],
    after_backward: Callable[[int], None] = lambda index: None,
) -> torch.Tensor:
    """Forward and backward of ``count`` micro-batches of a step's batch, each loss scaled by
    1/count so that the gradients sum to the whole batch's mean; returns the mean loss
    (detached where count > 1). ``after_backward(i)`` runs after micro-batch i's backward."""
    if count == 1:
        with autocast():
            loss = forward(inputs, targets)
        loss.backward()
        after_backward(0)
        return loss
    total: torch.Tensor | None = None
    for index, (x, y) in enumerate(micro_batches(inputs, targets, count)):
        with gradient_sync(forward, last=index == count - 1):
            with autocast():
                loss = forward(x, y)  # () fp32: the micro-batch's mean
            (loss / count).backward()
        after_backward(index)
        part = loss.detach() / count
        total = part if total is None else total + part
    assert total is not None
    return total


class FP32Sum:
    """Sums the gradients of ``params`` (all of one narrow dtype, such as bf16) in one flat
    fp32 buffer: ``add(i)`` after micro-batch i's backward takes each ``.grad`` into the sum
    and drops it, ``finish`` gives every parameter the sum, rounded to its dtype once, as its
    ``.grad`` (views of one buffer). Device work only: it can be captured in a CUDA graph."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or torch.float32 in dtypes:
            raise ValueError("FP32Sum sums the gradients of parameters of one narrow dtype")
        self.dtype = dtypes.pop()
        offsets, end = [], 0
        for p in self.params:
            offsets.append(end)
            end += round_up(p.numel(), ALIGN)
        self.sum = torch.zeros(end, device=self.params[0].device)  # (N,) fp32
        self._places = [(o, p.numel(), p.shape) for o, p in zip(offsets, self.params, strict=True)]
        self._views = [self.sum[o : o + n].view(shape) for o, n, shape in self._places]

    @classmethod
    def needed_for(cls, params: Sequence[torch.Tensor], count: int) -> FP32Sum | None:
        """An ``FP32Sum`` where ``count`` micro-batches would be summed in a narrow dtype."""
        if count == 1 or all(p.dtype == torch.float32 for p in params):
            return None
        return cls(params)

    @torch.no_grad()
    def add(self, index: int) -> None:
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            raise RuntimeError("a parameter got no gradient from the micro-batch")
        if index == 0:
            torch._foreach_copy_(self._views, grads)  # the first: no zeroing pass
        else:
            torch._foreach_add_(self._views, grads)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def finish(self) -> None:
        narrow = self.sum.to(self.dtype)  # (N,) one rounding of the whole sum
        for p, (o, n, shape) in zip(self.params, self._places, strict=True):
            p.grad = narrow[o : o + n].view(shape)
