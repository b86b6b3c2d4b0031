"""Small uploads outside the data path: the table the host rewrites when values change."""

from __future__ import annotations

import torch

from gpuflow.transfer.upload import DeviceTable


def test_a_device_table_copies_only_when_its_values_change(monkeypatch):
    table = DeviceTable(3, torch.device("cpu"))
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor,
        "copy_",
        lambda self, src, *a, **k: (
            copies.append(self is table.tensor) or real_copy(self, src, *a, **k)
        ),
    )
    table.write([1, 2, 3])
    table.write([1, 2, 3])  # the values it holds: nothing moves
    table.write((4, 5, 6))
    assert copies.count(True) == 2
    assert table.tensor.tolist() == [4, 5, 6] and table.values == [4, 5, 6]
