"""Data-parallel training on ``torch.distributed``, launched by ``torchrun``.

    torchrun --nproc_per_node=8 -m gpuflow train --preset gpt2-124m

``torchrun`` starts one process per GPU and tells each its place through the environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``). ``Ranks.from_env``
reads it; ``start`` joins the process group, with NCCL for device tensors and gloo for host
ones (one group, both backends), and gives each rank its own device, ``cuda:LOCAL_RANK``.
Plain ``gpuflow train`` is world size 1 and touches none of this.

What a rank does differently from a single process, and how a job ends (a graph that
captured collectives is released before the process group, a lost rank aborts NCCL):
docs/architecture/distributed.md.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.train.optim.adamw import global_grad_norm
from gpuflow.train.peer_meet import end_waits

# How long a collective may wait for the other ranks before the process group gives up with
# an error naming it (a rank that died, or one that stopped calling collectives).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_T = TypeVar("_T")


class RankLost(GpuflowError):
    """Another rank of the job is gone: this one has left the job too."""


class Releasable(Protocol):
    def release(self) -> None: ...


# What holds captured collectives of this process's job (``CapturedStep``s): weakly, so that a
# step nobody uses any more is not kept alive for this.
_capturing: weakref.WeakSet[Releasable] = weakref.WeakSet()


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel job; ``Ranks()`` is a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # Started by torchrun: the job's machinery runs (process group, the gradients' all-reduce
    # in the step) even with one process, whose figures are then those of a rank.
    launched: bool = False
    # Ranks on this rank's host (torchrun's LOCAL_WORLD_SIZE); None: all of them.
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise GpuflowError(f"rank {self.rank} is not in a world of {self.world_size}")
        if self.local_rank < 0:
            raise GpuflowError(f"LOCAL_RANK must be >= 0, got {self.local_rank}")
        local = self.local_world_size
        if local is not None and not self.local_rank < local <= self.world_size:
            raise GpuflowError(
                f"LOCAL_WORLD_SIZE {local} must exceed LOCAL_RANK {self.local_rank} and be at "
                f"most WORLD_SIZE {self.world_size}: launch with torchrun"
            )

    @property
    def one_host(self) -> bool:
        """Whether every rank of the job runs on this host (so the GPUs may map each other's
        memory); torchrun with --nnodes above 1 says otherwise."""
        return self.local_world_size in (None, self.world_size)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.launched or self.world_size > 1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Ranks:
        """The ranks ``torchrun`` set in the environment; a single process without them."""
        env = dict(os.environ if env is None else env)
        if not any(key in env for key in _ENV):
            return cls()
        missing = [key for key in _ENV if key not in env]
        if missing:
            raise GpuflowError(
                f"the environment sets {', '.join(k for k in _ENV if k in env)} but not "
                f"{', '.join(missing)}: launch with torchrun, or unset them"
            )
        try:
            ranks = (int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]))
            local = env.get("LOCAL_WORLD_SIZE")
            local_world_size = None if local is None else int(local)
        except ValueError:
            raise GpuflowError(
                "RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers: launch "
                "with torchrun"
            ) from None
        return cls(*ranks, launched=True, local_world_size=local_world_size)


def rank_device(ranks: Ranks, requested: str) -> Device:
    """The device a rank trains on: ``cuda:LOCAL_RANK`` when the job runs on CUDA (each rank
    its own GPU), else the one asked for (the cpu, with gloo)."""
    device = Device.resolve(requested)
    if not ranks.distributed or device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if ranks.local_rank >= count:
        raise GpuflowError(
            f"rank {ranks.rank} has LOCAL_RANK {ranks.local_rank} but this host has {count} "
            "GPU(s): start at most one process per GPU (torchrun --nproc_per_node)"
        )
    return Device("cuda", ranks.local_rank)


def start(ranks: Ranks, device: Device) -> None:
    """Join the job's process group (a no-op for a single process): NCCL carries device
    tensors on CUDA, gloo host tensors (and everything on the cpu)."""
    if not ranks.distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device.index)
        backend, device_id = "cpu:gloo,cuda:nccl", device.torch
    elif device.type == "cpu":
        backend, device_id = "gloo", None
    else:
        raise GpuflowError(f"data-parallel training runs on cuda or the cpu, not {device.type}")
    dist.init_process_group(
        backend, rank=ranks.rank, world_size=ranks.world_size, timeout=COLLECTIVE_TIMEOUT,
        device_id=device_id,
    )  # fmt: skip


def holds_collectives(captured: Releasable) -> None:
    """Register ``captured``, a graph owner whose graph may hold this job's collectives:
    leaving the job releases it first."""
    _capturing.add(captured)


def _release_graphs() -> None:
    for captured in list(_capturing):
        captured.release()
    _capturing.clear()


def stop() -> None:
    """Leave the process group, if this process joined one: every rank calls it at the end of
    a job that went well (each rank's own device work is then complete or completing)."""
    _release_graphs()
    if dist.is_initialized():
        dist.destroy_process_group()


def abort() -> None:
    """Leave the process group without waiting for anything in flight: a collective still
    waiting for a rank that is gone ends (with garbage, which nothing reads). For a rank that
    failed, or found another gone. From here a rank of a job ends by itself, after a line
    that says why: the SIGTERM that torchrun sends every rank once one is gone is ignored, so
    that it does not end the process before that line."""
    end_waits()  # a meet on the GPU waiting for a rank that is gone, which NCCL's abort misses
    _release_graphs()
    if dist.is_initialized():
        ignore_sigterm()
        with suppress(RuntimeError):  # a backend already broken: there is nothing to free
            _abort_process_group()


def ignore_sigterm() -> None:
    """For a rank leaving its job: from here it ends by itself, after the line that says why,
    and the SIGTERM torchrun sends every rank once one is gone must not end it first."""
    with suppress(ValueError):  # off the main thread, where Python sets no handler
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


# How gloo's transport words a peer that went away mid-collective (DDP's gradient all-reduce
# on the cpu raises these from inside the backward).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def rank_lost(exc: BaseException) -> RankLost:
    """``exc``, a failed collective, said as ``RankLost``: one line for the user."""
    first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    # gloo's own first sentence, less the source location it starts with
    cause = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0][:160]
    return RankLost(
        f"another rank of this job stopped or died ({cause}); this rank has left the "
        "job too (the other rank's output says why); the run's checkpoints are intact: start "
        "the job again with --resume"
    )


def lost_a_rank(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank went away."""
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in _PEER_GONE)


def _on_host(collective: Callable[[], _T]) -> _T:
    """Run a host collective (gloo); if it fails, another rank is gone (its connection
    closed) or stopped answering (the timeout passed): leave the job and say so."""
    try:
        return collective()
    except RuntimeError as exc:  # DistError and its kinds are RuntimeErrors
        abort()
        raise rank_lost(exc) from exc


def agree(flag: bool, ranks: Ranks) -> bool:
    """Whether any rank says ``flag``: a host all-reduce (gloo), so every rank takes the same
    decision at the same step. Host work only; a single process returns ``flag``."""
    if not ranks.distributed:
        return flag
    vote = torch.tensor([int(flag)], dtype=torch.int32)
    _on_host(lambda: dist.all_reduce(vote, op=dist.ReduceOp.MAX))
    return bool(vote.item())


def least(value: int, ranks: Ranks) -> int:
    """The smallest of every rank's ``value`` (host work, gloo); ``value`` for one process."""
    if not ranks.distributed:
        return value
    box = torch.tensor([value], dtype=torch.int64)
    _on_host(lambda: dist.all_reduce(box, op=dist.ReduceOp.MIN))
    return int(box.item())


def largest(values: Mapping[str, float], ranks: Ranks) -> dict[str, float]:
    """Each of ``values`` at its largest over the ranks (host work, gloo): every rank passes
    the same keys. ``values`` as they are for one process."""
    if not ranks.distributed or not values:
        return dict(values)
    keys = sorted(values)
    box = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    _on_host(lambda: dist.all_reduce(box, op=dist.ReduceOp.MAX))
    return dict(zip(keys, box.tolist(), strict=True))


def each_rank(value: int, ranks: Ranks) -> list[int]:
    """Every rank's ``value``, in rank order (host work, gloo); ``[value]`` for one process."""
    if not ranks.distributed:
        return [value]
    boxes = [torch.zeros(1, dtype=torch.int64) for _ in range(ranks.world_size)]
    _on_host(lambda: dist.all_gather(boxes, torch.tensor([value], dtype=torch.int64)))
    return [int(box.item()) for box in boxes]


@contextmanager
def each_host_first(ranks: Ranks) -> Iterator[None]:
    """The first rank of each host (``LOCAL_RANK`` 0) runs the block before the others,
    which then find what it prepared on their host's disk (say, the built-in corpus); host
    work only, and nothing for a single process."""
    first = ranks.local_rank == 0
    if not first:
        agree(False, ranks)  # returns once every host's first rank has made the call below
    yield
    if first:
        agree(False, ranks)


def broadcast_from_main(value: object, ranks: Ranks) -> object:
    """Rank 0's ``value`` on every rank (a run folder's name, say): host work only."""
    if not ranks.distributed:
        return value
    box = [value]
    _on_host(lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


class Averager(Protocol):
    """What the step's update asks of data parallelism: average the gradients (and the loss)
    before the clip, give the clip the averaged gradient's norm, finish after the update."""

    bytes_per_step: int

    def __call__(
        self, params: Sequence[torch.Tensor], loss: torch.Tensor | None = None
    ) -> list[torch.Tensor]: ...

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor: ...

    def after_step(self) -> None: ...


class GradientAverager:
    """Averages gradients (and the loss) over the ranks, device work only, so it can be
    captured with the step.

    Per dtype the gradients are copied into one persistent flat buffer (each at a 16-byte
    aligned place, as MasterAdamW's kernel reads fastest), reduced there by a single
    all-reduce, and each parameter's ``.grad`` then *is* its view of that buffer: no copy
    back, and the clip's norm is one pass over the flat buffers. NCCL averages as it reduces
    (``ReduceOp.AVG``); gloo sums, then one scale.

    Under ``DistributedDataParallel`` (the eager data paths), which averages the gradients
    itself during the backward, ``reduce_gradients=False`` leaves them be and averages the
    loss alone."""

    def __init__(self, world_size: int, reduce_gradients: bool = True) -> None:
        self.world_size = world_size
        self.reduce_gradients = reduce_gradients
        # What this rank hands the collectives per step, DDP's all-reduce included (the
        # ledger cannot see collectives).
        self.bytes_per_step = 0
        # dtype -> (the parameters it was laid out for, the flat buffer, their views of it)
        self._buffers: dict[torch.dtype, tuple[list[int], torch.Tensor, list[torch.Tensor]]] = {}

    def __call__(
        self, params: Sequence[torch.Tensor], loss: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Average the ``.grad`` of ``params`` (and ``loss``, in place) over the ranks;
        returns tensors that hold every averaged gradient (the flat buffers, or the
        gradients DDP averaged)."""
        grads = self._reduce(params) if self.reduce_gradients else [p.grad for p in params]
        if loss is not None:
            self._mean(loss.detach())
        if not self.bytes_per_step:  # the same every step: the buffers do not change
            # DDP's buckets hold what autograd made (no padding); ours, the flat buffers.
            sent = sum(g.numel() * g.element_size() for g in grads)
            self.bytes_per_step = sent + (loss.element_size() if loss is not None else 0)
        return grads

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return global_grad_norm(grads)

    @property
    def exchange(self) -> str:
        """How the ranks exchange gradients."""
        return "gradients by all-reduce" + ("" if self.reduce_gradients else " (DDP's buckets)")

    def after_step(self) -> None:
        """Nothing: every rank updated every weight."""

    def _reduce(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per dtype: the gradients into the flat buffer, one all-reduce, ``.grad`` views."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        flats = []
        for dtype, group in by_dtype.items():
            flat, views = self._buffer(dtype, group)
            torch._foreach_copy_(views, [p.grad for p in group])
            self._mean(flat)
            for p, view in zip(group, views, strict=True):
                p.grad = view  # the gradient autograd made is freed
            flats.append(flat)
        return flats

    def _mean(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:  # NCCL divides as it reduces
            dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
        else:
            dist.all_reduce(tensor)
            tensor.mul_(1.0 / self.world_size)

    def _buffer(
        self, dtype: torch.dtype, group: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The flat buffer for ``group``'s gradients, made on first use (the step's first,
        eager call: a captured replay then reads and writes the same addresses)."""
        ids = [id(p) for p in group]
        kept = self._buffers.get(dtype)
        if kept is not None and kept[0] == ids:
            return kept[1], kept[2]
        align = max(1, 16 // dtype.itemsize)
        offsets, end = [], 0
        for p in group:
            offsets.append(end)
            end += -(-p.numel() // align) * align
        # Zeros: the padding between gradients stays 0, so it adds nothing to the norm.
        flat = torch.zeros(end, dtype=dtype, device=group[0].device)  # (sum of padded numels,)
        views = [flat[o : o + p.numel()].view_as(p) for o, p in zip(offsets, group, strict=True)]
        self._buffers[dtype] = (ids, flat, views)
        return flat, views
