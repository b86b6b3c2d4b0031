"""Transfer budgets as tests: gpuflow's pytest plugin in your own suite.

Installing gpuflow registers the plugin. A test marked ``transfer_budget`` fails, naming the
line, when its body moves, waits or allocates more than it allows; the ``transfer_ledger``
fixture is an open ``TransferLedger`` around the test's body, to assert on yourself.

    python -m pytest examples/test_transfer_budgets.py

On a cpu a read of a tensor's data (``.item()``, ``float(loss)``) counts as the sync it would
be on a GPU, so a stray ``loss.item()`` fails ``syncs=0`` there too.
"""

import numpy as np
import pytest
import torch

from gpuflow import Device, DeviceLoader

DEVICE = Device.resolve("auto")
B, T = 8, 128  # a batch of token windows


def token_batches(n: int) -> list[np.ndarray]:
    """Windows of uint16 token ids, as a token file stores them: 2 bytes a token cross, and
    the model widens them on the device."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 50_000, size=(B, T + 1)).astype(np.uint16) for _ in range(n)]


@pytest.fixture
def model() -> torch.nn.Module:
    """Built and moved before the test's body: setting up is not what is budgeted."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50_000, 32), torch.nn.Linear(32, 1)).to(
        DEVICE.torch
    )


@pytest.mark.transfer_budget(syncs=0, d2h_bytes=0)
def test_training_steps_never_wait_for_the_device(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with DeviceLoader(token_batches(4), DEVICE) as loader:
        for batch in loader:
            loss = model(batch[:, :-1].long()).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def test_each_batch_crosses_once_as_uint16(transfer_ledger):
    with DeviceLoader(token_batches(4), DEVICE) as loader:
        shapes = [tuple(batch.shape) for batch in loader]
    totals = transfer_ledger.summary().totals
    assert shapes == [(B, T + 1)] * 4
    assert totals.h2d_copies == 4  # one copy per batch
    assert totals.h2d_bytes == 4 * B * (T + 1) * 2  # 2 bytes a token
