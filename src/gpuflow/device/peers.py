"""Which GPUs reach each other's memory directly, and how fast a copy between two of them runs.

Peer access (NVLink or PCIe peer-to-peer) lets one CUDA device read and write another's
memory without staging through the host. PyTorch turns it on by itself, lazily: the first
``copy_`` between two GPUs asks the driver whether the source device can reach the
destination (``cudaDeviceCanAccessPeer``) and, if so, enables access for that ordered pair
and remembers the answer for the rest of the process. Where it cannot, the copy still
works; the driver stages it through host memory. So there is nothing here to switch on by
hand, only what to report and measure: ``gpuflow info`` shows both.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from gpuflow.common.errors import GpuflowError
from gpuflow.device.accelerator import Device, available_devices
from gpuflow.device.linkprobe import PROBE_BYTES

DeviceSpec = Device | torch.device | str | int


def cuda_devices() -> list[Device]:
    """Every CUDA device torch can use here (empty without one)."""
    return [d for d in available_devices() if d.type == "cuda"]


def _can_reach(src: Device, dst: Device) -> bool:
    if src == dst:
        return True  # a device always reaches its own memory
    if src.type != "cuda" or dst.type != "cuda":
        return False  # torch exposes no peer access for the other backends
    return bool(torch.cuda.can_device_access_peer(src.index, dst.index))


def peer_access_matrix(devices: Sequence[DeviceSpec]) -> list[list[bool]]:
    """``m[i][j]``: can ``devices[i]`` read and write ``devices[j]``'s memory directly?

    Always ``len(devices)`` square, with True on the diagonal (a device reaches its own
    memory). Off the diagonal, True only for two CUDA devices with peer access; any other
    pair (the cpu, xpu, mps, devices of two types) is False. So ``[cpu]`` gives ``[[True]]``
    and ``[]`` gives ``[]``.
    """
    resolved = [Device.resolve(d) for d in devices]
    return [[_can_reach(a, b) for b in resolved] for a in resolved]


def enable_peer_access(src_index: int, dst_index: int) -> bool:
    """Whether CUDA device ``src_index`` can reach ``dst_index``'s memory directly.

    Nothing to enable by hand: torch enables peer access itself, for this ordered pair, on
    the first copy between the two devices (see the module docstring); doing it here would
    take CUDA bindings of our own to repeat what torch does. So this reports whether that
    copy will go peer-to-peer: True for one device with itself, False where there is no
    CUDA.
    """
    if not torch.cuda.is_available():
        return False
    count = torch.cuda.device_count()
    for index in (src_index, dst_index):
        if not 0 <= index < count:
            raise GpuflowError(f"cuda:{index} does not exist: this machine has {count} GPU(s)")
    return _can_reach(Device("cuda", src_index), Device("cuda", dst_index))


def _current_device(device: Device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current one of its backend, so that events record on its stream."""
    if device.type in ("cuda", "xpu"):
        return device.backend.device(device.index)
    return contextlib.nullcontext()


def measure_d2d(
    device_a: DeviceSpec, device_b: DeviceSpec, nbytes: int = PROBE_BYTES, repeats: int = 5
) -> float:
    """Median GB/s (1e9 bytes/s) of one copy of ``nbytes`` from ``device_a`` to ``device_b``.

    What counts as moved (the link probe's convention for its ``d2d`` key): within one device
    (a == b) the bytes read plus the bytes written, i.e. memory bandwidth, ``2 * nbytes``;
    between two devices the bytes that crossed, once, ``nbytes``. Timed with device events on
    ``device_a``'s current stream, where torch runs a cross-device copy, after one warm-up
    copy (which also lets torch enable peer access). On the cpu (cpu to cpu) it times a copy
    within host memory by the host clock; a host-device pair is ``probe_link``'s, not this.
    """
    a, b = Device.resolve(device_a), Device.resolve(device_b)
    if a.type != b.type:
        raise GpuflowError(
            f"measure_d2d copies between devices of one type, got {a} and {b}; "
            "host-device copies are measured by the link probe (`gpuflow info`)"
        )
    if nbytes < 4 or repeats < 1:
        raise GpuflowError(
            f"measure_d2d needs nbytes >= 4 and repeats >= 1, got {nbytes}, {repeats}"
        )
    n = nbytes // 4
    # Random data: a link or allocator that special-cases zeros must not flatter the numbers.
    src = torch.rand(n, device=a.torch)
    dst = torch.empty(n, device=b.torch)
    moved = (2 if a == b else 1) * n * 4
    with _current_device(a):
        ms = statistics.median(a.time_ms(lambda: dst.copy_(src), repeats=repeats))
    return moved / (ms * 1e-3) / 1e9


def peer_bandwidth_table(
    devices: Sequence[DeviceSpec], nbytes: int = PROBE_BYTES, repeats: int = 5
) -> dict[str, Any]:
    """Peer access and copy bandwidth for every ordered pair of ``devices``, the diagonal too.

    Returns ``devices`` (their names), ``access`` (``peer_access_matrix``), ``gb_per_s``
    (``gb_per_s[i][j]``: ``measure_d2d(devices[i], devices[j])``, so the diagonal counts read
    plus write and the rest counts bytes moved once), ``bytes`` per copy and ``repeats``.
    JSON-ready.
    """
    resolved = [Device.resolve(d) for d in devices]
    return {
        "devices": [str(d) for d in resolved],
        "access": peer_access_matrix(resolved),
        "gb_per_s": [[measure_d2d(a, b, nbytes, repeats) for b in resolved] for a in resolved],
        "bytes": nbytes,
        "repeats": repeats,
    }


def peer_report(selected: DeviceSpec) -> dict[str, Any]:
    """``gpuflow info``'s peers section: ``peer_bandwidth_table`` over this machine's GPUs
    when the selected device is a CUDA GPU, else the same keys, empty, with a ``note``."""
    device = Device.resolve(selected)
    gpus = cuda_devices()
    if gpus and device.type == "cuda":
        return {**peer_bandwidth_table(gpus), "note": None}
    note = (
        f"skipped: the selected device is {device}, not a cuda GPU"
        if gpus
        else "no peer GPUs: this machine has no cuda device"
    )
    return {
        "devices": [],
        "access": [],
        "gb_per_s": [],
        "bytes": None,
        "repeats": None,
        "note": note,
    }
