"""Averaging the gradients over ranks while the backward still runs.

Compiled whole, the model's backward is one autograd node: every gradient lands at its end,
and the all-reduce can only start after it. Here the model runs region by region
(``RegionalForward``: the embedding, each block, the head, each compiled on its own), so the
backward finishes one block's gradients at a time, and ``OverlappedAverager`` all-reduces
them bucket by bucket on NCCL's stream while the backward goes on: each parameter's
post-accumulate hook counts its bucket down, and the bucket's last gradient copies the
bucket into its place in one flat buffer and starts its all-reduce. A captured step records
these stream forks and joins with the rest of the step; the host takes part only while it
captures.

The token table is both the lookup and the output head (tied), and a parameter's hook fires
once, when all its uses are summed: the lookup's use comes last in the backward, so the
table, the largest tensor, would wait for the end. So the lookup reads the table without
a gradient (``GPT.embed(table_gradient=False)``): the table's gradient from autograd is the
head's alone, dense and known first (the fused head computes it in the forward), and it goes
in the first bucket. The lookup's part touches only the B*T rows of the batch: the ranks
gather each other's token ids and embedding gradients (B*T x C each, instead of 16000 x 384
mostly zero rows) and every rank adds all of them to the averaged table gradient with the
same deterministic kernel, so that the ranks' weights stay identical.

Buckets, in the order the backward finishes them: the head (the table's head part and the
final norm), each block from the last to the first, the first one with the position table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpuflow.model.gpt import GPT
from gpuflow.train.distributed import GradientAverager

_ALIGN_BYTES = 16  # each gradient's place in the flat buffer: as MasterAdamW reads fastest


class OverlappedAverager(GradientAverager):
    """``GradientAverager``'s contract (``.grad`` views of one flat buffer of averaged
    gradients, the loss averaged in place) with the all-reduce overlapped with the
    backward. Runs with ``RegionalForward``, which opens each step (``begin``) and shows it
    the embeddings (``watch_embeddings``)."""

    def __init__(self, world_size: int, model: GPT) -> None:
        super().__init__(world_size)
        self.model = model
        self.table = model.wte.weight
        blocks = [list(block.parameters()) for block in reversed(model.blocks)]
        self.buckets: list[list[nn.Parameter]] = [
            [self.table, *model.ln_f.parameters()],
            *blocks[:-1],
            [*blocks[-1], model.wpe.weight],
        ]
        placed = [id(p) for bucket in self.buckets for p in bucket]
        if sorted(placed) != sorted(id(p) for p in model.parameters()) or len(set(placed)) != len(
            placed
        ):
            raise ValueError("the buckets must hold each of the model's parameters once")
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._arrived)
        self._flat: torch.Tensor | None = None  # (sum of padded numels,) made on first use
        self._views: list[list[torch.Tensor]] = []
        self._slices: list[torch.Tensor] = []
        self._left: list[int] = []
        self._works: list[Any] = []
        self._ids: torch.Tensor | None = None  # (B, T) this step's token ids
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None
        self._armed = False

    # ---- during the step ----------------------------------------------------------------------

    def begin(self) -> None:
        """A step's forward starts: its backward's gradients are this averager's."""
        self._left = [len(bucket) for bucket in self.buckets]
        self._works, self._gathered, self._armed = [], None, True

    def watch_embeddings(self, ids: torch.Tensor, embeddings: torch.Tensor) -> None:
        """The lookup's output ``embeddings`` (B, T, C) of ``ids`` (B, T): its gradient
        is gathered from every rank as soon as the backward reaches it."""
        self._ids = ids
        embeddings.register_hook(self._embeddings_gradient)

    def _arrived(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[id(param)]
        self._left[bucket] -= 1
        if self._left[bucket] == 0:
            self._launch(bucket)

    def _launch(self, bucket: int) -> None:
        """Copy the bucket's gradients into its place and start its all-reduce."""
        params = self.buckets[bucket]
        if self._flat is None:
            self._layout(params[0].grad.dtype, params[0].grad.device)
        views = self._views[bucket]
        torch._foreach_copy_(views, [p.grad for p in params])
        for p, view in zip(params, views, strict=True):
            p.grad = view  # autograd's gradient is freed now, not at the end
        self._left[bucket] = -1  # launched
        self._works.append(self._all_reduce(self._slices[bucket]))

    def _embeddings_gradient(self, grad: torch.Tensor) -> None:
        """Gather every rank's token ids and embedding gradients (the table's lookup part)."""
        ids, rows = self._ids.reshape(-1), grad.reshape(-1, grad.shape[-1])  # (N,), (N, C)
        if self._gathered is None or self._gathered[1].dtype != rows.dtype:
            self._gathered = (
                ids.new_empty(self.world_size * ids.numel()),  # (world * N,)
                rows.new_empty(self.world_size * rows.shape[0], rows.shape[1]),  # (world*N, C)
            )
        all_ids, all_rows = self._gathered
        self._works.append(_gather(all_ids, ids))
        self._works.append(_gather(all_rows, rows.contiguous()))

    def _all_reduce(self, flat: torch.Tensor) -> Any:
        op = dist.ReduceOp.AVG if flat.is_cuda else dist.ReduceOp.SUM  # gloo has no AVG
        return dist.all_reduce(flat, op=op, async_op=True)

    # ---- after the backward ---------------------------------------------------------------

    def __call__(
        self, params: Sequence[torch.Tensor], loss: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        if not self._armed:
            raise RuntimeError("OverlappedAverager runs with RegionalForward, which opens a step")
        for bucket, left in enumerate(self._left):
            if left >= 0:  # a bucket whose gradients did not all arrive: not for this model
                raise RuntimeError(f"bucket {bucket} of the overlapped all-reduce never filled")
        for work in self._works:
            work.wait()  # the current stream waits for NCCL's; the host does not
        self._armed = False
        flat = self._flat
        if not flat.is_cuda:
            flat.mul_(1.0 / self.world_size)
        if self._gathered is not None:  # the lookup's part of the table's gradient
            all_ids, all_rows = self._gathered
            lookup = torch.ops.aten.embedding_dense_backward(
                all_rows, all_ids, self.table.shape[0], -1, False
            )  # (V, C): every rank's rows, summed in one deterministic order
            self._views[0][0].add_(lookup.to(flat.dtype), alpha=1.0 / self.world_size)
        if loss is not None:
            self._mean(loss.detach())
        if not self.bytes_per_step:
            sent = flat.numel() * flat.element_size()
            if self._gathered is not None:
                sent += sum(t.numel() * t.element_size() for t in self._gathered) // self.world_size
            self.bytes_per_step = sent + (loss.element_size() if loss is not None else 0)
        return [flat]

    def _layout(self, dtype: torch.dtype, device: torch.device) -> None:
        """One flat buffer, the buckets one after the other, each gradient 16-byte aligned;
        zeros, so the padding adds nothing to the norm."""
        align = max(1, _ALIGN_BYTES // dtype.itemsize)
        places, end = [], 0
        for bucket in self.buckets:
            start, offsets = end, []
            for p in bucket:
                offsets.append(end)
                end += -(-p.numel() // align) * align
            places.append((start, end, offsets))
        flat = torch.zeros(end, dtype=dtype, device=device)  # (sum of padded numels,)
        for bucket, (start, stop, offsets) in zip(self.buckets, places, strict=True):
            self._slices.append(flat[start:stop])
            self._views.append(
                [flat[o : o + p.numel()].view_as(p) for o, p in zip(offsets, bucket, strict=True)]
            )
        self._flat = flat


def _gather(out: torch.Tensor, tensor: torch.Tensor) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, tensor, async_op=True)


class RegionalForward(nn.Module):
    """``model``'s training forward (ids, targets) -> loss, run region by region for an
    ``OverlappedAverager``: the embedding, each block and the head, each compiled on its own
    with ``compile_options`` (None: not compiled)."""

    def __init__(
        self, model: GPT, averager: OverlappedAverager | None, compile_options: Mapping | None
    ) -> None:
        super().__init__()
        self.model = model
        self.averager = averager

        def region(fn: Any) -> Any:
            if compile_options is None:
                return fn
            return torch.compile(fn, options=dict(compile_options))

        self._embed = region(self._embeddings)
        self._blocks = [region(block) for block in model.blocks]
        self._head = region(model.loss_head)

    def _embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        split = self.averager is not None  # the table's lookup part goes to the averager
        return self.model.residual_stream(self.model.embed(ids, table_gradient=not split))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.averager is not None:
            self.averager.begin()
        x = self._embed(ids)  # (B, T, C)
        if x.requires_grad and self.averager is not None:
            self.averager.watch_embeddings(ids, x)
        for block in self._blocks:
            x = block(x)  # (B, T, C)
        return self._head(x, targets)
