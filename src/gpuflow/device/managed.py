"""Device tensors in CUDA managed (unified) memory: ``data.placement = "managed"``.

torch has no door to ``cudaMallocManaged``, so the allocation goes through CUDA's own
Python bindings (``cuda-python``: ``pip install 'gpuflow[managed]'``) and reaches torch as a
CUDA array, freed when the last tensor over it is. The memory is advised read-mostly for the
device and prefetched there, so a corpus in it is read at device speed while the host can
still see it.

A process that asks for more managed memory than the device has free can hang a GPU that
others share, so a request past the device's free memory is refused. Oversubscription is
what managed memory is for on coherent platforms (Grace Hopper, GB10), and is not tried here.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device

PLACEMENTS = ("device", "managed")


def _runtime() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError:
        raise GpuflowError(
            "data.placement=managed needs CUDA's Python bindings: pip install 'gpuflow[managed]' "
            "(cuda-python), or use data.placement=device"
        ) from None
    return runtime


def _check(result: tuple, what: str) -> Any:
    """The value of a cuda-python call, or an error naming the call and CUDA's reason."""
    error, *value = result
    if int(error) != 0:
        raise GpuflowError(f"{what} failed: {error.name if hasattr(error, 'name') else error}")
    return value[0] if value else None


class _ManagedBuffer:
    """Owns one managed allocation; torch sees it through ``__cuda_array_interface__``."""

    def __init__(self, nbytes: int, device: Device) -> None:
        runtime = _runtime()
        self.pointer = int(
            _check(
                runtime.cudaMallocManaged(nbytes, runtime.cudaMemAttachGlobal), "cudaMallocManaged"
            )
        )
        weakref.finalize(self, _free, runtime, self.pointer)
        advice = runtime.cudaMemoryAdvise.cudaMemAdviseSetReadMostly
        _check(
            runtime.cudaMemAdvise(self.pointer, nbytes, advice, _on_device(runtime, device.index)),
            "cudaMemAdvise(read-mostly)",
        )
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self.pointer, False),
            "version": 3,
        }


def _on_device(runtime: Any, index: int) -> Any:
    """CUDA 13's location argument: device ``index``."""
    where = runtime.cudaMemLocation()
    where.type = runtime.cudaMemLocationType.cudaMemLocationTypeDevice
    where.id = index
    return where


def _free(runtime: Any, pointer: int) -> None:
    runtime.cudaFree(pointer)


def managed_empty(numel: int, dtype: torch.dtype, device: Device) -> torch.Tensor:
    """An uninitialised (numel,) tensor of ``dtype`` in managed memory, advised read-mostly
    for ``device``; ``prefetch_to_device`` moves it there once written."""
    if device.type != "cuda":
        raise GpuflowError(
            f"managed memory is CUDA's; data.placement=managed cannot run on {device}"
        )
    nbytes = numel * dtype.itemsize
    free, total = torch.cuda.mem_get_info(device.index)
    if nbytes > free:
        raise GpuflowError(
            f"the corpus needs {nbytes / 1e9:.2f} GB of managed memory but {device} has "
            f"{free / 1e9:.2f} GB of {total / 1e9:.2f} GB free; managed memory past the free "
            "memory is refused (it can hang a shared GPU): lower data.device_budget_mb or use "
            "data.placement=device"
        )
    buffer = _ManagedBuffer(nbytes, device)
    raw = torch.as_tensor(buffer, device=device.torch)  # (nbytes,) uint8; keeps buffer alive
    return raw.view(dtype)


def prefetch_to_device(tensor: torch.Tensor) -> None:
    """Queue the migration of a ``managed_empty`` tensor's pages to its device on the
    current stream (device work: no wait)."""
    runtime = _runtime()
    where = _on_device(runtime, tensor.device.index)
    nbytes = tensor.numel() * tensor.element_size()
    stream = torch.cuda.current_stream(tensor.device).cuda_stream
    _check(
        runtime.cudaMemPrefetchAsync(tensor.data_ptr(), nbytes, where, 0, stream),
        "cudaMemPrefetchAsync",
    )
