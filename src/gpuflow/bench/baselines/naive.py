"""The ``naive`` data path: the slow pipeline this project exists to replace, rebuilt in
PyTorch so that its cost is measured beside ours on the same model.

Each sequence of the batch is processed on its own. For each, the token and position
embedding tables are downloaded to the host (about 25 MB for seed-d384), the embedding is
looked up there, and the (T, C) result is uploaded with a blocking copy from pageable
memory; the loss is read back after every sequence, and the device's memory cache is
emptied, so every sequence allocates afresh. The embedding's gradient is added back into
the tables on the device, so the model still learns what the other paths learn.

Its step (``NaiveStep``, of kind ``naive``) runs these gradients and a plain loop's update;
``gpuflow.bench.baselines`` registers both with the trainer.
"""

from __future__ import annotations

import numpy as np
import torch

from gpuflow.data.resident.batches import WindowSampler
from gpuflow.data.resident.sources import BatchSource
from gpuflow.device.accelerator import Device
from gpuflow.model.gpt import GPT
from gpuflow.train.optim.adamw import global_grad_norm
from gpuflow.train.step import StepParts, TrainStep
from gpuflow.transfer.mirror import host_copy_now, read_now

STEP_KIND = "naive"  # the kind of step the naive path's row names


class NaiveBatches(BatchSource):
    """Batches left on the host, as int64: the naive step embeds them there."""

    reads_loss_each_log = True

    def __init__(self, sampler: WindowSampler) -> None:
        self.sampler = sampler

    def host_tokens(self, step: int) -> np.ndarray:
        return self.sampler.batch(step).astype(np.int64)  # (B, T+1), on the host


def naive_gradients(model: GPT, device: Device, host_tokens: np.ndarray) -> torch.Tensor:
    """Forward and backward of every sequence of ``host_tokens`` (B, T+1) int64 on its own,
    the naive way; returns the batch's mean loss. The optimizer step is the caller's."""
    batch, window = host_tokens.shape
    T = window - 1
    total = torch.zeros((), device=device.torch)
    for row in range(batch):
        wte = host_copy_now(model.wte.weight)  # (V, C): the whole table, downloaded
        wpe = host_copy_now(model.wpe.weight)  # (max_len, C)
        ids = torch.from_numpy(host_tokens[row])  # (T+1,)
        embedded = wte[ids[:-1]] + wpe[:T]  # (T, C), looked up on the host
        x = embedded.to(device.torch).requires_grad_(True)  # blocking, from pageable memory
        targets = ids[1:].to(device.torch)  # (T,)
        with device.autocast():
            loss = model.loss_from_embeddings(x[None], targets[None])
        (loss / batch).backward()
        # The embedding's gradient goes back into the tables, on the device.
        for param in (model.wte.weight, model.wpe.weight):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        model.wte.weight.grad.index_add_(0, ids[:-1].to(device.torch), x.grad)
        model.wpe.weight.grad[:T].add_(x.grad)
        read_now(loss)  # every sequence's loss, read at once
        total += loss.detach() / batch
        if device.type == "cuda":
            torch.cuda.empty_cache()  # no memory caching: the next sequence allocates anew
    return total


def naive_update(model: GPT, optimizer: torch.optim.Optimizer, grad_clip: float) -> torch.Tensor:
    """The update a plain loop makes: ``clip_grad_norm_``, the optimizer's step, gradients
    cleared; returns the grad norm (on the device). Nothing of the production step's update
    (the clip folded into fused AdamW, gradients averaged over ranks) runs here."""
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:  # not clipped, but logged as a plain loop that logs it would
        grad_norm = global_grad_norm([p.grad for p in model.parameters() if p.grad is not None])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


class NaiveStep(TrainStep):
    """The naive baseline's step: its per-sequence gradients, then its plain update."""

    batches: NaiveBatches

    def make_update(self, parts: StepParts) -> None:
        return None  # naive_update, below

    def __call__(self, step: int) -> None:
        self.set_lr(step)
        self.last_loss = naive_gradients(self.model, self.device, self.batches.host_tokens(step))
        grad_norm = naive_update(self.model, self.optimizer, self.config.grad_clip)
        self.scalars.add(loss=self.last_loss, grad_norm=grad_norm)
