"""One handle over torch's accelerators (cuda, xpu, mps) and the cpu.

Everything above this layer asks a ``Device`` instead of branching on ``torch.cuda``;
on the cpu every call has a synchronous fallback with the same signature, so CI
exercises the same code paths a GPU run takes.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.common.procmem import resident_bytes
from gpuflow.device.allocator import allocator_in

ACCELERATOR_TYPES = ("cuda", "xpu", "mps")

# Dense bf16 tensor-core peaks from vendor datasheets (FLOP/s), matched against the device
# name in order, most specific first. Unknown devices get no MFU rather than a guess.
_PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIE"), 756e12),
    (("H100",), 989e12),
    (("H200",), 989e12),
    (("H800",), 989e12),
    (("GH200",), 989e12),
    (("B200",), 2250e12),
    (("A100",), 312e12),
    (("A800",), 312e12),
    (("L40S",), 362e12),
)


def _backend_available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    if device_type == "mps":
        return torch.backends.mps.is_available()
    module = getattr(torch, device_type, None)
    return bool(module is not None and module.is_available())


def _backend_count(device_type: str) -> int:
    if device_type in ("cpu", "mps"):
        return 1
    return getattr(torch, device_type).device_count()


class HostEvent:
    """A device event's stand-in where work is synchronous (the cpu) or has no events (mps).

    ``record`` waits for queued work (a no-op on the cpu) and notes the host clock, so a
    recorded event is always complete and ``elapsed_time`` measures what really ran.
    """

    def __init__(self, device: Device | None = None) -> None:
        self._device = device
        self._time: float | None = None

    def record(self, stream: object = None) -> None:
        if self._device is not None:
            self._device.synchronize()
        self._time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end``, like ``torch.cuda.Event.elapsed_time``."""
        if self._time is None or end._time is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end._time - self._time) * 1e3


class HostStream:
    """A stream's stand-in where work runs in issue order: every wait is already satisfied."""

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_HOST_STREAM = HostStream()


@dataclass(frozen=True)
class Device:
    """An accelerator (or the cpu) and what it can do.

    ``Device.resolve("auto")`` picks cuda, then xpu, then mps, then cpu.
    """

    type: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.type not in (*ACCELERATOR_TYPES, "cpu"):
            raise GpuflowError(
                f"unknown device type {self.type!r}; use auto, cpu, cuda, cuda:N, xpu or mps"
            )

    @classmethod
    def resolve(cls, spec: str | int | torch.device | Device | None = "auto") -> Device:
        """Parse ``auto``, ``cpu``, ``cuda``, ``cuda:1``, ... (or take a ``torch.device``, or
        an int: as PyTorch reads it, that index of the machine's accelerator) and check that
        it exists."""
        if isinstance(spec, Device):
            return spec
        if isinstance(spec, int) and not isinstance(spec, bool):
            kinds = [t for t in ACCELERATOR_TYPES if _backend_available(t)]
            if not kinds:
                raise GpuflowError(
                    f"device {spec} is an accelerator's index, and this machine has no "
                    "accelerator; pass 'cpu'"
                )
            spec = f"{kinds[0]}:{spec}"
        if isinstance(spec, torch.device):
            spec = str(spec)  # "cuda" without an index is taken as cuda:0, as the string is
        if spec is not None and not isinstance(spec, str):
            raise GpuflowError(
                f"a device is a name ('cuda', 'cuda:1', 'cpu', 'auto'), an index or a "
                f"torch.device, got {spec!r}"
            )
        spec = (spec or "auto").strip().lower()
        if spec == "auto":
            for device_type in ACCELERATOR_TYPES:
                if _backend_available(device_type):
                    return cls(device_type, 0)
            return cls("cpu", 0)
        device_type, _, index_text = spec.partition(":")
        if index_text and not index_text.isdigit():
            raise GpuflowError(f"bad device {spec!r}; write it as TYPE or TYPE:INDEX, e.g. cuda:0")
        device = cls(device_type, int(index_text or 0))
        if not _backend_available(device.type):
            raise GpuflowError(
                f"device {spec!r} is not available on this machine; "
                "run `gpuflow info` to see what is, or use the cpu ('cpu', or --device cpu "
                "on the command line)"
            )
        if device.index >= _backend_count(device.type):
            raise GpuflowError(
                f"device {spec!r} does not exist: this machine has "
                f"{_backend_count(device.type)} {device.type} device(s)"
            )
        return device

    @classmethod
    def of(cls, device: torch.device) -> Device:
        """The ``Device`` of a torch device (a tensor's ``.device``), no availability check."""
        return cls(device.type, device.index or 0)

    # ---- identity -------------------------------------------------------------------------

    @property
    def torch(self) -> torch.device:
        if self.type in ("cpu", "mps"):
            return torch.device(self.type)
        return torch.device(self.type, self.index)

    @property
    def is_accelerator(self) -> bool:
        return self.type != "cpu"

    @property
    def backend(self) -> Any:
        """torch's per-backend module (``torch.cuda``, ``torch.xpu``, ``torch.mps``), or None."""
        return None if self.type == "cpu" else getattr(torch, self.type)

    def __str__(self) -> str:
        return str(self.torch)

    def name(self) -> str:
        if self.type in ("cuda", "xpu"):
            return self.backend.get_device_name(self.index)
        if self.type == "mps":
            return "Apple GPU (mps)"
        import platform

        return platform.processor() or platform.machine() or "cpu"

    def total_memory(self) -> int | None:
        """Device memory in bytes, or None where torch does not report it."""
        if self.type in ("cuda", "xpu"):
            return int(self.backend.get_device_properties(self.index).total_memory)
        return None

    def peak_bf16_flops(self) -> float | None:
        """Datasheet dense bf16 peak, for MFU; None when the device is not in the table."""
        if self.type != "cuda":
            return None
        name = self.name().upper()
        for needles, flops in _PEAK_BF16_FLOPS:
            if all(n in name for n in needles):
                return flops
        return None

    # ---- capabilities ---------------------------------------------------------------------

    @property
    def supports_pinned_memory(self) -> bool:
        return self.type in ("cuda", "xpu")

    @property
    def supports_bf16_autocast(self) -> bool:
        return self.type in ("cuda", "xpu")

    @property
    def supports_fused_adamw(self) -> bool:
        return self.type == "cuda"

    # ---- execution ------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Block the host until all queued device work is done (a no-op on the cpu)."""
        if self.type in ("cuda", "xpu"):
            self.backend.synchronize(self.index)
        elif self.type == "mps":
            torch.mps.synchronize()

    def autocast(self, cache: bool = True) -> contextlib.AbstractContextManager:
        """bf16 autocast where the hardware has bf16 matrix units, else a no-op. ``cache``
        False for code captured in a CUDA graph (cached casts would outlive the capture)."""
        if self.supports_bf16_autocast:
            return torch.autocast(device_type=self.type, dtype=torch.bfloat16, cache_enabled=cache)
        return contextlib.nullcontext()

    # ---- streams and events ---------------------------------------------------------------
    # cuda and xpu get real streams and events; elsewhere work runs in issue order, and the
    # stand-ins above give the same API, so code above this layer never branches on backend.

    @property
    def has_streams(self) -> bool:
        return self.type in ("cuda", "xpu")

    def new_stream(self) -> Any:
        """A side stream for copies (a ``HostStream`` where there are no streams)."""
        if self.has_streams:
            return self.backend.Stream(device=self.torch)
        return _HOST_STREAM

    def current_stream(self) -> Any:
        if self.has_streams:
            return self.backend.current_stream(self.torch)
        return _HOST_STREAM

    def current_stream_key(self) -> Any:
        """Which stream is current, cheaply: on cuda a tuple from torch's own lookup,
        without the ``Stream`` object ``current_stream()`` builds (5-7 us each on an H100
        host, which a loader asking once per batch would pay on every batch)."""
        if self.type == "cuda":
            return torch._C._cuda_getCurrentStream(self.index)  # (stream id, device, type)
        return self.current_stream()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Make ``stream`` current for the work queued inside the block."""
        if self.type == "cuda" and torch._C._cuda_getDevice() == stream.device_index:
            return _CudaStreamSwap(stream)
        if self.has_streams:
            return self.backend.stream(stream)
        return contextlib.nullcontext()

    def new_event(self, timing: bool = False) -> Any:
        """A device event; ``timing=True`` lets ``elapsed_time`` be read from it."""
        if self.has_streams:
            return self.backend.Event(enable_timing=timing)
        return HostEvent(self if self.type == "mps" else None)

    def time_ms(self, fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> list[float]:
        """Run ``fn`` ``warmup + repeats`` times; return each timed run's device time in ms.

        Timed with device events, so the host does not idle between runs where the backend
        has them; on the cpu the host clock is the device clock.
        """
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start, end = self.new_event(timing=True), self.new_event(timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        return times

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory where the device can use it, else plain memory."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.supports_pinned_memory)

    def configure_for_training(self) -> None:
        """Settings every training process on this device wants."""
        if self.type == "cuda":
            torch.cuda.set_device(self.index)
            torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left

    def rng_state(self) -> torch.Tensor | None:
        if self.type in ("cuda", "xpu"):
            return self.backend.get_rng_state(self.index)
        return None

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self.type in ("cuda", "xpu"):
            self.backend.set_rng_state(state, self.index)

    def memory_sample(self) -> dict[str, int | None]:
        """What the process holds now, read without waiting for the device: resident host
        memory, pinned host memory held by torch's pinned allocator, the device memory the
        caching allocator has handed out and reserved, and its cudaMalloc calls so far.
        None where this platform or device does not say."""
        sample: dict[str, int | None] = {
            "rss_bytes": resident_bytes(),
            "pinned_bytes": None,
            "device_allocated_bytes": None,
            "device_reserved_bytes": None,
            "device_mallocs": None,
        }
        if self.type == "cuda":
            stats = torch.cuda.memory_stats(self.index)
            host_stats = getattr(torch.cuda, "host_memory_stats", None)  # torch >= 2.5
            host = host_stats() if host_stats is not None else {}
            sample.update(
                pinned_bytes=int(host["allocated_bytes.current"])
                if "allocated_bytes.current" in host
                else None,
                device_allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
                device_reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
                device_mallocs=int(stats.get("segment.all.allocated", 0)),
            )
        return sample

    # ---- description ----------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Facts about the device for ``gpuflow info`` and run reports."""
        info: dict[str, Any] = {"device": str(self), "type": self.type, "name": self.name()}
        if self.type == "cuda":
            props = torch.cuda.get_device_properties(self.index)
            free, total = torch.cuda.mem_get_info(self.index)
            info.update(
                total_memory_bytes=int(total),
                free_memory_bytes=int(free),
                compute_capability=f"{props.major}.{props.minor}",
                multiprocessors=props.multi_processor_count,
                peak_bf16_tflops=(self.peak_bf16_flops() or 0) / 1e12 or None,
            )
        elif self.type == "xpu":
            info["total_memory_bytes"] = self.total_memory()
        elif self.type == "cpu":
            info["threads"] = torch.get_num_threads()
        return info


def allocator_settings() -> dict[str, Any]:
    """The caching allocator's configuration as torch will use it."""
    settings: dict[str, Any] = {
        name: os.environ[name]
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
        if name in os.environ
    }
    if torch.cuda.is_available():
        settings["cuda_backend"] = torch.cuda.get_allocator_backend()
        settings["train.allocator"] = allocator_in(os.environ)  # what the settings amount to
    return settings


def available_devices() -> list[Device]:
    """Every device torch can use here, accelerators first, the cpu last."""
    found = [
        Device(device_type, index)
        for device_type in ACCELERATOR_TYPES
        if _backend_available(device_type)
        for index in range(_backend_count(device_type))
    ]
    return [*found, Device("cpu")]


_OOM_FIGURES = re.compile(
    r"Tried to allocate (?P<asked>[\d.]+ \w+).*?total capacity of (?P<total>[\d.]+ \w+) "
    r"of which (?P<free>[\d.]+ \w+) is free",
    re.DOTALL,
)


def out_of_memory_figures(exc: BaseException) -> str:
    """What an out-of-memory error asked for and what was free, from torch's message."""
    found = _OOM_FIGURES.search(str(exc))
    if found:
        return f"{found['asked']} more was needed, {found['free']} of {found['total']} was free"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else "no figures given"


class _CudaStreamSwap:
    """``torch.cuda.stream(stream)`` for a stream of the current device, without its
    device lookups, which a loader switching streams once per batch felt
    (docs/decisions/037)."""

    __slots__ = ("_before", "_stream")

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __enter__(self) -> None:
        stream = self._stream
        self._before = torch._C._cuda_getCurrentStream(stream.device_index)  # (id, index, type)
        torch._C._cuda_setStream(
            stream_id=stream.stream_id, device_index=stream.device_index,
            device_type=stream.device_type,
        )  # fmt: skip

    def __exit__(self, *exc: object) -> None:
        stream_id, index, kind = self._before
        torch._C._cuda_setStream(stream_id=stream_id, device_index=index, device_type=kind)
