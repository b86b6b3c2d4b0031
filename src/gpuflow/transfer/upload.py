"""Small uploads outside the data path: a model's weights at setup, constant tables, and a
table the host rewrites now and then (``DeviceTable``).

Code above the transfer layer asks for these instead of calling ``.to(device)`` or copying
host lists itself, so that every crossing has one home and the ledger names its caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

Module = TypeVar("Module", bound=torch.nn.Module)


def place(module: Module, device: torch.device) -> Module:
    """``module`` with its parameters and buffers moved to ``device`` (once, at setup)."""
    return module.to(device)


def upload_values(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A constant (n,) table on ``device`` from host values (setup, not the hot path)."""
    return torch.tensor(values, dtype=dtype, device=device)


class DeviceTable:
    """An (n,) int64 table on the device that the host rewrites when its values change.

    A write is one small blocking copy from pageable memory: it happens between steps and
    rarely (MasterAdamW's gradient addresses: each eager warm-up step, once after a capture),
    so a pinned buffer and an event would buy nothing. Writing the values it already holds
    costs nothing.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.tensor = torch.zeros(size, dtype=torch.int64, device=device)  # (n,)
        self.values: list[int] | None = None

    def write(self, values: Sequence[int]) -> None:
        """Make the table hold ``values`` (the host waits for the copy)."""
        values = list(values)
        if values != self.values:
            self.tensor.copy_(torch.tensor(values, dtype=torch.int64))
            self.values = values
