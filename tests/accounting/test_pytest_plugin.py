"""gpuflow's pytest plugin (``gpuflow.accounting.testing``): its marker is registered, leaves
unmarked tests alone, takes keyword limits only, and its fixture is a ledger around the test.

Each pytest run is a process of its own: torch modules first imported inside an in-process
run would be dropped after it, and could not be imported again."""

from __future__ import annotations

import pytest

from gpuflow.accounting import testing
from tests.helpers import child_env, plugin_args


@pytest.fixture(autouse=True)
def child_imports_this_gpuflow(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])


def test_the_plugin_loads_nothing_heavy_at_import():
    assert not hasattr(testing, "torch") and not hasattr(testing, "budget")
    assert callable(testing.pytest_configure) and callable(testing.pytest_runtest_call)


def test_the_marker_is_registered_with_its_limits(pytester):
    result = pytester.runpytest_subprocess("--markers", *plugin_args())
    result.stdout.fnmatch_lines(
        ["@pytest.mark.transfer_budget(h2d_bytes=None, d2h_bytes=None, d2d_bytes=None, syncs=*"]
    )


def test_the_marker_and_the_fixture_in_a_users_tests(pytester):
    pytester.makepyfile(
        """
        import pytest
        import torch
        from gpuflow.accounting.ledger import TransferLedger
        from gpuflow.device.accelerator import Device

        seen = []

        @pytest.mark.transfer_budget(0)
        def test_positional():
            pass

        def test_unmarked_may_wait():
            Device("cpu").synchronize()

        @pytest.mark.transfer_budget(syncs=1, device="cpu")
        def test_within_its_limit():
            Device("cpu").synchronize()

        @pytest.mark.transfer_budget(h2d_bytes=8, device="cpu")
        def test_over():
            torch.ones(4).to("meta", non_blocking=True)

        def test_counts(transfer_ledger):
            assert isinstance(transfer_ledger, TransferLedger)
            torch.ones(4).to("meta", non_blocking=True)
            assert transfer_ledger.summary().totals.h2d_bytes == 16
            seen.append(transfer_ledger)

        def test_then_closed():
            torch.ones(4).to("meta", non_blocking=True)
            assert seen[0].summary().totals.h2d_bytes == 16  # nothing counted after its test
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *plugin_args())
    result.assert_outcomes(passed=4, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*transfer_budget takes keyword limits only, e.g. syncs=0*",
            "*h2d_bytes: 16 > 8*",
            "FAILED *::test_positional*",
            "FAILED *::test_over*",
        ]
    )
