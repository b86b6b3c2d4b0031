"""How a packed batch is rebuilt where its buffer landed: views of the buffer (converted back
where a codec narrowed them) in the batch's own structure, one batch at a time (``rebuild``,
``unpack``) or a run of batches of one layout at once (``rebuild_run``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device
from gpuflow.transfer.packing.spec import Leaf, Ragged, _Node, _RaggedSpec, _StackSpec, _view
from gpuflow.transfer.packing.write import Packed


def rebuild(
    buffer: torch.Tensor | None, spec: Any, direct: Iterator[torch.Tensor] | None = None
) -> Any:
    """The batch described by ``spec`` from ``buffer`` (already where it should be).

    Tensors that crossed unchanged are views of ``buffer``; narrowed or compressed ones are
    converted back, which queues one small kernel each on the current stream. Direct leaves
    are taken, in order, from ``direct``.
    """
    if isinstance(spec, Leaf):
        if spec.direct:
            return spec.delivered(next(direct))  # type: ignore[arg-type]
        view = _view(buffer, spec, spec.wire)  # type: ignore[arg-type]
        return spec.delivered(view if spec.wire == spec.dtype else view.to(spec.dtype))
    if isinstance(spec, _StackSpec):
        return spec.kind(rebuild(buffer, spec.leaf).unbind(0))
    if isinstance(spec, _RaggedSpec):
        values = rebuild(buffer, spec.values, direct)
        return Ragged(values, rebuild(buffer, spec.offsets, direct), spec.host_offsets)
    if isinstance(spec, _Node):
        return spec.build(
            spec.items(
                lambda child: rebuild(buffer, child, direct),
                lambda whole: list(rebuild(buffer, whole).unbind(0)),
            )
        )
    return spec


def rebuild_run(
    buffer: torch.Tensor | None, spec: Any, offset: int, stride: int, n: int,
    direct: list[Iterator[torch.Tensor]] | None = None,
) -> list[Any]:  # fmt: skip
    """The ``n`` batches of one layout (``spec``) laid ``stride`` bytes apart from ``offset``
    in ``buffer``: one strided view (and one conversion, if narrowed) per leaf for the whole
    run, instead of a view per leaf per batch. ``buffer``'s length must be a multiple of 16
    and ``offset`` and ``stride`` multiples of ``ALIGN``. Batch ``i``'s direct leaves are
    taken, in order, from ``direct[i]``."""
    if isinstance(spec, Leaf):
        if spec.direct:
            return [spec.delivered(next(tensors)) for tensors in direct]  # type: ignore[union-attr]
        assert buffer is not None
        size = spec.wire.itemsize
        strides, step = [], 1
        for extent in reversed(spec.shape):
            strides.append(step)
            step *= extent
        run = buffer.view(spec.wire).as_strided(
            (n, *spec.shape), (stride // size, *reversed(strides)), (offset + spec.offset) // size
        )  # (n, *shape): batch i's tensor at run[i]
        if spec.wire != spec.dtype:
            run = run.to(spec.dtype)  # one widening kernel for the whole run
        if spec.order is not None:
            run = run.permute(0, *(d + 1 for d in spec.order))
        return list(run.unbind(0))
    if isinstance(spec, _StackSpec):
        return [spec.kind(t.unbind(0)) for t in rebuild_run(buffer, spec.leaf, offset, stride, n)]
    if isinstance(spec, _RaggedSpec):
        values = rebuild_run(buffer, spec.values, offset, stride, n, direct)
        offsets = rebuild_run(buffer, spec.offsets, offset, stride, n, direct)
        return [Ragged(v, o, spec.host_offsets) for v, o in zip(values, offsets, strict=True)]
    if isinstance(spec, _Node):
        columns = spec.items(
            lambda child: rebuild_run(buffer, child, offset, stride, n, direct),
            lambda whole: _run_columns(rebuild_run(buffer, whole, offset, stride, n)),
        )
        columns = list(columns)
        # No children (an empty list, tuple or dict): still one empty container a batch.
        rows = zip(*columns, strict=True) if columns else ([] for _ in range(n))
        return [spec.build(list(row)) for row in rows]
    return [spec] * n  # a value that is not data to move


def _run_columns(stacked: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """A run's (count, *shape) tensor of each of n batches as count columns of n tensors."""
    return [list(column) for column in zip(*(t.unbind(0) for t in stacked), strict=True)]


def unpack(
    packed: Packed, device: Device | torch.device | str | int, non_blocking: bool = True
) -> Any:
    """One copy of ``packed`` to ``device``, then the batch rebuilt there.

    ``non_blocking`` only helps when ``packed.buffer`` is pinned; the caller must keep the
    host buffer unchanged until the copy completes (``DeviceLoader`` does this with events).
    """
    if not isinstance(packed, Packed):
        raise GpuflowError(
            f"unpack takes what pack() returned, got a {type(packed).__name__}; move a "
            "tensor with .to(), or pack() the batch first"
        )
    target = device if isinstance(device, torch.device) else Device.resolve(device).torch
    try:
        # copy=True: to the buffer's own device (the cpu) .to() would hand back the buffer
        # itself, and the batch would change with the buffer's next use.
        on_device = packed.buffer[: packed.nbytes].to(target, non_blocking=non_blocking, copy=True)
    except (AssertionError, RuntimeError):
        # A torch.device is taken as it is, unchecked on the way (once a batch); a copy that
        # fails is checked here, so a device this machine lacks is one line, as elsewhere.
        try:
            if target.type != "meta":
                Device.resolve(target)
        except GpuflowError as missing:
            raise missing from None
        raise
    return rebuild(on_device, packed.spec)
