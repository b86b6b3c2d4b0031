"""A pytest plugin (loaded automatically once gpuflow is installed) for transfer budgets.

    @pytest.mark.transfer_budget(h2d_bytes=2 * 4096, syncs=0)
    def test_step_moves_only_token_ids():
        train_step()                      # fails with BudgetExceeded and the offenders

    def test_no_download(transfer_ledger):
        evaluate()
        assert transfer_ledger.summary().totals.d2h_bytes == 0

The marker takes ``gpuflow.budget``'s limits; the fixture is an open ``TransferLedger``
around the test's body.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

# gpuflow's modules (and torch) load only when a test uses the marker or the fixture, so
# the plugin costs nothing in test runs that do not.


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "transfer_budget(h2d_bytes=None, d2h_bytes=None, d2d_bytes=None, syncs=None, "
        "device_allocs=None, disk2d_bytes=None, at_site=False): fail when the test's body "
        "moves, waits or allocates more (gpuflow.budget; at_site=True fails at the offending "
        "operation)",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    marker = item.get_closest_marker("transfer_budget")
    if marker is None:
        return (yield)
    if marker.args:
        raise pytest.UsageError("transfer_budget takes keyword limits only, e.g. syncs=0")
    from gpuflow.accounting.budgets import budget

    with budget(**marker.kwargs):
        return (yield)


@pytest.fixture
def transfer_ledger() -> Iterator[Any]:
    """An open ``gpuflow.TransferLedger`` around the test's body."""
    from gpuflow.accounting.ledger import TransferLedger

    with TransferLedger() as ledger:
        yield ledger
