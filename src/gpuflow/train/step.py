"""The training step: one object per data path, device work only.

A data path's row (``gpuflow.train.datapath``) names its step's kind; ``build_step`` builds
it over a model, its optimizer and a batch source. Calling the step runs one optimizer step
and adds its loss and grad norm to the step's ``AsyncScalars``; ``readback`` is what a
logging step reads back. The trainer's two kinds:

- ``EagerStep``: forward, backward, clip, update, from the source's (inputs, targets);
- ``GraphStep``: the whole step, batch draw and learning rate included, as one CUDA graph.

A path registered from outside the trainer may bring a kind of its own (``register_step``):
the bench's naive baseline does (``gpuflow.bench.baselines``).

Nothing here reads from the device: the host's part is launching.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch._inductor import config as inductor_config

from gpuflow.data.resident.sources import BatchSource, CapturableSource
from gpuflow.device.accelerator import Device
from gpuflow.model.gpt import GPT
from gpuflow.train.accumulate import FP32Sum, accumulated_loss
from gpuflow.train.capture import WARMUP_STEPS, CapturedStep, Graphs
from gpuflow.train.config import TrainConfig
from gpuflow.train.datapath import DataPath, StepKind, row
from gpuflow.train.distributed import Averager, holds_collectives
from gpuflow.train.optim import StepOptimizer
from gpuflow.train.optim.adamw import global_grad_norm
from gpuflow.train.schedule import lr_at, lr_tensor
from gpuflow.transfer.mirror import read_now
from gpuflow.transfer.scalars import AsyncScalars


def known_to_inductor(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` less any this torch's inductor does not have (torch.compile would refuse
    them; dotted names, ``triton.x``, are looked up part by part): newer options speed the
    step up where they exist and are skipped elsewhere."""

    def known(name: str) -> bool:
        where: Any = inductor_config
        for part in name.split("."):
            if not hasattr(where, part):
                return False
            where = getattr(where, part)
        return True

    return {k: v for k, v in options.items() if known(k)}


# At seed-d384's size the step is made of small kernels: inductor launches independent ones
# (the weights' bf16 casts, say) as one, and tunes each part of such a combined kernel to
# blocks of its own (the LayerNorm backwards and their weight gradients' column sums, say);
# each paid (docs/decisions/028, which also says why inductor's own tuning is left out).
COMPILE_OPTIONS = MappingProxyType(
    known_to_inductor({"combo_kernels": True, "combo_kernel_per_subkernel_blocks": True})
)
SCALARS = ("loss", "grad_norm")


@dataclass(frozen=True)
class StepOptions:
    """How a step is built beyond what the run's config says: what probes vary. The defaults
    are what ``gpuflow train`` runs."""

    compile_options: Mapping[str, Any] = field(default_factory=lambda: dict(COMPILE_OPTIONS))
    # The captured step's bf16 weights over fp32 masters, where MasterAdamW's kernel runs.
    master_weights: bool = True
    # The clip's factor handed to fused AdamW as ``grad_scale`` (else ``clip_grad_norm_``,
    # a pass over the gradients of its own).
    fused_clip: bool = True
    graphs: Graphs | None = None  # the graph API; None: CUDA's


def compiled_forward(
    model: torch.nn.Module, device: Device, options: StepOptions
) -> torch.nn.Module:
    """The model's forward (and so backward) compiled where torch.compile makes kernels
    (CUDA); the model itself elsewhere."""
    if device.type != "cuda":
        return model
    # A fresh compile per model: compiled code cached for an earlier model in this process
    # was seen to run it eagerly instead (the benchmark builds several).
    torch._dynamo.reset()
    return torch.compile(model, options=dict(options.compile_options))


class Update:
    """Average the gradients over ranks (with an ``averager``), clip, step and clear them;
    returns the grad norm (on the device)."""

    def __init__(
        self, model: GPT, optimizer: StepOptimizer, grad_clip: float, fused_clip: bool,
        averager: Averager | None = None,
    ) -> None:  # fmt: skip
        self.model, self.optimizer, self.grad_clip = model, optimizer, grad_clip
        self.fused_clip = fused_clip and bool(optimizer.defaults.get("fused"))
        self.averager = averager

    def __call__(self, loss: torch.Tensor | None = None) -> torch.Tensor:
        """``loss``, if given, is averaged over ranks in place with the gradients."""
        if self.averager is not None:
            with torch.no_grad():  # the global gradient: the same on every rank from here
                params = [p for p in self.model.parameters() if p.grad is not None]
                grads = self.averager(params, None if loss is None else loss.detach())
        if self.grad_clip > 0 and not self.fused_clip:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        elif self.averager is not None:  # read through the flat buffers: the same norm
            grad_norm = self.averager.grad_norm(grads)
        else:
            grad_norm = global_grad_norm(
                [p.grad for p in self.model.parameters() if p.grad is not None]
            )
        if self.grad_clip > 0 and self.fused_clip:
            # Fused AdamW divides each gradient by ``grad_scale`` as it reads it, so the clip
            # costs no pass over the gradients of its own (clip_grad_norm_'s factor,
            # max_norm / (norm + 1e-6) capped at 1, inverted).
            self.optimizer.grad_scale = ((grad_norm + 1e-6) / self.grad_clip).clamp(min=1.0)
        # Unclipped, the norm is still taken (one read of the gradients) for the record: a
        # logged 0 would say the gradients vanished.
        self.optimizer.step()
        if self.averager is not None:
            self.averager.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm


@dataclass(frozen=True)
class StepParts:
    """What every step is made of, whatever its data path."""

    model: GPT
    forward: torch.nn.Module  # the model, or its compiled forward
    optimizer: StepOptimizer  # the path's (``train/setup.py``: ``optimizer_for``)
    config: TrainConfig
    device: Device
    options: StepOptions
    averager: Averager | None = None  # data-parallel: gradients averaged over ranks
    # Micro-batches per step: the source's batch is trained in this many parts, their
    # gradients summed before the update (``train/accumulate.py``).
    accumulation: int = 1


class TrainStep:
    """One optimizer step of a data path: ``step(n)`` queues step ``n``'s device work."""

    def __init__(self, parts: StepParts, batches: BatchSource) -> None:
        self.model, self.forward, self.optimizer = parts.model, parts.forward, parts.optimizer
        self.config, self.device, self.batches = parts.config, parts.device, batches
        self.accumulation = parts.accumulation
        self.update = self.make_update(parts)
        self.scalars = AsyncScalars(SCALARS, self.device)
        self.last_loss: torch.Tensor | None = None  # an eager step's, for readback
        # Steps that compile or capture: warm-up, not what a step costs.
        self.warmup = WARMUP_STEPS + 1 if self.forward is not self.model else 0

    def __call__(self, step: int) -> None:
        raise NotImplementedError

    def make_update(self, parts: StepParts) -> Update | None:
        """What averages, clips and applies the gradients after the backward."""
        return Update(
            self.model, self.optimizer, self.config.grad_clip, parts.options.fused_clip,
            parts.averager,
        )  # fmt: skip

    def close(self) -> None:
        """Free what the step holds beyond its tensors (the captured graph)."""

    def set_lr(self, step: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.config)

    def readback(self, step: int) -> list[tuple[int, dict[str, float]]]:
        """What a logging step reads back: the scalars that have landed (no wait), and for
        the baselines, the loss read at once, as a standard loop prints it."""
        if self.batches.reads_loss_each_log and self.last_loss is not None:
            read_now(self.last_loss)
        return self.scalars.flush(step)


class EagerStep(TrainStep):
    def __call__(self, step: int) -> None:
        self.set_lr(step)
        inputs, targets = self.batches.inputs(step)  # (k*B, T) int64 each, on the device
        loss = accumulated_loss(
            self.forward, inputs, targets, self.accumulation, self.device.autocast
        )
        self.last_loss = loss
        self.scalars.add(loss=loss, grad_norm=self.update(loss))


class GraphStep(TrainStep):
    """The step captured whole: the batch is drawn and the learning rate computed on the
    device from the source's step counter, so every replay trains the next step."""

    batches: CapturableSource

    def __init__(self, parts: StepParts, batches: BatchSource) -> None:
        if not isinstance(batches, CapturableSource):
            raise ValueError(f"{type(batches).__name__} cannot be drawn inside a CUDA graph")
        super().__init__(parts, batches)
        self.warmup = WARMUP_STEPS + 1
        # The optimizer reads the learning rate from a device tensor the step itself writes.
        self.lr = torch.zeros((), device=self.device.torch)
        self.optimizer.use_device_lr(self.lr)
        draw = self.batches.draw
        schedule = lambda step: lr_tensor(step, self.config)  # noqa: E731
        if self.forward is not self.model:
            # Compiled, the draw's dozen small kernels (hash, gather, widen) fuse into a few,
            # and the schedule's ten into one.
            if self.batches.worth_compiling:
                draw = torch.compile(draw, options=dict(parts.options.compile_options))
            schedule = torch.compile(schedule, options=dict(parts.options.compile_options))
        self._draw, self._schedule = draw, schedule
        # bf16 weights' micro-batch gradients summed in fp32 (None: one micro-batch, or fp32)
        self.sum = FP32Sum.needed_for(list(self.model.parameters()), self.accumulation)
        self.captured = CapturedStep(
            self._body, after_capture=self.optimizer.after_capture, graphs=parts.options.graphs
        )
        if parts.averager is not None:  # the graph will hold the job's collectives
            holds_collectives(self.captured)

    def _body(self) -> None:
        self.lr.copy_(self._schedule(self.batches.counter))
        inputs, targets = self._draw()  # (k*B, T) int64 each; the counter moves on
        summed = self.sum
        loss = accumulated_loss(
            self.forward, inputs, targets, self.accumulation,
            lambda: self.device.autocast(cache=False),
            summed.add if summed is not None else lambda index: None,
        )  # fmt: skip
        if summed is not None:
            summed.finish()
        self.scalars.accumulate(loss=loss, grad_norm=self.update(loss))

    def __call__(self, step: int) -> None:
        self.batches.prepare(step)  # a chunk switch happens here, outside the graph
        self.captured()
        self.scalars.count()

    def close(self) -> None:
        self.captured.release()


# The trainer's kinds, then those registered (``register_step``).
STEPS: dict[str, type[TrainStep]] = {
    StepKind.EAGER: EagerStep,
    StepKind.GRAPH: GraphStep,
}


def register_step(kind: str, step: type[TrainStep]) -> None:
    """Add the class of a kind of step that a registered path's row names (the bench's naive
    step). The trainer's own kinds cannot be replaced."""
    if kind in tuple(StepKind):
        raise ValueError(f"{kind} is one of the trainer's own kinds of step")
    STEPS[kind] = step


def build_step(path: DataPath, parts: StepParts, batches: BatchSource) -> TrainStep:
    """The step of ``path`` over ``batches`` (``open_batches``' source for it)."""
    return STEPS[row(path).step](parts, batches)
