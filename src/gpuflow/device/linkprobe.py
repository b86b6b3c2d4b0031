"""A short measurement of the host-device link: what a copy of each kind really costs here."""

from __future__ import annotations

import statistics

import torch

from gpuflow.device.accelerator import Device

PROBE_BYTES = 64 << 20


def probe_link(device: Device, nbytes: int = PROBE_BYTES, repeats: int = 5) -> dict[str, float]:
    """Median GB/s (1e9 bytes/s) of each copy kind, for ``nbytes`` at a time.

    Keys: ``h2d_pinned``, ``h2d_pageable``, ``d2h_pinned``, ``d2h_pageable`` and ``d2d``
    (bytes read plus bytes written, i.e. memory bandwidth). Empty on the cpu, where
    there is no link to measure.
    """
    if not device.is_accelerator:
        return {}
    n = nbytes // 4
    # Random data: a link or allocator that special-cases zeros must not flatter the numbers.
    host_pageable = torch.rand(n)
    host_pinned = host_pageable.pin_memory() if device.supports_pinned_memory else host_pageable
    on_device = torch.rand(n, device=device.torch)
    device_copy = torch.empty_like(on_device)
    host_out_pageable = torch.empty_like(host_pageable)
    host_out_pinned = torch.empty_like(host_pinned)
    if device.supports_pinned_memory:
        host_out_pinned = host_out_pinned.pin_memory()

    copies = {
        "h2d_pinned": (lambda: on_device.copy_(host_pinned, non_blocking=True), nbytes),
        "h2d_pageable": (lambda: on_device.copy_(host_pageable), nbytes),
        "d2h_pinned": (lambda: host_out_pinned.copy_(on_device, non_blocking=True), nbytes),
        "d2h_pageable": (lambda: host_out_pageable.copy_(on_device), nbytes),
        "d2d": (lambda: device_copy.copy_(on_device), 2 * nbytes),
    }
    result = {}
    for name, (copy, moved) in copies.items():
        ms = statistics.median(device.time_ms(copy, repeats=repeats))
        result[name] = moved / (ms * 1e-3) / 1e9
    return result
